"""Indices checked on the host before anything indexes with them: an out-of-range class index is
eager's `IndexError`, never a crash inside compiled code.

Inductor's CPU code checks its indices inside the compiled loop, where a failed check ends the
process (`terminate called after throwing an instance of 'std::runtime_error'`), as it does
without seqcompile. `seqfast::checked_index` returns its index once every value is in range, so
what indexes with the result runs after the check; Inductor calls it as it is, from its wrapper.
`check_indices` puts one before every index a graph's gathers, scatters, embeddings and
`nll_loss`es read (the lowerings Inductor compiles, the row-wise losses' programs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

Tensor = torch.Tensor
aten = torch.ops.aten


def check_range(index: Tensor, low: int, high: int, ignore: int | None, what: str) -> None:
    """Raise an IndexError naming `what` where a value of `index` is outside [low, high) and is
    not `ignore`; on CUDA a device-side assert instead (no host synchronization)."""
    valid = (index >= low) & (index < high)
    if ignore is not None:
        valid = valid | (index == ignore)  # (not in place: a trace functionalizes it)
    message = f"{what}: a value is outside [{low}, {high})"
    if ignore is not None:
        message += " and is not ignore_index"
    if index.is_cuda:
        torch._assert_async(valid.all(), message)
    elif not bool(valid.all()):
        raise IndexError(message)


@torch.library.custom_op("seqfast::checked_index", mutates_args=())
def checked_index(index: Tensor, low: int, high: int, ignore: int | None, what: str) -> Tensor:
    """`index`, copied, once `check_range` has passed it."""
    check_range(index, low, high, ignore, what)
    return index.clone()


@checked_index.register_fake
def _(index: Tensor, low: int, high: int, ignore: int | None, what: str) -> Tensor:
    return torch.empty_like(index)


CHECK = torch.ops.seqfast.checked_index.default


@dataclasses.dataclass(frozen=True)
class _Bound:
    """The values one reader of an index takes: [low, high), and `ignore` besides."""

    low: int
    high: int
    ignore: int | None


def _size(node: Node, dim: int) -> int | None:
    value = node.meta.get("val")
    if not isinstance(value, Tensor) or value.dim() == 0:
        return None
    size = value.shape[dim if dim < value.dim() else -1]
    return size if isinstance(size, int) else None  # (a symbolic size is left to the op)


def _along(source: int, dim: int, index: int) -> Callable[[Node], list[tuple[Node, _Bound]]]:
    def bounds(node: Node) -> list[tuple[Node, _Bound]]:
        size = _size(node.args[source], node.args[dim] if isinstance(node.args[dim], int) else 0)
        return [] if size is None else [(node.args[index], _Bound(0, size, None))]

    return bounds


def _nll(source: int, target: int, ignore: int) -> Callable[[Node], list[tuple[Node, _Bound]]]:
    def bounds(node: Node) -> list[tuple[Node, _Bound]]:
        size = _size(node.args[source], 1)
        ignored = node.args[ignore] if len(node.args) > ignore else -100
        return [] if size is None else [(node.args[target], _Bound(0, size, ignored))]

    return bounds


def _embedding(node: Node) -> list[tuple[Node, _Bound]]:
    size = _size(node.args[0], 0)
    return [] if size is None else [(node.args[1], _Bound(0, size, None))]


def _advanced(node: Node) -> list[tuple[Node, _Bound]]:
    found = []
    for dim, index in enumerate(node.args[1]):
        size = _size(node.args[0], dim)
        if isinstance(index, Node) and size is not None:
            found.append((index, _Bound(-size, size, None)))  # (negative indices wrap)
    return found


_READERS: dict[object, Callable[[Node], list[tuple[Node, _Bound]]]] = {
    aten.gather.default: _along(0, 1, 2),
    aten.index_select.default: _along(0, 1, 2),
    aten.scatter.src: _along(0, 1, 2),
    aten.scatter.value: _along(0, 1, 2),
    aten.scatter_add.default: _along(0, 1, 2),
    aten.nll_loss_forward.default: _nll(0, 1, 4),
    aten.nll_loss_backward.default: _nll(1, 2, 5),
    aten.embedding.default: _embedding,
    aten.index.Tensor: _advanced,
}
"""Ops that index with a tensor of indices: what each reads, and the values it takes."""


def check_indices(gm: GraphModule, what: str) -> GraphModule:
    """`gm` (changed in place) with every index its indexing ops read from outside the graph
    (computed from a placeholder) passed through `seqfast::checked_index` first, once, against
    the narrowest range its readers take; its readers all read the checked copy."""
    outside = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in outside for a in node.all_input_nodes):
            outside.add(node)
    bounds: dict[Node, list[_Bound]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _READERS:
            for index, bound in _READERS[node.target](node):
                value = index.meta.get("val") if isinstance(index, Node) else None
                integer = isinstance(value, Tensor) and not value.is_floating_point()
                if integer and value.dtype is not torch.bool and index in outside:
                    bounds.setdefault(index, []).append(bound)
    for index, taken in bounds.items():
        if index.op == "call_function" and index.target is CHECK:
            continue
        ignores = {b.ignore for b in taken}
        low, high = max(b.low for b in taken), min(b.high for b in taken)
        ignore = ignores.pop() if len(ignores) == 1 else None
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        after = placeholders[-1] if index.op == "placeholder" else index
        with gm.graph.inserting_after(after):
            checked = gm.graph.call_function(CHECK, (index, low, high, ignore, what))
        checked.meta["val"] = index.meta["val"]
        index.replace_all_uses_with(checked, delete_user_cb=lambda user, c=checked: user is not c)
    if bounds:
        gm.recompile()
    return gm
