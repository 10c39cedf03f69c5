"""Stage 1, capture: Dynamo's torch-level FX graph becomes a pre-dispatch ATen graph, traced under
the fake mode Dynamo used, so symbolic sizes stay symbolic and every node carries a fake value.

Two things Dynamo keeps as regions are opened up: autocast regions become explicit casts
(`autocast.py`), and `torch.utils.checkpoint` regions are inlined with each traced node tagged
for recomputation (`meta["recompute"]`, `meta["ac_graph_id"]`, as torch tags them), so patterns
fuse inside them and the partitioner recomputes them in the backward."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from seqcompile import autocast


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
    """Retrace `gm` at pre-dispatch ATen level, then write its autocast regions' casts into it.
    Running it through an Interpreter under `preserve_node_meta` carries each node's source
    location and module path to the new nodes."""

    notes: list[str] = []
    regions = itertools.count(1)

    def run(*args: Any) -> Any:
        return _CaptureInterpreter(gm, regions, notes).run(*args)

    with fake_mode, fx_traceback.preserve_node_meta():
        traced = make_fx(run, pre_dispatch=True)(*inputs)
    autocast.make_autocast_explicit(traced, fake_mode)
    traced.meta["capture_notes"] = notes
    return traced


CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint


class _CaptureInterpreter(torch.fx.Interpreter):
    """Runs Dynamo's graph with its autocast regions really entered, so the ops traced inside
    record autocast's dtypes (replaying `_enter_autocast` under pre-dispatch tracing only
    records it), and with checkpoint regions run inline, their nodes tagged for recomputation."""

    def __init__(self, gm: GraphModule, regions: Iterator[int], notes: list[str]) -> None:
        super().__init__(gm)
        self.regions, self.notes = regions, notes

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is autocast.ENTER:
            return autocast.enter_for_trace(args)
        if target is autocast.EXIT:
            return args[0].__exit__(None, None, None)
        if target is CHECKPOINT:
            body, *operands = args
            self._tag(body)
            return _CaptureInterpreter(body, self.regions, self.notes).run(*operands)
        return super().call_function(target, args, kwargs)

    def _tag(self, body: GraphModule) -> None:
        """Tag the region's nodes as torch's vanilla checkpoint does: everything recomputed. A
        selective policy (`context_fn`) is not evaluated: the region is recomputed whole."""
        if body.meta.get("_checkpoint_context_fn") is not None:
            self.notes.append(
                "a checkpoint's context_fn (selective policy) is not applied: the region is"
                " recomputed whole"
            )
        region = next(self.regions)
        for node in body.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                node.meta["ac_graph_id"] = region


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
