"""What one node between `q @ k^T` and the softmax does to the scores, as readings: a scale, a
cast, a reshape of the batch dims, a fill, a modification; and a bias read into its terms.

A bias is split into the terms it sums, and a term that is 0 where a mask keeps and at most
`CAUSAL_FILL` elsewhere is read as that mask filling its value (see `bias_links`).
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import RESHAPES, arg, describe, is_call, tensor_val
from seqcompile.ops.attention.layout import broadcasts_to
from seqcompile.patterns.attention.claims import FillClaim, read_as_is
from seqcompile.patterns.attention.index_arithmetic import whole_slice
from seqcompile.patterns.attention.index_masks import every_row_keeps
from seqcompile.patterns.attention.mask_factors import WHERE
from seqcompile.patterns.attention.masks import (
    CASTS,
    constant,
    dtype_of,
    filled_triangle,
    triangle,
)
from seqcompile.patterns.attention.positions import HalfPlane
from seqcompile.patterns.attention.readings import (
    BatchReshape,
    Bias,
    Cast,
    Floor,
    Mask,
    Modification,
    Product,
    Reading,
    Scale,
    Shift,
    Sum,
    Zeros,
)
from seqcompile.patterns.attention.score_mod import modified_operand
from seqcompile.patterns.engine import Reject

aten = torch.ops.aten

CAUSAL_FILL = -1e4
"""A triangle filled with at most this value is read as causal (the kernel skips what it hides):
exp(-1e4) is 0 in float32, so hidden keys add nothing to a row's softmax either way."""
ABSORBING_FILL = -1e30
"""A bias filled with at most this value where a mask rejects (`where(mask, bias, finfo.min)`) is
read as the bias and the mask: any score plus bias below 1e13 in size plus this fill rounds to the
fill in float32, as the kernel fills. A less negative fill keeps the bias whole, since the fill
plus a large negative bias (padding's) can be what a row's softmax sees."""

_WHERE_ON_SCORES = (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf)
_MASKED_FILL = (aten.masked_fill.Scalar, aten.masked_fill.Tensor)
_SAME_VALUES = (
    aten.expand.default,
    aten.alias.default,
    aten.contiguous.default,
    aten.clone.default,
)
_FILL_ARGUMENT = {aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2}


_FLOORS = (aten.max.other, aten.maximum.default, aten.clamp_min.default, aten.clamp.default)


def _floor(node: Node) -> tuple[Node, float] | None:
    """(scores, c) where `node` is `max(scores, c)` (or `clamp(scores, min=c)`) with a constant
    c at most the lowest finite value of the scores' dtype."""
    if not is_call(node, *_FLOORS) or not is_float(node):
        return None
    if is_call(node, aten.clamp.default) and arg(node, 2, "max") is not None:
        return None
    lowest = torch.finfo(tensor_val(node).dtype).min
    for scores, c in (node.args[:2], node.args[1::-1]):
        value = constant(c)
        if isinstance(scores, Node) and constant(scores) is None and value is not None:
            return (scores, value) if value <= lowest else None
    return None


def scale_factor(node: Node) -> tuple[Node, float] | None:
    """(x, c) for `x * c`, `c * x` or `x / c` with a constant c."""
    if is_call(node, aten.mul.Tensor) and len(node.args) == 2:
        for x, c in (node.args, node.args[::-1]):
            if isinstance(x, Node) and constant(c) is not None:
                return x, constant(c)
    if is_call(node, aten.div.Tensor) and len(node.args) == 2 and not node.kwargs:
        c = constant(node.args[1])
        if isinstance(node.args[0], Node) and c:
            return node.args[0], 1.0 / c
    return None


def batch_reshape(node: Node) -> bool:
    """A reshape that keeps the last two dimensions and only splits or merges the ones before."""
    if not is_call(node, *RESHAPES):
        return False
    before, after = tensor_val(node.args[0]), tensor_val(node)
    return (
        before.dim() >= 2
        and after.dim() >= 2
        and statically_known_true(before.shape[-2] == after.shape[-2])
        and statically_known_true(before.shape[-1] == after.shape[-1])
    )


