"""Biases that depend on a score's position only through the key's position less the query's:
T5's relative-position buckets (`embedding(table, bucket(kv_idx - q_idx))`), ALiBi by distance
(`slopes * -(q_idx - kv_idx).abs()`). Such a bias (..., Lq, Lk) is constant along each diagonal,
so the fused op reads one value per diagonal, (..., 1, Lq + Lk - 1), made by running the bias's own
graph on the diagonals' offsets (an `arange` of Lq + Lk - 1) in place of the (Lq, Lk) matrix of
differences. Autograd carries its gradient on to the table or the slopes as before.

A bias is read so where it depends on positions only through differences of key and query
positions (`index_arithmetic.linear`), and every op from there to the bias acts position by
position: pointwise ops, `embedding` (without `scale_grad_by_freq`) or indexing with the
differences as the index, and permutes, transposes, size-1 views and broadcasts that keep the two
position dims; their other operands are constant along those dims (judged by shape, whatever they
are computed from: ALiBi's slopes from an `arange` over the heads). Anything else keeps the bias
tensor.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import arg, is_call, node_order, tensor_val
from seqcompile.patterns.attention.claims import RelativeClaim
from seqcompile.patterns.attention.index_arithmetic import linear, whole_slice
from seqcompile.patterns.engine import FuseContext

aten = torch.ops.aten

_PER_POSITION = (
    aten._to_copy.default,
    aten.to.dtype,
    aten.clone.default,
    aten.alias.default,
    aten.full_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
)
_SOURCES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


@dataclasses.dataclass(frozen=True)
class Dims:
    """Where a value's query and key positions lie among its dims."""

    q: int
    kv: int

    def moved(self, where: Sequence[int]) -> Dims:
        return Dims(where[self.q], where[self.kv])


@dataclasses.dataclass(frozen=True)
class RelativeBias:
    """A bias read as a function of key - query: the nodes between the differences and the bias,
    with their position dims, and each difference's sign and offset (`sign * (kv - q) +
    offset`)."""

    bias: Node
    dims: dict[Node, Dims]
    differences: dict[Node, tuple[int, int]]

    @property
    def claim(self) -> RelativeClaim:
        """That the bias is constant along each diagonal, to be checked against its code."""
        return RelativeClaim(self.bias)


def read_relative(bias: Node, lq: object, lk: object) -> RelativeBias | None:
    """`bias` (..., Lq, Lk) as a relative bias, or None."""
    reading = _Reading(lq, lk, RelativeBias(bias, {}, {}))
    dims = reading.dims(bias)
    rank = tensor_val(bias).dim()
    if dims is None or dims is _FREE or dims != Dims(rank - 2, rank - 1):
        return None
    return reading.found


_FREE = Dims(-1, -1)
"""A value that does not depend on positions."""


@dataclasses.dataclass
class _Reading:
    """One walk from a bias back to the differences of positions it is made of, for scores of
    `lq` queries and `lk` keys: the path it takes goes into `found`; `positional` keeps which
    nodes depend on positions at all."""

    lq: object
    lk: object
    found: RelativeBias
    positional: dict[Node, bool] = dataclasses.field(default_factory=dict)

    def dims(self, node: object) -> Dims | None:
        """Where `node`'s positions lie (`_FREE` without any), recording the path in `found`;
        None where it depends on positions otherwise than position by position through
        differences."""
        if not isinstance(node, Node):
            return _FREE
        if node in self.found.dims:
            return self.found.dims[node]
        if not _depends_on_positions(node, self.positional):
            return _FREE
        value = tensor_val(node)
        if value is None or value.dim() < 2:
            return None
        form = linear(node, self.lq, self.lk)
        if form is not None and form.q == -form.kv and form.kv in (-1, 1):
            rank = value.dim()
            if not (
                statically_known_true(value.shape[-2] == self.lq)
                and statically_known_true(value.shape[-1] == self.lk)
            ):
                return None
            self.found.differences[node] = (form.kv, form.constant)
            dims = Dims(rank - 2, rank - 1)
        else:
            dims = self._through(node)
        if dims is None or dims is _FREE:  # positions, taken otherwise than through differences
            return None
        self.found.dims[node] = dims
        return dims

    def _through(self, node: Node) -> Dims | None:
        """The position dims of an op's result from its operands'."""
        if is_call(node, aten.embedding.default, aten.index.Tensor):
            return self._through_lookup(node)
        if is_call(node, aten.permute.default, aten.transpose.int, aten.unsqueeze.default):
            inner = self.dims(node.args[0])
            if inner in (None, _FREE):
                return None
            return inner.moved(_moves(node, tensor_val(node).dim()))
        if is_call(node, aten.slice.Tensor, aten.expand.default):
            return self._through_view(node)
        if not (is_call(node, *_PER_POSITION) or _pointwise(node)):
            return None
        dims = self._operands_dims(node)
        if dims is None or not _constant_along(node, dims, self.found):
            return None
        return dims

    def _through_lookup(self, node: Node) -> Dims | None:
        """`embedding(table, index)` or `source[index]`: the index's dims, the table's
        constant."""
        if is_call(node, aten.embedding.default):
            if arg(node, 3, "scale_grad_by_freq"):  # its counts are per score, not per diagonal
                return None
            table, looked_up = node.args[0], [node.args[1]]
        else:
            table, looked_up = node.args[:2]
        if len(looked_up) != 1 or self.dims(table) is not _FREE:
            return None
        return self.dims(looked_up[0])

    def _through_view(self, node: Node) -> Dims | None:
        """A slice or expand that keeps the sizes of the position dims (a slice the whole of
        them)."""
        inner = self.dims(node.args[0])
        if inner in (None, _FREE):
            return None
        before, after = tensor_val(node.args[0]), tensor_val(node)
        shift = after.dim() - before.dim()
        dims = Dims(inner.q + shift, inner.kv + shift)
        keeps = all(
            statically_known_true(after.shape[d + shift] == before.shape[d])
            for d in (inner.q, inner.kv)
        )
        return dims if keeps and (is_call(node, aten.expand.default) or whole_slice(node)) else None

    def _operands_dims(self, node: Node) -> Dims | None:
        """The position dims of a pointwise op's result, where its operands that hold positions
        agree on them."""
        rank, dims = tensor_val(node).dim(), None
        for operand in [*node.args, *node.kwargs.values()]:
            inner = self._tentative_dims(operand)
            if inner is None and tensor_val(operand) is not None:
                continue  # read no position by position: below, it must be constant along them
            if inner is None:
                return None
            operand_rank = tensor_val(operand).dim() if tensor_val(operand) is not None else 0
            shift = rank - operand_rank
            if inner is _FREE:
                continue
            mapped = Dims(inner.q + shift, inner.kv + shift)
            if dims not in (None, mapped):
                return None
            dims = mapped
        return dims

    def _tentative_dims(self, node: object) -> Dims | None:
        """`dims(node)`, leaving `found` as it was where that is None: an operand computed from
        an `arange` of something else (ALiBi's slopes from the head numbers) is then judged by
        its shape alone, and what its graph recorded on the way must not be run again per
        diagonal."""
        found = self.found
        dims, differences = dict(found.dims), dict(found.differences)
        inner = self.dims(node)
        if inner is None:
            found.dims.clear()
            found.dims.update(dims)
            found.differences.clear()
            found.differences.update(differences)
        return inner


