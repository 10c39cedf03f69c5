"""A fused call replaced by a trace of what it runs, copied into the planned graph in its place:
- its lowering (`FusedOp.lowering`), plain ATen the executor (Inductor) compiles with the call's
  neighbours, where the call runs its lowering (`lower/choice.py`; on CPU under Inductor, every
  one); likewise its vendor body (`FusedOp.vendor`), ATen that calls a vendor's kernels. The
  gradient-accumulation ops (`ops/accumulate.py`) stay calls: each is one in-place ATen op on a
  parameter's `.grad`, which Inductor runs as it is, and so does the check every index a lowering
  reads from outside passes first (`ops/index_check.py`);
- its kernels' launches, where it runs its kernels and the executor can launch them
  (`lower/traced_launches.py`).

It runs after the memory plan: the graph's inputs and outputs, and so what the backward keeps,
stay the plan's. Each replaced output must keep the shape, dtype and strides of the call's fake
value, or the compile stops with the reason."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functionalize
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_flatten, tree_unflatten

from seqcompile.fx.nodes import same_shape
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call
from seqcompile.ops.index_check import check_indices

T = TypeVar("T")

__all__ = [
    "Traced",
    "call_inputs",
    "call_signature",
    "body_of",
    "inline_bodies",
    "inline_traced",
    "memoized",
    "traced_body",
    "traced_call",
]

BODIES = ("lowering", "vendor")
"""The implementations of a fused call that are plain ATen bodies, traced and inlined."""


def body_of(kind: str, target: Any) -> Callable[..., Any] | None:
    """The plain-ATen body of a `seqfast` op's implementation `kind` (one of `BODIES`), by its
    arguments' names (None for any other op, or one without that body)."""
    entry = registry.entry_of(target)
    if entry is None:
        return None
    if kind == "vendor":
        return entry.vendor.bodies.get(target) if entry.vendor is not None else None
    return entry.lowering.get(target)


def inline_bodies(
    gm: GraphModule, example_inputs: Sequence[Any], nodes: dict[Node, str]
) -> list[str]:
    """Replace each fused call of `nodes` in `gm` by its traced body of the kind given (one of
    `BODIES`); the names of the ops replaced, in order."""
    fake_mode = fake_mode_of(gm, example_inputs)
    lowered = []
    for node in list(gm.graph.nodes):
        kind = nodes.get(node)
        if kind is None or body_of(kind, node.target) is None:
            continue
        inline_traced(gm, node, traced_body(node, fake_mode, kind))
        lowered.append(str(node.target))
    if lowered:
        gm.recompile()
    return lowered


def fake_mode_of(gm: GraphModule, example_inputs: Sequence[Any]) -> FakeTensorMode:
    """The fake mode `gm`'s values were traced under (a fresh one where none is found)."""
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode([*example_inputs, *values]) or FakeTensorMode()


@dataclasses.dataclass(frozen=True)
class Traced:
    """A fused call's lowering (or its launches) traced at its fake values: `gm` takes the call's
    tensor arguments (`inputs`, the call's own argument nodes) in order and returns what the call
    returns."""

    gm: GraphModule
    inputs: tuple[Node, ...]


def traced_body(node: Node, fake_mode: Any, kind: str = "lowering") -> Traced:
    """The body `kind` (one of `BODIES`) of the fused call `node`, traced in plain ATen at its
    arguments' fake values (an index a gather reads from outside checked first, as eager
    would)."""

    def trace() -> GraphModule:
        gm = traced_call(node, body_of(kind, node.target), fake_mode).gm
        check_indices(gm, str(node.target))  # (Inductor's own check would end the process)
        return gm

    return Traced(memoized(kind, node, fake_mode, trace), call_inputs(node))


_TRACES: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()
"""Per fake mode (one compile's forward and backward) and call signature, each trace made: the
layers of a model make the same calls, traced once. A trace is shared: it is copied into graphs,
never changed."""


def memoized(kind: str, node: Node, fake_mode: Any, trace: Callable[[], T]) -> T:
    """`trace()`, made once per `kind` of trace and signature of the call `node` (its op, and each
    argument's layout or value) under `fake_mode`."""
    traces = _TRACES.setdefault(fake_mode, {})
    key = (kind, call_signature(node))
    if key not in traces:
        traces[key] = trace()
    return traces[key]


