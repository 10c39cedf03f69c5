"""FX helpers shared by the stages: reading a node's fake value, inserting nodes whose fake value is
computed on the spot, erasing what a rewrite left unused, and naming a site for the report."""

from __future__ import annotations

import concurrent.futures
import operator
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._pytree import tree_map

aten = torch.ops.aten

RESHAPES = (
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.flatten.using_ints,
    aten.contiguous.default,
)
"""The ops that give a tensor another shape (or layout) over the same elements in the same
logical order."""


def in_own_thread(fn: Callable[[], Any]) -> Any:
    """`fn()`, run in a thread of its own, so that a trace it makes sees none of the caller's
    thread-local state: the caller may be inside an autograd.Function forward (autograd keys
    excluded, grad off) or inside another trace (its modes, functionalization's included, would
    wrap the values made here)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def val(node: Any) -> Any:
    """The fake value recorded on `node` (None for non-nodes or nodes without one)."""
    return node.meta.get("val") if isinstance(node, Node) else None


def concrete(size: int | torch.SymInt) -> int:
    """A size at the value it had when traced (symbolic sizes included)."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else int(size.node.shape_env.size_hint(size.node.expr))


def fake_values(tree: Any) -> Any:
    """`tree` (arguments, possibly nested) with every node replaced by its fake value."""
    return tree_map(lambda a: val(a) if isinstance(a, Node) else a, tree)


def has_symbols(values: Sequence[Any]) -> bool:
    """Whether any of `values` is a symbolic int or a tensor with a symbolic size."""
    return any(
        isinstance(v, torch.SymInt)
        or (isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape))
        for v in values
    )


def tensor_val(node: Any) -> torch.Tensor | None:
    v = val(node)
    return v if isinstance(v, torch.Tensor) else None


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a DTensor (the DTensor module is not imported for the question)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def rank_of(node: Any) -> int | None:
    """The number of dims of the tensor `node` computes (None for anything else)."""
    value = tensor_val(node) if isinstance(node, Node) else None
    return None if value is None else value.dim()


def describe(value: Any) -> str:
    """A value as a report shows it: `float32[3, 64]` for a tensor (or a node of one), else its
    repr."""
    t = tensor_val(value) if isinstance(value, Node) else value
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    return repr(value)


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    """Argument `name` of a call, whether it was passed by position or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Shapes provably equal, without adding guards on symbolic sizes."""
    return a.dim() == b.dim() and all(
        statically_known_true(x == y) for x, y in zip(a.shape, b.shape, strict=True)
    )


def is_row_vector(v: torch.Tensor | None, of: torch.Tensor) -> bool:
    """`v` is 1-D with as many elements as the last dimension of `of`."""
    return v is not None and v.dim() == 1 and statically_known_true(v.shape[0] == of.shape[-1])


def insert_call(
    graph: Graph,
    fake_mode: Any,
    target: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
) -> Node:
    """Insert `target(*args, **kwargs)` at the graph's current insertion point, with its fake
    value computed from the arguments' fake values."""
    kwargs = kwargs or {}
    node = graph.call_function(target, tuple(args), kwargs)
    fake_args, fake_kwargs = fake_values((args, kwargs))
    with fake_mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


_SOURCE_META = ("stack_trace", "nn_module_stack", "recompute", "ac_graph_id")


