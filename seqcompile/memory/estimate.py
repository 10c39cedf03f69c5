"""What a partitioned forward graph keeps for its backward, and byte counts of values at the
sizes the graph was traced with."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

from seqcompile.fx.nodes import concrete
from seqcompile.ops import registry


def tensor_bytes(value: torch.Tensor) -> int:
    return concrete(value.numel()) * value.element_size()


def graph_outputs(gm: GraphModule) -> list[Any]:
    """What `gm` returns, in order."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return list(output.args[0])


def saved_values(forward: GraphModule, num_fwd_outputs: int) -> list[Node]:
    """Forward outputs that only the backward reads (after the user-visible outputs)."""
    return [n for n in graph_outputs(forward)[num_fwd_outputs:] if isinstance(n, Node)]


_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def is_fused_output(node: Node) -> bool:
    while node.op == "call_function" and node.target in _ALIASES:
        node = node.args[0]
    source = node.args[0] if node.target is operator.getitem else node
    return registry.entry_of(source) is not None
