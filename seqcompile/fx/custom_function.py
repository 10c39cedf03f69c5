"""A custom `torch.autograd.Function` with one output, as one node of the captured graph.

Dynamo records a Function as `autograd_function_apply(forward_body, backward_body, *inputs)`,
whose first result the graph then reads. Capture records a Function with one output as a call of
`apply_one(key, *inputs)` instead, a node with a tensor value, its bodies kept here under the key:
the pointwise fuser can take it into a region when its forward and its own backward are
element-wise (`patterns/pointwise_ops.py`), and a region's backward is then traced through the
Function, so the user's backward is what runs (`ops/pointwise/region.py`). Anything else keeps
the Function opaque.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.fx import GraphModule

AUTOGRAD_FUNCTION = torch.ops.higher_order.autograd_function_apply
_bodies: dict[str, tuple[GraphModule, GraphModule]] = {}
_keys: dict[tuple[int, int], str] = {}
_numbers = itertools.count()


def register(forward_body: GraphModule, backward_body: GraphModule) -> str:
    """The key `apply_one` finds the Function's bodies under (the same for the same bodies)."""
    ids = (id(forward_body), id(backward_body))
    if ids not in _keys:
        _keys[ids] = f"function{next(_numbers)}"
        _bodies[_keys[ids]] = (forward_body, backward_body)
    return _keys[ids]


def apply_one(key: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The Function's one output: its forward body's, differentiated by its backward body."""
    forward_body, backward_body = _bodies[key]
    return AUTOGRAD_FUNCTION(forward_body, backward_body, *args, **kwargs)[0]


def has_one_output(forward_body: GraphModule) -> bool:
    """Whether the forward body returns one tensor (Dynamo's bodies return (outputs, saved))."""
    output = next(n for n in reversed(forward_body.graph.nodes) if n.op == "output")
    returned = output.args[0]
    return (
        isinstance(returned, tuple | list)
        and len(returned) == 2
        and isinstance(returned[0], tuple | list)
        and len(returned[0]) == 1
    )