def source_meta(node: Node) -> dict[str, Any]:
    """The metadata a replacement inherits from `node`: its source line, module path and
    checkpoint tags (a node made for a checkpointed one is recomputed with it)."""
    return {k: v for k, v in node.meta.items() if k in _SOURCE_META}


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides over the dimensions longer than one (the others' strides mean nothing), at
    the traced sizes."""
    return a.dim() == b.dim() and all(
        concrete(x) == concrete(y)
        for x, y, size in zip(a.stride(), b.stride(), a.shape, strict=True)
        if concrete(size) != 1
    )


def in_layout_of(ctx: Any, value: Node, like: torch.Tensor) -> Node:
    """`value`, or a copy of it in `like`'s memory layout where the two differ, inserted after
    `value` through `ctx.call` (a rewrite's context): the node a rewrite replaces may have been
    laid out otherwise (SDPA returns heads-inner strides), and a reader such as `view`, or the
    caller of the graph, depends on it. A `like` that is not dense is not copied; the structural
    check reports a reader that then fails."""
    have = tensor_val(value)
    if have is None or same_layout(have, like) or not is_dense(like):
        return value
    strides = [concrete(s) for s in like.stride()]
    order = sorted(range(like.dim()), key=lambda d: (-strides[d], d))
    inverse = sorted(range(like.dim()), key=order.__getitem__)
    graph = value.graph
    with graph.inserting_after(value):
        permuted = ctx.call(aten.permute.default, value, order)
    with graph.inserting_after(permuted):
        packed = ctx.call(aten.clone.default, permuted, memory_format=torch.contiguous_format)
    with graph.inserting_after(packed):
        return ctx.call(aten.permute.default, packed, inverse)


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and without gaps, in some order of the dimensions (at the traced sizes)."""
    sizes = [concrete(s) for s in t.shape]
    strides = [concrete(s) for s in t.stride()]
    expected = 1
    for stride, size in sorted(zip(strides, sizes, strict=True)):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def insert_getitem(graph: Graph, node: Node, index: int) -> Node:
    item = graph.call_function(operator.getitem, (node, index))
    item.meta.update(source_meta(node))
    item.meta["val"] = val(node)[index]
    return item


def erase_unused(nodes: Iterable[Node]) -> None:
    """Erase the given nodes that no longer have users, latest first."""
    nodes = set(nodes)
    if not nodes:
        return
    order = node_order(next(iter(nodes)).graph)
    for node in sorted(nodes, key=order.__getitem__, reverse=True):
        if not node.users and node.op != "placeholder":
            node.graph.erase_node(node)


def depends_on(node: Any, sources: frozenset[Node]) -> bool:
    """Whether `node` is one of `sources` or computed from one."""
    seen, stack = set(), [node] if isinstance(node, Node) else []
    while stack:
        current = stack.pop()
        if current in sources:
            return True
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return False


def node_order(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


_STATE_CHANGES = tuple(
    fn
    for fn in (
        torch._C._set_grad_enabled,
        getattr(torch.amp.autocast_mode, "_enter_autocast", None),
        getattr(torch.amp.autocast_mode, "_exit_autocast", None),
    )
    if fn is not None
)


def is_barrier(node: Node) -> bool:
    """No computation may move across `node`: it switches grad mode or autocast, or mutates."""
    if node.op != "call_function":
        return False
    if node.target in _STATE_CHANGES:
        return True
    if node.target is aten.detach_.default:  # changes autograd metadata only, never values
        return False
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def grad_enabled_at(node: Node) -> bool:
    """Whether grad mode is on where `node` runs, as the graph's `_set_grad_enabled` calls before
    it leave it (the mode the graph is compiled under if none does)."""
    before = node.prev
    while before.op != "root":
        if before.op == "call_function" and before.target is torch._C._set_grad_enabled:
            return bool(before.args[0])
        before = before.prev
    return torch.is_grad_enabled()


def barrier_between(first: Node, last: Node) -> bool:
    """Whether a barrier lies among the nodes from `first` to `last`, both included."""
    node = first
    while True:
        if is_barrier(node):
            return True
        if node is last or node.op == "output":
            return False
        node = node.next


def site_name(node: Node) -> str:
    """A readable place for the report: the module path and source line that produced `node`."""
    where = []
    # a backward node has its forward node's module stack (AOTAutograd copies it)
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        where.append(path.replace("L['self'].", "").replace("L['self']", "<model>"))
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
        files = [line for line in lines if line.startswith("File ")]
        if files:
            file_part = files[-1].split('"')
            if len(file_part) >= 3:
                line_no = file_part[2].split(",")[1].strip().removeprefix("line ")
                where.append(f"{file_part[1].rsplit('/', 1)[-1]}:{line_no}")
    return f"{node.name} ({', '.join(where)})" if where else node.name


def device_of(node: Node) -> torch.device:
    """The device of the call's tensors (meta where it has none)."""
    values = [a.meta.get("val") for a in node.all_input_nodes]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("meta")
