"""Masks built from index arithmetic, as Hugging Face writes them: the query and key positions are
`arange`s broadcast along the scores' last two dims (`q_idx = arange(Lq)[None, None, :, None]`,
`kv_idx = arange(Lk)[None, None, None, :]`), compared (`kv_idx <= q_idx`), and the comparisons
and other masks (a padding mask gathered per key) combined with `&`.

A mask is split into its factors (the masks whose conjunction keeps a score). A factor that
compares key with query positions (or their difference with a constant) is read as a half-plane of
the scores, `kv - q <= d` or `kv - q >= d`: `kv - q <= 0` is the causal triangle and `kv - q >= 1 -
w` a sliding window of w keys (Mistral's `kv_idx > q_idx - w`), which the kernel computes, skipping
the blocks they hide. A factor that keeps the causal triangle or the keys before a length (`(kv_idx
<= q_idx) | (kv_idx < P)`, P a constant or a length per batch) is a prefix LM's mask, causal
widened by the prefix. A factor comparing ids along the queries with ids along the keys is a packed
batch's document mask, which the kernel compares from the ids. Where those ids are the runs of
consecutive position ids (`cumsum(diff(position_ids) != 1)`, as Hugging Face derives them for
packed rows), position ids gathered at the query and key compare within a document as the query and
key indices do, so `pos[b, kv_idx] <= pos[b, q_idx]` is causal too. A test of a float mask made
from a boolean one (`where(m, 0, finfo.min).to(bool)`) is read as that mask.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import arg, is_call, tensor_val, val
from seqcompile.patterns.attention.claims import KeepClaim, read_as_is
from seqcompile.patterns.attention.masks import constant, is_causal, triangle
from seqcompile.patterns.attention.positions import Documents, HalfPlane, Linear, Prefix

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
    while is_call(node, aten.expand.default, aten.alias.default) or _leading_ones(node):
        node = node.args[0]
    if not is_call(node, *(_OR if keeps else _AND)) or not all(_is_bool(a) for a in node.args[:2]):
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
    number = _integer(high)
    if number is not None:
        return None, number + offset
    value = tensor_val(high)
    if (
        value is None
        or value.dtype not in _POSITION_DTYPES
        or value.dim() < 2
        or not all(statically_known_true(n == 1) for n in value.shape[-2:])
        or linear(high, lq, lk) is not None
    ):
        return None
    return high, offset


Runs = dict[Node, Node]
"""Position ids (B, L) that run consecutively within each document of a mask's document factor,
with the batch index both are gathered at."""


def _position_runs(split: list[tuple[Node, bool]]) -> Runs:
    """The position ids whose runs are the ids of a document factor among `split`: the factor
    compares `ids[b, q_idx]` with `ids[b, kv_idx]`, ids = `cumsum(diff(pos) != 1, -1)`."""
    runs = {}
    for factor, keeps in split:
        ids = document_ids(factor, keeps)
        gathers = [_gather(ids.q), _gather(ids.kv)] if ids is not None else [None]
        if None in gathers or len({(src, b) for src, b, _ in gathers}) != 1:
            continue
        source, batch, _ = gathers[0]
        counted = _peeled(source)
        if not is_call(counted, aten.cumsum.default) or _not_last(counted, counted.args[1]):
            continue
        changed = _peeled(counted.args[0])
        if not (is_call(changed, aten.ne.Scalar) and _integer(changed.args[1]) == 1):
            continue
        diff = _peeled(changed.args[0])
        if (
            is_call(diff, aten.diff.default)
            and arg(diff, 1, "n", 1) == 1
            and not _not_last(diff, arg(diff, 2, "dim", -1))
            and arg(diff, 4, "append") is None
            and arg(diff, 3, "prepend") is not None  # (one id per position)
        ):
            runs[_peeled(diff.args[0])] = batch
    return runs


def _gathered_position(node: object, runs: Runs, lq: object, lk: object) -> Linear | None:
    """The query or key index where `node` gathers position ids that run within documents at
    that index (`pos[b, q_idx]`), at the batch index their documents are gathered at."""
    gathered = _gather(node)
    if gathered is None:
        return None
    source, batch, at = gathered
    if runs.get(_peeled(source)) is not batch:
        return None
    index = position(at, lq, lk)
    return index if index is not None and index.constant == 0 else None


def _gather(node: object) -> tuple[Node, Node, Node] | None:
    """(source, batch index, position index) of `source[b, idx]` on a (B, L) source."""
    if not is_call(node, aten.index.Tensor):
        return None
    source, indices = node.args[:2]
    value = tensor_val(source)
    if value is None or value.dim() != 2 or len(indices) != 2 or None in indices:
        return None
    return source, indices[0], indices[1]


def _peeled(node: object) -> object:
    while is_call(node, aten.expand.default, aten.alias.default) or _int_cast(node):
        node = node.args[0]
    return node


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


def factors(mask: Node, keeps: bool) -> list[tuple[Node, bool]]:
    """The masks whose conjunction is `mask` (with whether True keeps, for each): `&` splits a
    mask where True keeps, `|` one where True masks, a negation (`~m`, `m == 0`) flips; a
    constant that keeps everything is dropped."""
    node, keeps = _unwrapped(mask, keeps)
    if is_call(node, *(_AND if keeps else _OR)) and all(_is_bool(a) for a in node.args[:2]):
        return [f for a in node.args[:2] for f in factors(a, keeps)]
    if _is_bool(node) and tensor_val(node).dim() == 0 and constant(node) == float(keeps):
        return []
    if is_call(node, aten.new_ones.default, aten.ones.default) and list(node.args[-1]) == []:
        return [] if keeps else [(node, keeps)]
    return [(node, keeps)]


def _unwrapped(node: object, keeps: bool) -> tuple[object, bool]:
    """`node` through views, casts and negations (with whether True keeps there)."""
    while True:
        if is_call(node, aten.expand.default, aten.alias.default) or _bool_cast(node):
            node = node.args[0]
        elif _leading_ones(node):
            node = node.args[0]
        elif is_call(node, *_NOT) and _is_bool(node.args[0]):
            node, keeps = node.args[0], not keeps
        elif _compared_with_zero(node):  # mask == 0 (the Annotated Transformer), mask != 0
            node, keeps = node.args[0], keeps != is_call(node, aten.eq.Scalar)
        elif (tested := _test_of_where(node)) is not None:  # where(m, 0, min).to(bool): MPT
            node, flips = tested
            keeps = keeps != flips
        else:
            return node, keeps


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


def linear(node: object, lq: object, lk: object, runs: Runs | None = None) -> Linear | None:
    """`node` as a linear form of the query and key positions: a constant, positions, or sums
    and differences of them; None for anything else."""
    number = _integer(node)
    if number is not None:
        return Linear(constant=number)
    at = position(node, lq, lk)
    if at is None and runs:
        at = _gathered_position(node, runs, lq, lk)
    if at is not None:
        return at
    if is_call(node, aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2 and not node.kwargs:
        a, b = (linear(x, lq, lk, runs) for x in node.args)
        if a is None or b is None:
            return None
        return a + b if node.target is aten.add.Tensor else a - b
    return None


def position(node: object, lq: object, lk: object) -> Linear | None:
    """Whether `node` holds query (or key) positions plus a constant, along the scores' last
    two dims: an `arange` with unit step, through integer offsets and views that only add or
    remove size-1 dims or broadcast."""
    value = tensor_val(node)
    if value is None or value.dtype not in _POSITION_DTYPES:
        return None
    varying = [d for d in range(value.dim()) if not statically_known_true(value.shape[d] == 1)]
    if len(varying) != 1 or value.dim() - varying[0] > 2:
        return None
    on_keys = varying[0] == value.dim() - 1
    found = _offset_arange(node)
    if found is None:
        return None
    node, offset = found
    start = _unit_range_start(node, lk if on_keys else lq)
    if start is None:
        return None
    return Linear(q=int(not on_keys), kv=int(on_keys), constant=offset + start)


def _offset_arange(node: Node) -> tuple[Node, int] | None:
    """(the `arange`, the offset added) where `node` is an `arange` plus integer offsets,
    through views that only add or remove size-1 dims or broadcast."""
    offset = 0
    while not is_call(node, aten.arange.default, aten.arange.start, aten.arange.start_step):
        if is_call(node, *_BROADCAST_VIEWS) or _int_cast(node) or whole_slice(node):
            node = node.args[0]
        elif is_call(node, aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2:
            step = _integer(node.args[1])
            if step is None or not isinstance(node.args[0], Node) or node.kwargs:
                return None
            offset += step if node.target is aten.add.Tensor else -step
            node = node.args[0]
        else:
            return None
        source = tensor_val(node)
        if source is None or source.dtype not in _POSITION_DTYPES:
            return None  # narrower integers wrap around
        if sum(not statically_known_true(s == 1) for s in source.shape) > 1:
            return None
    return node, offset


def _unit_range_start(node: Node, length: object) -> int | None:
    """The start of the `arange` `node` where it steps by 1 over `length` values."""
    if node.target is aten.arange.default:
        start, end, step = 0, node.args[0], 1
    else:
        start, end = node.args[:2]
        step = arg(node, 2, "step", 1) if node.target is aten.arange.start_step else 1
    start, end = _integer(start), val(end) if isinstance(end, Node) else end  # a symbolic size
    if (
        start is None
        or step != 1
        or end is None
        or not statically_known_true(end - start == length)
    ):
        return None
    return start


def _integer(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = constant(value)
    return int(number) if number is not None and number == int(number) else None


def _is_bool(node: object) -> bool:
    value = tensor_val(node)
    return value is not None and value.dtype == torch.bool


_POSITION_DTYPES = (torch.int32, torch.int64)
"""Dtypes positions are read in: narrower integers wrap around, which the arithmetic here does
not model."""
WHERE = (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
_SCALAR_TESTS = {
    aten.lt.Scalar: operator.lt,
    aten.le.Scalar: operator.le,
    aten.gt.Scalar: operator.gt,
    aten.ge.Scalar: operator.ge,
    aten.eq.Scalar: operator.eq,
    aten.ne.Scalar: operator.ne,
}


def _test_of_where(node: object) -> tuple[Node, bool] | None:
    """For a test of `where(cond, a, b)` with constants a and b that tells them apart
    (`.to(bool)`, as MPT reads Hugging Face's float mask, or `< -1`, as Falcon does): cond, and
    whether the test is its negation."""
    if is_call(node, aten.to.dtype, aten._to_copy.default) and _is_bool(node):
        where, test = node.args[0], (lambda x: x != 0)
    elif is_call(node, *_SCALAR_TESTS) and _integer(node.args[1]) is not None:
        bound = _integer(node.args[1])
        where, test = node.args[0], (lambda x: _SCALAR_TESTS[node.target](x, bound))
    else:
        return None
    while is_call(where, aten.expand.default, aten.alias.default):
        where = where.args[0]
    if not is_call(where, *WHERE):
        return None
    cond, a, b = where.args[:3]
    ca, cb = constant(a), constant(b)
    if ca is None or cb is None or test(ca) == test(cb) or not _is_bool(cond):
        return None
    return cond, not test(ca)


def _compared_with_zero(node: object) -> bool:
    """`mask == 0` or `mask != 0` of a boolean mask: its negation, or itself."""
    return (
        is_call(node, aten.eq.Scalar, aten.ne.Scalar)
        and _is_bool(node.args[0])
        and node.args[1] == 0  # (a Python number or bool: the Scalar overload's)
    )


def _leading_ones(node: object) -> bool:
    """A view that only adds or removes leading size-1 dims (`m.view(1, 1, Lq, Lk)`)."""
    if not is_call(node, aten.view.default, aten.reshape.default, aten.unsqueeze.default):
        return False
    before, after = tensor_val(node.args[0]), tensor_val(node)
    if before is None or after is None or min(before.dim(), after.dim()) < 2:
        return False
    ones = all(statically_known_true(n == 1) for t in (before, after) for n in t.shape[:-2])
    return ones and all(statically_known_true(before.shape[d] == after.shape[d]) for d in (-2, -1))


def whole_slice(node: object) -> bool:
    """A slice that keeps every element (`x[:, None]` at symbolic sizes slices the whole dim)."""
    if not is_call(node, aten.slice.Tensor):
        return False
    before, after = tensor_val(node.args[0]), tensor_val(node)
    return (
        before is not None
        and after is not None
        and before.dim() == after.dim()
        and all(
            statically_known_true(a == b) for a, b in zip(before.shape, after.shape, strict=True)
        )
    )


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
        and value.dtype in _POSITION_DTYPES
    )
