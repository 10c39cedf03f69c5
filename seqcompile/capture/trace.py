"""Stage 1, capture: Dynamo's torch-level FX graph becomes a pre-dispatch ATen graph, traced under
the fake mode Dynamo used, so symbolic sizes stay symbolic and every node carries a fake value.

Two things Dynamo keeps as regions are opened up: autocast regions become explicit casts
(`autocast.py`), and `torch.utils.checkpoint` regions are inlined with each traced node tagged
for recomputation (`meta["recompute"]`, `meta["ac_graph_id"]`, as torch tags them), so patterns
fuse inside them and the partitioner recomputes them in the backward. A custom
`torch.autograd.Function` stays one opaque node: its backward is the user's, so nothing inside it
may be fused or differentiated another way (inlined, its forward would run without grad and its
parameters would get no gradient).

Ops on DTensors (tensor parallelism's sharded weights and activations) are traced as any op is,
their nodes holding DTensor fake values, so the families fuse them too: a fused op on DTensors runs
on the shards by its sharding rule (`ops/sharding.py`), and a pattern refuses placements the rule
does not take. DTensor's conversions (`from_local`, `redistribute`, `to_local`, `full_tensor`),
which do not trace at pre-dispatch, are kept as nodes of their own, recorded untraced, as is an
op on DTensors whose trace fails: AOTAutograd later runs them through DTensor's own dispatch. The
report says how many are kept so."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import (
    disable_proxy_modes_tracing,
    get_proxy_mode,
    make_fx,
    track_tensor_tree,
)
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy

from seqcompile.capture import autocast
from seqcompile.fx import custom_function
from seqcompile.fx.custom_function import AUTOGRAD_FUNCTION, has_one_output
from seqcompile.fx.nodes import erase_unused, grad_enabled_at, is_dtensor, site_name
from seqcompile.report import Missed


class Uncompilable(Exception):
    """The graph holds something seqfast cannot keep correct; it runs as Dynamo captured it."""


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

    notes: list[Missed] = []
    regions = itertools.count(1)
    on_dtensors: Counter[str] = Counter()

    def run(*args: Any) -> Any:
        return _CaptureInterpreter(gm, regions, notes, on_dtensors).run(*args)

    with fake_mode, fx_traceback.preserve_node_meta():
        traced = make_fx(run, pre_dispatch=True)(*inputs)
    _drop_grad_mode_round_trips(traced)
    autocast.make_autocast_explicit(traced, fake_mode)
    if on_dtensors:
        ops = ", ".join(f"{name} ({n})" for name, n in sorted(on_dtensors.items()))
        reason = f"DTensor conversions, kept whole and run as DTensor dispatches them: {ops}"
        notes.append(Missed("graph", "dtensor", reason))
    traced.meta["capture_notes"] = notes
    return traced


CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
DATA = torch._C._autograd._get_data_attr
"""`tensor.data` as Dynamo records it; traced as is, the result is a new tensor make_fx keeps as a
constant (the fake value at trace time) instead of a node reading the input."""


class _CaptureInterpreter(torch.fx.Interpreter):
    """Runs Dynamo's graph with its autocast regions really entered, so the ops traced inside
    record autocast's dtypes (replaying `_enter_autocast` under pre-dispatch tracing only
    records it), and with checkpoint regions run inline, their nodes tagged for recomputation."""

    def __init__(
        self,
        gm: GraphModule,
        regions: Iterator[int],
        notes: list[Missed],
        on_dtensors: Counter[str],
    ) -> None:
        super().__init__(gm)
        self.regions, self.notes, self.on_dtensors = regions, notes, on_dtensors

    def run_node(self, n: torch.fx.Node) -> Any:
        self.node = n
        calls = n.op in ("call_function", "call_method") and n.target is not CHECKPOINT
        if not calls or not _on_dtensors(n):
            return super().run_node(n)
        if not _dtensor_conversion(n):
            graph = get_proxy_mode().tracer.graph
            before = set(graph.nodes)
            try:
                return super().run_node(n)
            except Exception:  # kept whole instead, as DTensor runs it eagerly
                erase_unused(m for m in graph.nodes if m not in before)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.on_dtensors[n.target if n.op == "call_method" else _name(n.target)] += 1
        if n.op == "call_method":
            return _record_opaque(dtensor_method, (n.target, *args), kwargs)
        return _record_opaque(n.target, args, kwargs)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is autocast.ENTER:
            return autocast.enter_for_trace(args)
        if target is autocast.EXIT:
            return args[0].__exit__(None, None, None)
        if target is CHECKPOINT:
            body, *operands = args
            self._tag(body)
            return _CaptureInterpreter(body, self.regions, self.notes, self.on_dtensors).run(
                *operands
            )
        if target is DATA:
            return args[0].detach()  # traced, not a constant baked from the traced value
        if target is AUTOGRAD_FUNCTION:
            if kwargs.get("dirty_idx"):
                raise Uncompilable(
                    f"{site_name(self.node)}: a custom autograd.Function modifies its inputs in"
                    " place (ctx.mark_dirty); kept as one node, later readers of those inputs"
                    " would not see the change"
                )
            if has_one_output(args[0]):  # one node, which the pointwise fuser may take
                key = custom_function.register(*args[:2])
                return (_record_opaque(custom_function.apply_one, (key, *args[2:]), kwargs),)
            self.notes.append(
                Missed(
                    site_name(self.node),
                    "custom autograd.Function",
                    "runs as written with its own backward; nothing inside it is fused",
                )
            )
            return _record_opaque(target, args, kwargs)
        return super().call_function(target, args, kwargs)

    def _tag(self, body: GraphModule) -> None:
        """Tag the region's nodes as torch's vanilla checkpoint does: everything recomputed. A
        selective policy (`context_fn`) is not evaluated: the region is recomputed whole."""
        if body.meta.get("_checkpoint_context_fn") is not None:
            self.notes.append(
                Missed(
                    site_name(self.node),
                    "checkpoint",
                    "a checkpoint's context_fn (selective policy) is not applied: the region is"
                    " recomputed whole",
                )
            )
        region = next(self.regions)
        for node in body.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                node.meta["ac_graph_id"] = region


CONVERSIONS = ("to_local", "redistribute", "full_tensor")
"""DTensor's methods that convert between placements or to a local tensor."""