def same_batch(a: Node, b: Node) -> bool:
    """Provably the same batch dimensions (all but the last two)."""
    x, y = tensor_val(a).shape[:-2], tensor_val(b).shape[:-2]
    return len(x) == len(y) and all(
        statically_known_true(i == j) for i, j in zip(x, y, strict=True)
    )


def is_float(node: object) -> bool:
    value = tensor_val(node) if isinstance(node, Node) else None
    return value is not None and value.is_floating_point()


def link(node: Node) -> tuple[Reading, list[Node]] | Reject | None:
    """What `node` does to the scores, and the operands that may continue the chain upward."""
    if is_call(node, *CASTS):
        return Cast(), [node.args[0]]
    if batch_reshape(node):
        return BatchReshape(node.args[0]), [node.args[0]]
    factor = scale_factor(node)
    if factor is not None and factor[1] != 0:
        return Scale(factor[1]), [factor[0]]
    if is_call(node, aten.add.Tensor, aten.sub.Tensor) and arg(node, 2, "alpha", 1) == 1:
        return _sum_link(node)
    if is_call(node, *_MASKED_FILL, *_WHERE_ON_SCORES):
        return _fill_link(node)
    floor = _floor(node)
    if floor is not None:
        return Floor(floor[1]), [floor[0]]
    scores = modified_operand(node)
    if scores is not None:
        return Modification(node), [scores]
    if is_call(node, aten.mul.Tensor, aten.div.Tensor) and all(is_float(a) for a in node.args[:2]):
        return Product(), list(node.args[:2])
    return None


def _sum_link(node: Node) -> tuple[Reading, list[Node]] | None:
    tensors = [a for a in node.args[:2] if isinstance(a, Node)]
    if len(tensors) == 1 and constant(node.args[1]) is not None:
        return Shift(), tensors  # softmax ignores a constant added to every score
    if len(tensors) == 2:
        return Sum(1.0 if node.target is aten.add.Tensor else -1.0), tensors
    return None


def _fill_link(node: Node) -> tuple[Mask, list[Node]] | Reject:
    """`masked_fill` or `where` with a constant, filling the scores."""
    if is_call(node, *_MASKED_FILL):
        value = constant(node.args[2], dtype_of(node))  # (as the scores hold it)
        if value is None:
            return Reject("masked_fill with a tensor value; the kernel fills with a constant")
        return Mask(node.args[1], False, value), [node.args[0]]
    cond, a, b = node.args[:3]
    ca, cb = constant(a, dtype_of(node)), constant(b, dtype_of(node))
    if cb is not None and isinstance(a, Node):
        return Mask(cond, True, cb), [a]
    if ca is not None and isinstance(b, Node):
        return Mask(cond, False, ca), [b]
    return Reject("where() between two tensors on the scores; the kernel fills a constant")


def bias_links(bias: Node, sign: float, scores: torch.Size) -> list[Reading]:
    """The readings of a bias added to (sign 1) or subtracted from the scores, latest first. An
    added bias is split into the terms it sums, and a term that is 0 where a mask keeps and at
    most `CAUSAL_FILL` elsewhere (Hugging Face's eager masks, `where(mask, 0, finfo.min)`, and a
    triangle filled so, `triu(full(-inf), 1)`) is read as that mask filling its value, and a bias
    filled so (`masked_fill(bias, mask, finfo.min)`, `where(mask, bias, finfo.min)`) as the mask
    and the bias: in float32 a score plus finfo.min is finfo.min, and either way the key adds
    nothing to a row that keeps one. A term of zeros that broadcasts to the `scores` (T5's
    cross-attention position bias) adds nothing. The fills come first, as the kernel fills after
    it adds the biases."""
    node = bias
    while not read_as_is(node) and (is_call(node, *_SAME_VALUES) or whole_slice(node)):
        node = node.args[0]
    if read_as_is(node) or sign < 0:  # (an in-place write, a refuted reading: as it is)
        return [Bias(bias, sign)]
    for reader in (_zeros_term, _terms, _filled_term, _filled_triangle, _where_filled):
        readings = reader(node, sign, scores)
        if readings is not None:
            return readings
    return [Bias(bias, sign)]


