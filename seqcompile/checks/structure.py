"""The structural check that runs after every stage: cheap, always on, and loud. A stage that
rewrote the graph must leave it computing what it computed before, as far as structure can tell:

- every node the stage kept but gave other inputs still computes, from its inputs' recorded fake
  values, the value recorded on it (a fused op whose output is laid out otherwise than the node it
  replaced breaks a `view` after it here, at the stage that did it, not deep inside AOTAutograd);
- the graph's outputs keep their shapes, dtypes and strides;
- every input that had a differentiable path to an output still has one (code that ends up under
  `no_grad`, or a gradient's route cut by a rewrite, would leave a parameter without a gradient);
- no fused pointwise op has an input its region does not read.

A violation raises `StructureError` naming the stage, the node and its source line.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, statically_known_true
from torch.utils._pytree import tree_leaves

from seqcompile.fx.nodes import site_name

_GRAD_MODE = torch._C._set_grad_enabled
_NOT_DIFFERENTIABLE = {
    torch.ops.aten.detach.default,
    torch.ops.aten.detach_.default,
    torch.detach,
    torch.Tensor.detach,
    torch.Tensor.detach_,
    torch._C._autograd._get_data_attr,  # `.data`
    "detach",
    "detach_",
}
"""Ops (ATen, method names and torch functions as Dynamo records them) whose float result carries
no gradient."""


class StructureError(RuntimeError):
    """A stage left the graph structurally different from what it was given."""


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a stage must keep: the outputs' fake values and which inputs reach an output along a
    differentiable path (None where it is not checked, as in AOTAutograd's graphs)."""

    outputs: tuple[Any, ...]
    differentiable: frozenset[int] | None
    reads: dict[Node, tuple[Node, ...]] = dataclasses.field(default_factory=dict)
    """The graph's nodes with their inputs, to tell what a stage that edits the graph in place
    rewired."""


