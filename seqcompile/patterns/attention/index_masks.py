"""Masks built from index arithmetic, as Hugging Face writes them: query and key positions
(`index_arithmetic.py`) compared (`kv_idx <= q_idx`), and the comparisons and other masks (a
padding mask gathered per key) combined with `&`, read here factor by factor (`mask_factors.py`).

A factor that compares key with query positions (or their difference with a constant) is read as a
half-plane of the scores, `kv - q <= d` or `kv - q >= d`: `kv - q <= 0` is the causal triangle and
`kv - q >= 1 - w` a sliding window of w keys (Mistral's `kv_idx > q_idx - w`), which the kernel
computes, skipping the blocks they hide. A factor that keeps the causal triangle or the keys before
a length (`(kv_idx <= q_idx) | (kv_idx < P)`, P a constant or a length per batch) is a prefix LM's
mask, causal widened by the prefix. A factor comparing ids along the queries with ids along the
keys is a packed batch's document mask, which the kernel compares from the ids. Where those ids are
the runs of consecutive position ids (`cumsum(diff(position_ids) != 1)`, as Hugging Face derives
them for packed rows), position ids gathered at the query and key compare within a document as the
query and key indices do, so `pos[b, kv_idx] <= pos[b, q_idx]` is causal too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import arg, is_call, tensor_val
from seqcompile.patterns.attention.claims import KeepClaim, read_as_is
from seqcompile.patterns.attention.index_arithmetic import (
    POSITION_DTYPES,
    Runs,
    gather,
    integer,
    linear,
    peeled,
)
from seqcompile.patterns.attention.mask_factors import AND, OR, factors, is_bool, leading_ones
from seqcompile.patterns.attention.masks import is_causal, triangle
from seqcompile.patterns.attention.positions import Documents, HalfPlane, Linear, Prefix

aten = torch.ops.aten
_COMPARISONS = {
    # op: (swap the operands, strict): a <= b, a < b, b <= a, b < a
    **dict.fromkeys((aten.le.Tensor, aten.le.Scalar), (False, False)),
    **dict.fromkeys((aten.lt.Tensor, aten.lt.Scalar), (False, True)),
    **dict.fromkeys((aten.ge.Tensor, aten.ge.Scalar), (True, False)),
    **dict.fromkeys((aten.gt.Tensor, aten.gt.Scalar), (True, True)),
}


@dataclasses.dataclass
class Diagonal:
    """What the kernel computes from positions instead of reading: the causal triangle (query i
    sees keys j <= i), widened by a prefix when `prefix` is set, and a sliding window
    (i - j < window; 0: none)."""

    causal: bool = False
    window: int = 0
    prefix: Prefix | None = None
    claims: list[KeepClaim] = dataclasses.field(default_factory=list)
    """What its reading concludes of the mask factors it was read from, to be checked."""

    def add(self, plane: HalfPlane) -> bool:
        """Take `plane` in, where the kernel can compute it."""
        if plane.causal:
            self.causal = True
            return True
        if not plane.upper and plane.bound <= 0:  # kv - q >= 1 - w: i - j < w
            self.window = narrower(self.window, 1 - plane.bound)
            return True
        return False

    def planes(self) -> list[HalfPlane]:
        """The half-planes it keeps (a prefix only widens causal's, so it is left out)."""
        causal = [HalfPlane(True, 0)] if self.causal else []
        return causal + ([HalfPlane(False, 1 - self.window)] if self.window else [])


def every_row_keeps(planes: Sequence[HalfPlane], lq: object, lk: object) -> bool:
    """Whether every one of Lq queries keeps a key of Lk in the intersection of `planes`: query
    i keeps keys i + low <= j <= i + high, so high >= 0 (query 0), Lq - 1 + low <= Lk - 1 (the
    last query) and low <= high."""
    high = min((p.bound for p in planes if p.upper), default=None)
    low = max((p.bound for p in planes if not p.upper), default=None)
    return (
        (high is None or high >= 0)
        and (low is None or statically_known_true(lq + low <= lk))
        and (high is None or low is None or low <= high)
        and statically_known_true(lk >= 1)
    )


def narrower(window: int, other: int) -> int:
    """The narrower of two sliding windows (0: none)."""
    return min(window, other) if window and other else window or other


def split_diagonal(
    mask: Node, keeps: bool, scores: Sequence[Any]
) -> tuple[Diagonal, list[tuple[Node, bool]]]:
    """The causal triangle and sliding window among `mask`'s factors (for the shape `scores`,
    its last two dims: `tril` of ones, a band `ones.tril().triu(1 - w)`, `kv_idx <= q_idx`,
    `kv_idx > q_idx - w`), and the other factors, less those that keep every score."""
    diagonal, rest, prefixes = Diagonal(), [], []
    split = factors(mask, keeps)
    runs = _position_runs(split)
    documents = tuple(f for f in split if document_ids(*f) is not None)

    def claim(factor: Node, keeps: bool, reading: str, **read: Any) -> None:
        diagonal.claims.append(KeepClaim(factor, keeps, tuple(scores), reading, **read))

    for factor, factor_keeps in split:
        if read_as_is(factor):
            rest.append((factor, factor_keeps))
        elif keeps_all(factor, factor_keeps, scores[-2], scores[-1]):
            claim(factor, factor_keeps, "keeping every score")
        elif (prefix := prefix_of(factor, factor_keeps, scores)) is not None:
            prefixes.append(prefix)
            reading = "causal after a prefix"
            claim(factor, factor_keeps, reading, planes=(HalfPlane(True, 0),), prefix=prefix)
        elif (plane := half_plane(factor, factor_keeps, *scores[-2:], runs)) and diagonal.add(
            plane
        ):
            by_documents = half_plane(factor, factor_keeps, *scores[-2:]) is None
            reading = f"{plane} within each document" if by_documents else str(plane)
            claim(factor, factor_keeps, reading, planes=(plane,), within=documents * by_documents)
        else:
            planes = [HalfPlane(*p) for p in triangle(factor, factor_keeps, scores) or ()]
            taken = tuple(p for p in planes if diagonal.add(p))
            if len(taken) < len(planes) or not planes:
                rest.append((factor, factor_keeps))  # (what it implies of the diagonal taken too)
            if taken:  # the factor keeps what the planes taken keep, and (if read) no more
                within = () if len(taken) == len(planes) else ((factor, factor_keeps),)
                reading = " and ".join(map(str, taken))
                claim(factor, factor_keeps, reading, planes=taken, within=within)
    if prefixes and not diagonal.causal:  # (with causal, what a prefix adds is hidden anyway)
        if not diagonal.window:  # the kernel widens causal by one prefix, without a window
            diagonal.causal, diagonal.prefix = True, prefixes.pop()
        rest += [(p.factor, p.keeps) for p in prefixes]
    return diagonal, rest


def prefix_of(factor: Node, keeps: bool, scores: Sequence[Any]) -> Prefix | None:
    """The prefix where `factor` keeps the causal triangle or the keys before a length:
    `(kv_idx <= q_idx) | (kv_idx < P)` (or, True masking, `(kv_idx > q_idx) & (kv_idx >= P)`)."""
    node = factor
    while is_call(node, aten.expand.default, aten.alias.default) or leading_ones(node):
        node = node.args[0]
    if not is_call(node, *(OR if keeps else AND)) or not all(is_bool(a) for a in node.args[:2]):
        return None
    for a, b in (node.args[:2], node.args[1::-1]):
        plane = half_plane(a, keeps, scores[-2], scores[-1])
        causal = (plane is not None and plane.causal) or is_causal(a, keeps, scores)
        length = _key_bound(b, keeps, scores[-2], scores[-1]) if causal else None
        if length is not None:
            return Prefix(*length, factor, keeps)
    return None


def _key_bound(node: object, keeps: bool, lq: object, lk: object) -> tuple[Node | None, int] | None:
    """(P, offset) where `node` keeps the keys before P + offset: `kv_idx < P`, `kv_idx <= P`,
    `P > kv_idx` (True masking: `kv_idx >= P`), P an integer constant or an integer tensor of
    size 1 along the positions."""
    if not is_call(node, *_COMPARISONS) or len(node.args) != 2:
        return None
    swap, strict = _COMPARISONS[node.target]
    low, high = node.args[::-1] if swap else node.args  # kept where low < high (or <=)
    if not keeps:  # kept where not (low < high): high <= low
        low, high, strict = high, low, not strict
    key = linear(low, lq, lk)
    if key is None or (key.q, key.kv) != (0, 1):
        return None
    offset = -key.constant + (0 if strict else 1)  # kv < P - c (+ 1 when <=)
    number = integer(high)
    if number is not None:
        return None, number + offset
    value = tensor_val(high)
    if (
        value is None
        or value.dtype not in POSITION_DTYPES
        or value.dim() < 2
        or not all(statically_known_true(n == 1) for n in value.shape[-2:])
        or linear(high, lq, lk) is not None
    ):
        return None
    return high, offset


def _position_runs(split: list[tuple[Node, bool]]) -> Runs:
    """The position ids whose runs are the ids of a document factor among `split`: the factor
    compares `ids[b, q_idx]` with `ids[b, kv_idx]`, ids = `cumsum(diff(pos) != 1, -1)`."""
    runs = {}
    for factor, keeps in split:
        ids = document_ids(factor, keeps)
        gathers = [gather(ids.q), gather(ids.kv)] if ids is not None else [None]
        if None in gathers or len({(src, b) for src, b, _ in gathers}) != 1:
            continue
        source, batch, _ = gathers[0]
        counted = peeled(source)
        if not is_call(counted, aten.cumsum.default) or _not_last(counted, counted.args[1]):
            continue
        changed = peeled(counted.args[0])
        if not (is_call(changed, aten.ne.Scalar) and integer(changed.args[1]) == 1):
            continue
        diff = peeled(changed.args[0])
        if (
            is_call(diff, aten.diff.default)
            and arg(diff, 1, "n", 1) == 1
            and not _not_last(diff, arg(diff, 2, "dim", -1))
            and arg(diff, 4, "append") is None
            and arg(diff, 3, "prepend") is not None  # (one id per position)
        ):
            runs[peeled(diff.args[0])] = batch
    return runs


def _not_last(node: Node, dim: object) -> bool:
    """Whether `dim` is another than the last of `node`'s operand."""
    rank = tensor_val(node.args[0]).dim()
    return not isinstance(dim, int) or dim % rank != rank - 1


def document_ids(factor: Node, keeps: bool) -> Documents | None:
    """The query and key ids where `factor` keeps the scores whose query and key ids are equal:
    `eq(a, b)` (or `ne` where True masks) of integer ids, one operand constant along the keys,
    (..., Lq, 1), the other along the queries, (..., 1, Lk): packed sequences' document mask,
    `doc[:, None, :, None] == doc[:, None, None, :]`, or `doc[b_idx, q_idx] == doc[b_idx,
    kv_idx]` as Hugging Face writes it."""
    if not is_call(factor, aten.eq.Tensor if keeps else aten.ne.Tensor):
        return None
    for x, y in (factor.args[:2], factor.args[1::-1]):
        vx, vy = tensor_val(x), tensor_val(y)
        if (
            vx is not None
            and vy is not None
            and min(vx.dim(), vy.dim()) >= 2
            and not vx.is_floating_point()
            and not vy.is_floating_point()
            and statically_known_true(vx.shape[-1] == 1)
            and statically_known_true(vy.shape[-2] == 1)
        ):
            return Documents(x, y)
    return None


def half_plane(
    factor: Node, keeps: bool, lq: object, lk: object, runs: Runs | None = None
) -> HalfPlane | None:
    """The scores `factor` keeps, where it compares a difference of key and query positions
    with a constant (`kv_idx <= q_idx`, `kv_idx > q_idx - w`, `q_idx - kv_idx < w`; with `runs`,
    position ids gathered at them too); None otherwise."""
    compared = _comparison(factor, lq, lk, runs)
    if compared is None:
        return None
    form, limit = compared
    if (form.q, form.kv) == (-1, 1):  # kv - q + c <= limit
        kept = HalfPlane(True, limit - form.constant)
    elif (form.q, form.kv) == (1, -1):  # q - kv + c <= limit  <=>  kv - q >= c - limit
        kept = HalfPlane(False, form.constant - limit)
    else:
        return None
    return kept if keeps else kept.complement()


def keeps_all(factor: Node, keeps: bool, lq: object, lk: object) -> bool:
    """Whether `factor` keeps every score: it compares one position with a constant, and the
    comparison comes out the same over all the positions (Hugging Face's bidirectional mask,
    `q_idx >= 0`)."""
    compared = _comparison(factor, lq, lk)
    if compared is None:
        return False
    form, limit = compared
    if form.kv == 0:
        slope, length = form.q, lq
    elif form.q == 0:
        slope, length = form.kv, lk
    else:
        return False
    reach = slope * (length - 1)  # the form spans constant + [min(0, reach), max(0, reach)]
    if keeps:  # True keeps: the form never exceeds the limit
        return statically_known_true(form.constant + reach <= limit) and form.constant <= limit
    return statically_known_true(form.constant + reach > limit) and form.constant > limit


def _comparison(
    factor: Node, lq: object, lk: object, runs: Runs | None = None
) -> tuple[Linear, int] | None:
    """(form, limit) where `factor` compares linear forms of positions as `form <= limit`."""
    if not is_call(factor, *_COMPARISONS) or len(factor.args) != 2:
        return None
    swap, strict = _COMPARISONS[factor.target]
    a, b = factor.args[::-1] if swap else factor.args
    la, lb = linear(a, lq, lk, runs), linear(b, lq, lk, runs)
    if la is None or lb is None:
        return None
    return la - lb, -1 if strict else 0  # integer positions: a < b is a - b <= -1