def _zeros_term(node: Node, sign: float, scores: torch.Size) -> list[Reading] | None:
    if _zeros(node) and broadcasts_to(tensor_val(node).shape, scores):
        return [Zeros(FillClaim(node, "zeros"))]
    return None


def _terms(node: Node, sign: float, scores: torch.Size) -> list[Reading] | None:
    """A sum of float terms, each read on; the masks first."""
    if not (is_call(node, aten.add.Tensor) and arg(node, 2, "alpha", 1) == 1):
        return None
    terms = node.args[:2]
    if not all(isinstance(t, Node) and tensor_val(t).is_floating_point() for t in terms):
        return None
    readings = [reading for t in terms for reading in bias_links(t, sign, scores)]
    return sorted(readings, key=lambda reading: not isinstance(reading, Mask))


def _filled_term(node: Node, sign: float, scores: torch.Size) -> list[Reading] | None:
    """`masked_fill(term, mask, fill)` with a fill that masks: the mask and the term."""
    if not (is_call(node, aten.masked_fill.Scalar) and isinstance(node.args[0], Node)):
        return None
    term, mask, fill = node.args[0], node.args[1], constant(node.args[2], dtype_of(node))
    if fill is None or fill > CAUSAL_FILL:
        return None
    claim = FillClaim(node, f"{describe(term)} filled with {fill:g}", mask, False, fill, term)
    return [Mask(mask, False, fill, claim), *bias_links(term, sign, scores)]


def _filled_triangle(node: Node, sign: float, scores: torch.Size) -> list[Reading] | None:
    """A triangle of a fill that masks (nn.Transformer's mask): a mask."""
    fill = filled_triangle(node, scores) if is_float(node) else None
    if fill is None or fill > CAUSAL_FILL or not _keeps_a_key(node, fill, scores):
        return None
    claim = FillClaim(node, f"a triangle filled with {fill:g}", node, False, fill)
    return [Mask(node, False, fill, claim)]


def _where_filled(node: Node, sign: float, scores: torch.Size) -> list[Reading] | None:
    """`where(mask, 0, fill)` (a mask), or `where(mask, term, fill)` with a fill that absorbs any
    term (the mask and the term)."""
    if not is_call(node, *WHERE):
        return None
    cond, kept, filled = node.args[:3]
    for keeps, (term, value) in ((True, (kept, filled)), (False, (filled, kept))):
        fill = constant(value, dtype_of(node))
        if fill is None or fill > CAUSAL_FILL:
            continue
        reading = f"a mask filling {fill:g}"
        if constant(term, dtype_of(node)) == 0.0:
            return [Mask(cond, keeps, fill, FillClaim(node, reading, cond, keeps, fill))]
        if fill <= ABSORBING_FILL and isinstance(term, Node) and is_float(term):
            claim = FillClaim(node, f"{describe(term)} and {reading}", cond, keeps, fill, term)
            return [Mask(cond, keeps, fill, claim), *bias_links(term, sign, scores)]
    return None


def _keeps_a_key(triangle_of_fills: Node, fill: float, scores: torch.Size) -> bool:
    """Whether a triangle of a finite fill leaves every query a key: a query it fills on every
    key sees eager's softmax of its scores plus the fill (or a uniform average, where they round
    to it), not what a kernel skipping the triangle computes."""
    planes = triangle(triangle_of_fills, False, scores)
    if planes is None:
        return False
    return math.isinf(fill) or every_row_keeps([HalfPlane(*p) for p in planes], *scores[-2:])


def _zeros(node: Node) -> bool:
    """A tensor of zeros made in the graph."""
    if is_call(node, aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default):
        return True
    if not is_call(node, *_FILL_ARGUMENT):
        return False
    return constant(node.args[_FILL_ARGUMENT[node.target]], dtype_of(node)) == 0