def _constant_along(node: Node, dims: Dims, found: RelativeBias) -> bool:
    """Whether the operands of `node` that hold no positions are constant along `dims`."""
    rank = tensor_val(node).dim()
    for operand in [*node.args, *node.kwargs.values()]:
        value = tensor_val(operand)
        if value is None or found.dims.get(operand) is not None:
            continue
        shift = rank - value.dim()
        for d in (dims.q - shift, dims.kv - shift):
            if d >= 0 and not statically_known_true(value.shape[d] == 1):
                return False
    return True


def _sum(ctx: FuseContext, a: int | Node, b: int | Node) -> int | Node:
    """a + b, a node where either is a symbolic size's node."""
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    return ctx.call(operator.add, a, b)


def _neg(ctx: FuseContext, a: int | Node) -> int | Node:
    return -a if isinstance(a, int) else ctx.call(operator.neg, a)


def _moves(node: Node, rank: int) -> list[int]:
    """Where each dim of a permute, transpose or unsqueeze's operand goes."""
    if node.target is aten.permute.default:
        order = [d % rank for d in node.args[1]]
        return [order.index(d) for d in range(rank)]
    if node.target is aten.transpose.int:
        a, b = (d % rank for d in node.args[1:3])
        where = list(range(rank))
        where[a], where[b] = b, a
        return where
    at = node.args[1] % rank
    return [d + (d >= at) for d in range(rank - 1)]


def _pointwise(node: Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _depends_on_positions(node: Node, positional: dict[Node, bool]) -> bool:
    """Whether `node` is computed from an `arange` (memoized in `positional`)."""
    stack = [node]
    while stack:
        current = stack[-1]
        if current in positional:
            stack.pop()
            continue
        pending = [n for n in current.all_input_nodes if n not in positional]
        if pending and not is_call(current, *_SOURCES):
            stack.extend(pending)
            continue
        stack.pop()
        positional[current] = is_call(current, *_SOURCES) or any(
            positional[n] for n in current.all_input_nodes
        )
    return positional[node]


def per_diagonal(ctx: FuseContext, relative: RelativeBias) -> Node:
    """The bias's value on each diagonal, (..., 1, Lq + Lk - 1): its graph run again on the
    diagonals' offsets. Inserted at the graph's current insertion point."""
    order = node_order(relative.bias.graph)
    made: dict[Node, Node] = {}
    for node in sorted(relative.dims, key=order.__getitem__):
        made[node] = _again(ctx, node, relative, made)
    return made[relative.bias]


def _again(ctx: FuseContext, node: Node, relative: RelativeBias, made: dict) -> Node:
    if node in relative.differences:
        sign, offset = relative.differences[node]
        value = tensor_val(node)
        lq, lk = ctx.sizes(node, (-2, -1))
        if sign > 0:  # kv - q + offset; diagonal t has kv - q = t - (Lq - 1)
            ends = (_sum(ctx, 1 + offset, _neg(ctx, lq)), _sum(ctx, lk, offset), 1)
        else:
            ends = (_sum(ctx, lq, offset - 1), _sum(ctx, offset, _neg(ctx, lk)), -1)
        offsets = ctx.call(aten.arange.start_step, *ends, dtype=value.dtype, device=value.device)
        diagonals = _sum(ctx, _sum(ctx, lq, lk), -1)
        return ctx.call(aten.view.default, offsets, [1] * (value.dim() - 1) + [diagonals])
    if is_call(node, aten.slice.Tensor):
        return made[node.args[0]]
    args = [made.get(a, a) if isinstance(a, Node) else a for a in node.args]
    if is_call(node, aten.expand.default):  # keep the positions' sizes of the diagonals
        dims = relative.dims[node]
        args[1] = [-1 if d in (dims.q, dims.kv) else s for d, s in enumerate(args[1])]
    if is_call(node, aten.index.Tensor):
        args[1] = [made.get(i, i) for i in args[1]]
    kwargs = {k: made.get(v, v) if isinstance(v, Node) else v for k, v in node.kwargs.items()}
    return ctx.call(node.target, *args, **kwargs)
