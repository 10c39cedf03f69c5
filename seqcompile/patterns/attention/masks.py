"""Reading constants and masks in the attention family: the constant a 0-d tensor in the graph
holds (`torch.tensor(finfo.min)`, `torch.full([], c)`), and the half-planes of the scores a
boolean triangle keeps (`tril`/`triu` of ones, through views that keep it a top-left block): the
causal one, a sliding window's, or both for a band."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import arg, is_call, tensor_val

aten = torch.ops.aten
CASTS = (aten.to.dtype,)
SHAPE_VIEWS = (aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.expand.default)


def constant(node: object, dtype: torch.dtype | None = None) -> float | None:
    """A Python number, or a 0-d tensor made from one in the graph (`torch.tensor(min)`), at the
    value it holds in its dtype (casts applied: 300 cast to uint8 is 44, 2.5 to int64 is 2), and
    then in `dtype`, where given: that of the op that takes it (`masked_fill` of a boolean tensor
    with -inf writes True, 1)."""
    value = _constant_before_dtype(node)
    fake = tensor_val(node)
    if value is not None and fake is not None:
        value = _in_dtype(value, fake.dtype)
    return value if value is None or dtype is None else _in_dtype(value, dtype)


def _in_dtype(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).item())


def dtype_of(node: object) -> torch.dtype | None:
    """The dtype of the tensor `node` computes (None for anything else)."""
    value = tensor_val(node)
    return value.dtype if value is not None else None


def _constant_before_dtype(node: object) -> float | None:
    if isinstance(node, bool):
        return None
    if isinstance(node, int | float):
        return float(node)
    if is_call(node, aten.scalar_tensor.default):
        return float(node.args[0])
    if is_call(node, aten.full.default) and list(node.args[0]) == []:
        return constant(node.args[1])
    if is_call(node, aten.zeros.default, aten.ones.default) and list(node.args[0]) == []:
        return 0.0 if node.target is aten.zeros.default else 1.0
    if is_call(
        node, aten.lift_fresh_copy.default, aten.detach_.default, aten.detach.default, *CASTS
    ):
        return constant(node.args[0])
    if isinstance(node, Node) and node.op == "get_attr":
        value = getattr(node.graph.owning_module, node.target, None)
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
            return float(value.item())
    return None


def _peel_views(node: object) -> object:
    while is_call(node, *SHAPE_VIEWS, *CASTS, aten.slice.Tensor, aten.alias.default):
        node = node.args[0]
    return node


def _ones(node: object) -> bool:
    node = _peel_views(node)
    if is_call(node, aten.ones.default, aten.ones_like.default):
        return True
    return is_call(node, aten.full.default) and constant(node.args[1], dtype_of(node)) == 1.0


def _filled(node: object) -> float | None:
    """c where every element of `node` is the constant c (in `full`'s dtype: `full(-inf,
    dtype=bool)` holds True): ones (through views and casts), or `full(c)` (through views)."""
    if _ones(node):
        return 1.0
    while is_call(node, *SHAPE_VIEWS, aten.slice.Tensor, aten.alias.default):
        node = node.args[0]
    if not is_call(node, aten.full.default):
        return None
    return constant(node.args[1], dtype_of(node))


def _covers(value: torch.Tensor | None, scores: Sequence[Any]) -> bool:
    """`value`'s last two dims hold the scores' (Lq, Lk) or more: nothing broadcast along
    them."""
    return (
        value is not None
        and value.dim() >= 2
        and statically_known_true(value.shape[-2] >= scores[-2])
        and statically_known_true(value.shape[-1] >= scores[-1])
    )


def _same_rows(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """The last two dims of `a` and `b` are the same sizes."""
    return (
        a is not None
        and b is not None
        and min(a.dim(), b.dim()) >= 2
        and statically_known_true(a.shape[-2] == b.shape[-2])
        and statically_known_true(a.shape[-1] == b.shape[-1])
    )


def _top_left(node: Node, scores: Sequence[Any]) -> object:
    """Step through one view that keeps the (Lq, Lk) block a top-left block of its input: a
    reshape adding or dropping leading dims, a cast, or a slice from 0 of one of the last two dims
    (a top-left block of a triangle is a triangle). None for anything else."""
    value = tensor_val(node)
    if not _covers(value, scores):
        return None
    if is_call(node, *SHAPE_VIEWS, aten.alias.default, *CASTS):
        return node.args[0] if _same_rows(tensor_val(node.args[0]), value) else None
    if is_call(node, aten.slice.Tensor):
        source, dim = tensor_val(node.args[0]), arg(node, 1, "dim", 0)
        start, step = arg(node, 2, "start"), arg(node, 4, "step", 1)
        if source is not None and dim % source.dim() >= source.dim() - 2:
            return node.args[0] if start in (None, 0) and step == 1 else None
        return node.args[0] if _same_rows(source, value) else None
    return None


def is_causal(mask: object, keeps: bool, scores: Sequence[Any]) -> bool:
    """Whether the boolean `mask` is the causal triangle of the last two dims of the shape
    `scores` (see `triangle`)."""
    return triangle(mask, keeps, scores) == [(True, 0)]


def triangle(mask: object, keeps: bool, scores: Sequence[Any]) -> list[tuple[bool, int]] | None:
    """The half-planes of the scores' last two dims (those of the shape `scores`) whose
    intersection the boolean `mask` keeps, where it is a triangle: `tril(ones, d)` (kv - q <= d)
    or `triu(ones, d)` (kv - q >= d) where True keeps, or one of them of another such triangle
    (`ones.tril().triu(-w)`, a band), and a triangle of ones where True masks; through logical
    negations, comparisons with 0, products with a constant and views that keep it a top-left
    block of the triangle. Each half-plane is (upper, bound): kv - q <= bound when `upper`, kv -
    q >= bound otherwise. None for any other mask."""
    return _planes(mask, keeps, scores, cast=False)


def _planes(
    mask: object, keeps: bool, scores: Sequence[Any], cast: bool
) -> list[tuple[bool, int]] | None:
    """`triangle`, with whether a cast lies above `mask` (it may make a constant 0: 0.5 to an
    integer), so that only ones count as not 0 below it."""
    found = _to_triangle(mask, keeps, scores)
    if found is None:
        return None
    node, keeps, cast_above = found
    cast = cast or cast_above
    diagonal = arg(node, 1, "diagonal", 0)
    if not isinstance(diagonal, int):
        return None
    lower = is_call(node, aten.tril.default)  # keeps kv - q <= diagonal
    fill = _filled(node.args[0])
    if fill == 1.0 or (fill not in (None, 0.0) and not cast):
        if keeps:
            return [(lower, diagonal)]
        return [(False, diagonal + 1)] if lower else [(True, diagonal - 1)]
    inner = _planes(node.args[0], True, scores, cast) if keeps else None
    return None if inner is None else [(lower, diagonal), *inner]


def filled_triangle(node: object, scores: Sequence[Any]) -> float | None:
    """c where the float `node` holds c (not 0) on a triangle of the scores' last two dims and 0
    elsewhere (`triu(full(-inf), 1)`, `triu(ones, 1) * -1e9`): added to the scores, it fills that
    triangle with c as a mask would."""
    factor = 1.0
    if is_call(node, aten.mul.Tensor) and constant(node.args[1]) is not None:
        node, factor = node.args[0], constant(node.args[1])
    while isinstance(node, Node) and not is_call(node, aten.tril.default, aten.triu.default):
        if is_call(node, *CASTS) and not tensor_val(node).is_floating_point():
            return None
        node = _top_left(node, scores)
    if node is None or not _covers(tensor_val(node), scores) or not math.isfinite(factor):
        return None  # (0 * inf is NaN, not 0)
    fill = _filled(node.args[0])
    return None if fill in (None, 0.0) else fill * factor


def _to_triangle(
    node: object, keeps: bool, scores: Sequence[Any]
) -> tuple[Node, bool, bool] | None:
    """The `tril` or `triu` that `node` is, holding the scores' (Lq, Lk) block at its top left,
    through negations, comparisons with 0, products with a constant and top-left views: (it,
    whether True keeps there, whether a cast lies between)."""
    cast = False
    while isinstance(node, Node) and not is_call(node, aten.tril.default, aten.triu.default):
        step = _test_step(node, keeps, scores)
        if step is not None:
            node, keeps = step
        else:
            cast = cast or is_call(node, *CASTS)
            node = _top_left(node, scores)
    if node is None or not _covers(tensor_val(node), scores):
        return None
    return node, keeps, cast


def _test_step(node: Node, keeps: bool, scores: Sequence[Any]) -> tuple[object, bool] | None:
    """Through a comparison with 0, a product with a constant or a negation: its operand (None
    where that does not hold the same rows) and whether True keeps there; None for another op."""
    value = tensor_val(node)
    source = tensor_val(node.args[0]) if node.args else None
    if is_call(node, aten.eq.Scalar, aten.ne.Scalar) and node.args[1] == 0:
        keeps = keeps != is_call(node, aten.eq.Scalar)
    elif is_call(node, aten.logical_not.default) or (
        is_call(node, aten.bitwise_not.default) and source is not None
        and source.dtype == torch.bool
    ):  # fmt: skip
        keeps = not keeps
    elif not _nonzero_product(node):
        return None
    same = _covers(value, scores) and _same_rows(source, value)
    return (node.args[0] if same else None), keeps


def _nonzero_product(node: Node) -> bool:
    """`x * c` with c a finite constant other than 0, in floating point: 0 where x is 0 and not 0
    elsewhere (an integer product may wrap to 0, and 0 * inf is NaN)."""
    c = constant(node.args[1]) if is_call(node, aten.mul.Tensor) else None
    value = tensor_val(node)
    return (
        c is not None
        and c != 0
        and math.isfinite(c)
        and value is not None
        and value.is_floating_point()
    )
