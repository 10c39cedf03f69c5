"""Stage 1, capture: Dynamo's torch-level FX graph becomes a pre-dispatch ATen graph, traced under
the fake mode Dynamo used, so symbolic sizes stay symbolic and every node carries a fake value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx


def fake_inputs(example_inputs: Sequence[Any]) -> tuple[FakeTensorMode, list[Any]]:
    """Dynamo's fake mode and the example inputs converted into it (symbolic sizes reused)."""
    fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
    converted = [
        fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs
    ]
    return fake_mode, converted


def trace_pre_dispatch(
    gm: GraphModule, fake_mode: FakeTensorMode, inputs: list[Any]
) -> GraphModule:
    """Retrace `gm` at pre-dispatch ATen level. Running it through an Interpreter under
    `preserve_node_meta` carries each node's source location and module path to the new nodes."""

    def run(*args: Any) -> Any:
        return torch.fx.Interpreter(gm).run(*args)

    with fake_mode, fx_traceback.preserve_node_meta():
        return make_fx(run, pre_dispatch=True)(*inputs)


def trace_function(fn: Any, example_inputs: Sequence[Any], what: str) -> GraphModule:
    """`fn` traced to pre-dispatch ATen on fake copies of `example_inputs`; a ValueError naming
    `what` if it cannot be."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [
        fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs
    ]
    try:
        with fake_mode:
            # through *args, so parameters with defaults (F.relu's `inplace`) are not traced
            return make_fx(lambda *args: fn(*args), pre_dispatch=True)(*inputs)
    except Exception as error:
        raise ValueError(f"{what} could not be traced with the example inputs: {error}") from error