def signature(gm: GraphModule, meta_key: str = "val", paths: bool = True) -> Signature:
    """`gm`'s outputs and, with `paths`, the inputs that require grad (as their recorded values
    say) and reach an output along a differentiable path."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outputs = tuple(_value(n, meta_key) for n in tree_leaves(output.args))
    reads = {n: tuple(n.all_input_nodes) for n in gm.graph.nodes}
    if not paths:
        return Signature(outputs, None, reads)
    inputs = [n.meta.get(meta_key) for n in gm.graph.nodes if n.op == "placeholder"]
    wanted = {i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad}
    return Signature(outputs, _differentiable_inputs(gm, meta_key) & wanted, reads)


def check(stage: str, gm: GraphModule, before: Signature) -> Signature:
    """Check `gm` after `stage` against the signature of the graph the stage was given; return
    `gm`'s signature for the next stage (the inputs with a path are still those of the graph
    Dynamo captured: the values recorded by later stages do not say which require grad)."""
    _check_values(stage, gm, before.reads)
    after = signature(gm, paths=False)
    if before.differentiable is not None:
        after = dataclasses.replace(after, differentiable=_differentiable_inputs(gm, "val"))
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    producers = tree_leaves(output.args)
    if len(after.outputs) != len(before.outputs):
        raise _error(stage, output, f"{len(before.outputs)} outputs became {len(after.outputs)}")
    for i, (was, now) in enumerate(zip(before.outputs, after.outputs, strict=True)):
        problem = _difference(was, now)
        if problem:
            raise _error(stage, producers[i], f"output {i} changed: {problem}")
    if before.differentiable is not None:
        lost = sorted(before.differentiable - after.differentiable)
        if lost:
            inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
            node = inputs[lost[0]]
            reader = next(iter(node.users), node)
            raise _error(
                stage,
                reader,
                f"input {node.name} no longer reaches an output along a differentiable path"
                " (its gradient would be lost)",
            )
    _check_fused_inputs(stage, gm)
    return dataclasses.replace(after, differentiable=before.differentiable)


def _value(node: Any, meta_key: str = "val") -> Any:
    return node.meta.get(meta_key) if isinstance(node, Node) else node


def _difference(was: Any, now: Any) -> str | None:
    """What differs between two fake values (None when nothing that matters does)."""
    if not isinstance(was, torch.Tensor) or not isinstance(now, torch.Tensor):
        return None
    if was.dtype != now.dtype:
        return f"dtype {was.dtype} became {now.dtype}"
    if was.dim() != now.dim() or not all(
        statically_known_true(a == b) for a, b in zip(was.shape, now.shape, strict=True)
    ):
        return f"shape {tuple(was.shape)} became {tuple(now.shape)}"
    for a, b, size in zip(was.stride(), now.stride(), was.shape, strict=True):
        if not statically_known_true(size == 1) and not statically_known_true(a == b):
            return f"strides {tuple(was.stride())} became {tuple(now.stride())}"
    return None


def _check_values(stage: str, gm: GraphModule, reads: dict[Node, tuple[Node, ...]]) -> None:
    """Recompute the fake value of every node that read other inputs before the stage (`reads`),
    from its inputs' recorded values, and compare. (Values depend on more than the recorded ones
    say, such as whether an input requires grad, so nodes the stage left alone are not
    recomputed, and a stage that built a new graph is not checked here.)"""
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(values)
    if fake_mode is None:
        return
    with fake_mode, torch.no_grad():
        for node in gm.graph.nodes:
            if node.op != "call_function" or "val" not in node.meta:
                continue
            if reads.get(node, tuple(node.all_input_nodes)) == tuple(node.all_input_nodes):
                continue
            recorded = node.meta["val"]
            if any(free_unbacked_symbols(t) for t in tree_leaves(recorded)) or any(
                n.op != "get_attr" and n.meta.get("val") is None for n in node.all_input_nodes
            ):
                continue
            args, kwargs = torch.fx.node.map_arg(
                (node.args, node.kwargs), lambda n: _arg_value(gm, n)
            )
            try:
                value = node.target(*args, **kwargs)
            except Exception as error:
                raise _error(stage, node, f"fails on its inputs' values: {error}") from None
            for was, now in zip(tree_leaves(recorded), tree_leaves(value), strict=False):
                problem = _difference(was, now)
                if problem:
                    raise _error(stage, node, f"its recorded value disagrees: {problem}")


def _arg_value(gm: GraphModule, node: Node) -> Any:
    if node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    return node.meta.get("val")


def _differentiable_inputs(gm: GraphModule, meta_key: str) -> frozenset[int]:
    """Indices of the inputs with a path to a floating-point output through ops run with grad
    mode on (as the graph switches it) that carry gradients."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    reach: dict[Node, frozenset[int]] = {
        n: frozenset([i]) if _floating(n.meta.get(meta_key)) else frozenset()
        for i, n in enumerate(inputs)
    }
    grad = torch.is_grad_enabled()
    found: frozenset[int] = frozenset()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "call_function" and node.target is _GRAD_MODE:
            grad = bool(node.args[0])
            continue
        sources = frozenset().union(*(reach.get(a, frozenset()) for a in node.all_input_nodes))
        if node.op == "output":
            found = frozenset().union(
                *(reach.get(a, frozenset()) for a in tree_leaves(node.args) if isinstance(a, Node))
            )
            continue
        value = node.meta.get(meta_key)
        carries = (
            grad and node.target not in _NOT_DIFFERENTIABLE and (value is None or _floating(value))
        )
        reach[node] = sources if carries else frozenset()
        written = _written(node)
        if written is not None:
            # the tensor keeps its history (an in-place op under no_grad adds none); `detach_`
            # ends it, for every later reader of the tensor too
            detached = node.target in _NOT_DIFFERENTIABLE
            reach[node] = frozenset() if detached else reach.get(written, frozenset()) | reach[node]
            reach[written] = reach[node]
    return found


def _written(node: Node) -> Node | None:
    """The tensor an in-place op writes (the argument its schema marks written, else the first of
    a method or function named with a trailing underscore), or None."""
    if isinstance(node.target, torch._ops.OpOverload):
        written = [
            value
            for argument, value in zip(node.target._schema.arguments, node.args, strict=False)
            if argument.alias_info is not None and argument.alias_info.is_write
        ]
        return written[0] if written and isinstance(written[0], Node) else None
    if not node.args or not isinstance(node.args[0], Node):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    in_place = isinstance(name, str) and name.endswith("_") and not name.startswith("_")
    return node.args[0] if in_place else None


def _floating(value: Any) -> bool:
    return any(
        isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
        for t in tree_leaves(value)
    )


def _check_fused_inputs(stage: str, gm: GraphModule) -> None:
    from seqcompile.ops import pointwise
    from seqcompile.ops.fused_op import Call
    from seqcompile.ops.pointwise import region as pointwise_region

    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not pointwise.ENTRY.forward:
            continue
        region = pointwise_region.lookup(Call.of(node)["region"])
        placeholders = [n for n in region.forward.graph.nodes if n.op == "placeholder"]
        unread = [i for i, p in enumerate(placeholders[: region.num_inputs]) if not p.users]
        if unread:
            raise _error(stage, node, f"the fused region does not read its inputs {unread}")


def _error(stage: str, node: Node, problem: str) -> StructureError:
    return StructureError(
        f"seqfast: after stage {stage!r}, at {site_name(node)}{_code(node)}: {problem}. This is a"
        " seqfast bug; compile with options={'disable': True} to run without it."
    )


def _code(node: Node) -> str:
    """The source line of `node`, as its stack trace records it."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.splitlines() if line.strip().strip("^~")]
    return f" [{lines[-1]}]" if lines and not lines[-1].startswith("File ") else ""