def _dtensor_conversion(node: torch.fx.Node) -> bool:
    """Whether `node` calls one of DTensor's own conversions (a method, or a function of
    DTensor's such as `DTensor.from_local`), which pre-dispatch tracing cannot enter."""
    if node.op == "call_method":
        return node.target in CONVERSIONS
    module = getattr(node.target, "__module__", None) or ""
    return module.startswith("torch.distributed")


def _on_dtensors(node: torch.fx.Node) -> bool:
    """Whether `node` reads or returns a DTensor (by Dynamo's example values)."""
    values = [node.meta.get("example_value")]
    values += [a.meta.get("example_value") for a in node.all_input_nodes]
    return any(is_dtensor(v) for v in pytree.tree_leaves(values))


def dtensor_method(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    """`value.name(*args, **kwargs)`: a method call on a DTensor (`redistribute`, `to_local`) as
    the function a graph node calls."""
    return getattr(value, name)(*args, **kwargs)


def _name(target: Any) -> str:
    return getattr(target, "__name__", str(target))


def _drop_grad_mode_round_trips(gm: GraphModule) -> None:
    """Grad mode turned off and straight back on, where it was on (what tracing a custom
    Function's call leaves behind it), changes nothing: the two nodes go, so the ops on both
    sides may join one region."""
    for node in list(gm.graph.nodes):
        after = node.next
        if (
            node.op == "call_function"
            and node.target is torch._C._set_grad_enabled
            and node.args == (False,)
            and after.op == "call_function"
            and after.target is torch._C._set_grad_enabled
            and after.args == (True,)
            and grad_enabled_at(node)
        ):
            gm.graph.erase_node(node)
            gm.graph.erase_node(after)
    gm.recompile()


def _record_opaque(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record `target(*args, **kwargs)` as one node of the graph being traced, its graph-module
    arguments (a custom Function's forward and backward bodies) as submodules, instead of tracing
    through it. The values it returns are computed untraced."""
    mode = get_proxy_mode()
    root = mode.tracer.root
    for body in (a for a in args if isinstance(a, GraphModule)):
        taken = sum(isinstance(m, GraphModule) for m in root.children())
        root.register_module(f"opaque_body_{taken}", body)
    proxy_args, proxy_kwargs = pytree.tree_map(mode.tracer.unwrap_proxy, (args, kwargs))
    proxy = mode.tracer.create_proxy("call_function", target, proxy_args, proxy_kwargs)
    with disable_proxy_modes_tracing():
        out = target(*args, **kwargs)
    return track_tensor_tree(out, proxy, constant=None, tracer=mode.tracer)


def trace_function(
    fn: Any, example_inputs: Sequence[Any], what: str, symbolic: bool = False
) -> GraphModule:
    """`fn` traced to pre-dispatch ATen on fake copies of `example_inputs` (with a symbol for each
    size where `symbolic`, as a dynamic graph has them); a ValueError naming `what` if it cannot
    be."""
    shape_env = ShapeEnv(duck_shape=False) if symbolic else None
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)

    def fake(t: torch.Tensor) -> torch.Tensor:
        if not symbolic:
            return fake_mode.from_tensor(t)
        sizes = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())
        return fake_mode.from_tensor(t, symbolic_context=sizes)

    inputs = [fake(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    try:
        with fake_mode:
            # through *args, so parameters with defaults (F.relu's `inplace`) are not traced
            return make_fx(lambda *args: fn(*args), pre_dispatch=True)(*inputs)
    except Exception as error:
        raise ValueError(f"{what} could not be traced with the example inputs: {error}") from error