def call_signature(node: Node) -> tuple:
    """What a trace of the call `node` depends on: its op, and each argument's layout (a tensor's
    sizes, strides, offset, dtype and device) or value."""

    def described(leaf: Any) -> Any:
        value = leaf.meta.get("val") if isinstance(leaf, Node) else leaf
        if isinstance(value, torch.Tensor):
            layout = (value.shape, value.stride(), value.storage_offset())
            return ("tensor", *map(repr, layout), value.dtype, value.device)  # (sizes symbolic too)
        return ("node", repr(value)) if isinstance(leaf, Node) else ("literal", repr(value))

    return (node.target, tuple(described(leaf) for leaf in _leaves(node)))


def call_inputs(node: Node) -> tuple[Node, ...]:
    """The call's tensor arguments, in the order a trace of it takes them."""
    return tuple(leaf for leaf in _leaves(node) if isinstance(leaf, Node))


def _leaves(node: Node) -> list[Any]:
    call = Call.of(node)
    return tree_flatten({name: call[name] for name in call})[0]


def traced_call(node: Node, body: Callable[..., Any], fake_mode: Any) -> Traced:
    """`body`, a function of the fused call `node`'s arguments by name, traced at their fake
    values."""
    call = Call.of(node)
    leaves, spec = tree_flatten({name: call[name] for name in call})
    where = [i for i, value in enumerate(leaves) if isinstance(value, Node)]

    def flat(*tensors: torch.Tensor) -> Any:
        filled = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            filled[i] = t
        return body(**tree_unflatten(filled, spec))

    fakes = [leaves[i].meta["val"] for i in where]
    with fake_mode:
        traced = make_fx(
            functionalize(flat, remove="mutations"),
            select_decomp_table(),
            tracing_mode="real",
        )(*fakes)
    return Traced(traced, tuple(leaves[i] for i in where))


def inline_traced(gm: GraphModule, node: Node, lowering: Traced) -> None:
    """Copy `lowering` into `gm` in place of the call `node` it was traced from."""
    graph = gm.graph
    placeholders = [n for n in lowering.gm.graph.nodes if n.op == "placeholder"]
    copies = dict(zip(placeholders, lowering.inputs, strict=True))
    with graph.inserting_before(node):
        result = graph.graph_copy(lowering.gm.graph, copies)
    stack = node.meta.get("stack_trace")
    for original in lowering.gm.graph.nodes:
        copied = copies.get(original)
        if copied is not None and original.op == "call_function" and stack is not None:
            copied.meta.setdefault("stack_trace", stack)
    _replace_outputs(node, result)
    graph.erase_node(node)


def _replace_outputs(node: Node, result: Any) -> None:
    """Point the readers of `node` (a tensor, or `getitem`s of a tuple) at `result`'s nodes,
    each checked against the fake value it replaces."""
    if not node.users:
        return
    values = list(result) if isinstance(result, tuple | list) else [result]
    if len(values) == 1 and not isinstance(node.meta.get("val"), tuple | list):
        _check_like(values[0], node.meta.get("val"), str(node.target))
        node.replace_all_uses_with(values[0])
        return
    for user in list(node.users):
        index = user.args[1]
        _check_like(values[index], user.meta.get("val"), f"{node.target} output {index}")
        user.replace_all_uses_with(values[index])
        user.graph.erase_node(user)


def _check_like(new: Node, old: Any, name: str) -> None:
    value = new.meta.get("val")
    if not isinstance(old, torch.Tensor) or not isinstance(value, torch.Tensor):
        return
    same = value.dim() == old.dim() and same_shape(value, old) and value.dtype == old.dtype
    if same and not statically_known_true(old.numel() == 0):
        dims = [d for d in range(old.dim()) if not statically_known_true(old.shape[d] == 1)]
        same = all(statically_known_true(value.stride(d) == old.stride(d)) for d in dims)
    if not same:
        raise RuntimeError(
            f"the trace of {name} gives shape {tuple(value.shape)}, dtype {value.dtype},"
            f" strides {value.stride()} where the op gives {tuple(old.shape)}, {old.dtype},"
            f" {old.stride()}"
        )
