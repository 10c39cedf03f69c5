"""Masks built from index arithmetic, as Hugging Face writes them: the query and key positions are
`arange`s broadcast along the scores' last two dims (`q_idx = arange(Lq)[None, None, :, None]`,
`kv_idx = arange(Lk)[None, None, None, :]`), compared (`kv_idx <= q_idx`), and the comparisons
and other masks (a padding mask gathered per key) combined with `&`.

A mask is split into its factors (the masks whose conjunction keeps a score), and a factor that
compares key with query positions is read as a half-plane of the scores, `kv - q <= d` or
`kv - q >= d`: `kv - q <= 0` is the causal triangle, which the kernel skips without reading.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx_utils import arg, is_call, tensor_val
from seqcompile.patterns.attention_masks import constant, is_causal

aten = torch.ops.aten
_AND = (aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default)
_OR = (aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default)
_NOT = (aten.bitwise_not.default, aten.logical_not.default)
_BROADCAST_VIEWS = (
    aten.unsqueeze.default,
    aten.view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.alias.default,
)
_COMPARISONS = {
    # op: (swap the operands, strict): a <= b, a < b, b <= a, b < a
    aten.le.Tensor: (False, False),
    aten.lt.Tensor: (False, True),
    aten.ge.Tensor: (True, False),
    aten.gt.Tensor: (True, True),
}


@dataclasses.dataclass(frozen=True)
class Position:
    """A tensor whose value at query row i (or key column j) is i + offset (j + offset),
    whatever the other indices."""

    axis: str
    """"q" or "kv"."""
    offset: int


@dataclasses.dataclass(frozen=True)
class HalfPlane:
    """The scores where `kv - q <= bound` (`upper`) or `kv - q >= bound` (not `upper`)."""

    upper: bool
    bound: int

    @property
    def causal(self) -> bool:
        return self.upper and self.bound == 0

    def complement(self) -> HalfPlane:
        return HalfPlane(not self.upper, self.bound + 1 if self.upper else self.bound - 1)


def split_causal(
    mask: Node, keeps: bool, scores: Sequence[Any]
) -> tuple[bool, list[tuple[Node, bool]]]:
    """Whether the causal triangle of the shape `scores` (its last two dims) is a factor of
    `mask`, written as `tril` of ones or as `kv_idx <= q_idx`, and the other factors."""
    causal, rest = False, []
    for factor, factor_keeps in factors(mask, keeps):
        plane = half_plane(factor, factor_keeps, scores[-2], scores[-1])
        if (plane is not None and plane.causal) or is_causal(factor, factor_keeps, scores):
            causal = True
        else:
            rest.append((factor, factor_keeps))
    return causal, rest


def factors(mask: Node, keeps: bool) -> list[tuple[Node, bool]]:
    """The masks whose conjunction is `mask` (with whether True keeps, for each): `&` splits a
    mask where True keeps, `|` one where True masks, a negation flips; a constant that keeps
    everything is dropped."""
    node: object = mask
    while True:
        if is_call(node, aten.expand.default, aten.alias.default) or _bool_cast(node):
            node = node.args[0]
        elif is_call(node, *_NOT) and _is_bool(node.args[0]):
            node, keeps = node.args[0], not keeps
        else:
            break
    if is_call(node, *(_AND if keeps else _OR)) and all(_is_bool(a) for a in node.args[:2]):
        return [f for a in node.args[:2] for f in factors(a, keeps)]
    if _is_bool(node) and tensor_val(node).dim() == 0 and constant(node) == float(keeps):
        return []
    if is_call(node, aten.new_ones.default, aten.ones.default) and list(node.args[-1]) == []:
        return [] if keeps else [(node, keeps)]
    return [(node, keeps)]


def half_plane(factor: Node, keeps: bool, lq: object, lk: object) -> HalfPlane | None:
    """The scores `factor` keeps, where it compares key and query positions; None otherwise."""
    if not is_call(factor, *_COMPARISONS) or len(factor.args) != 2:
        return None
    swap, strict = _COMPARISONS[factor.target]
    a, b = factor.args[::-1] if swap else factor.args
    pa, pb = position(a, lq, lk), position(b, lq, lk)
    if pa is None or pb is None or pa.axis == pb.axis:
        return None
    margin = -1 if strict else 0  # a < b  <=>  a <= b - 1 for integer positions
    if pa.axis == "kv":  # kv + ca <= q + cb + margin  <=>  kv - q <= cb - ca + margin
        kept = HalfPlane(True, pb.offset - pa.offset + margin)
    else:  # q + ca <= kv + cb + margin  <=>  kv - q >= ca - cb - margin
        kept = HalfPlane(False, pa.offset - pb.offset - margin)
    return kept if keeps else kept.complement()


def position(node: object, lq: object, lk: object) -> Position | None:
    """Whether `node` holds query (or key) positions plus a constant, along the scores' last
    two dims: an `arange` with unit step, through integer offsets and views that only add or
    remove size-1 dims or broadcast."""
    value = tensor_val(node)
    if value is None or value.is_floating_point() or value.dtype == torch.bool:
        return None
    varying = [d for d in range(value.dim()) if not statically_known_true(value.shape[d] == 1)]
    if len(varying) != 1 or value.dim() - varying[0] > 2:
        return None
    axis = "kv" if varying[0] == value.dim() - 1 else "q"
    length = lk if axis == "kv" else lq
    offset = 0
    while not is_call(node, aten.arange.default, aten.arange.start, aten.arange.start_step):
        if is_call(node, *_BROADCAST_VIEWS) or _int_cast(node):
            node = node.args[0]
        elif is_call(node, aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2:
            step = _integer(node.args[1])
            if step is None or not isinstance(node.args[0], Node):
                return None
            offset += step if node.target is aten.add.Tensor else -step
            node = node.args[0]
        else:
            return None
        source = tensor_val(node)
        if source is None or sum(not statically_known_true(s == 1) for s in source.shape) > 1:
            return None
    if node.target is aten.arange.default:
        start, end, step = 0, node.args[0], 1
    else:
        start, end = node.args[:2]
        step = arg(node, 2, "step", 1) if node.target is aten.arange.start_step else 1
    start = _integer(start)
    if start is None or step != 1 or not statically_known_true(end - start == length):
        return None
    return Position(axis, offset + start)


def _integer(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = constant(value)
    return int(number) if number is not None and number == int(number) else None


def _is_bool(node: object) -> bool:
    value = tensor_val(node)
    return value is not None and value.dtype == torch.bool


def _bool_cast(node: object) -> bool:
    return (
        is_call(node, aten.to.dtype, aten._to_copy.default)
        and _is_bool(node)
        and _is_bool(node.args[0])
    )


def _int_cast(node: object) -> bool:
    value = tensor_val(node)
    return (
        is_call(node, aten.to.dtype, aten._to_copy.default)
        and value is not None
        and not value.is_floating_point()
        and value.dtype != torch.bool
    )
