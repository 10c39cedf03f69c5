"""One spelling for small ideas: dropout that drops nothing removed, one cast spelling and casts
after reshapes, division by a constant as a multiplication, squares as powers, rsqrt's
spellings, and softmax of x less its row max as softmax of x."""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from seqcompile.fx.nodes import RESHAPES, arg, is_call, rank_of, tensor_val
from seqcompile.normalize.context import RuleContext

aten = torch.ops.aten


def drop_inactive_dropout(node: Node, ctx: RuleContext) -> Node | None:
    """`dropout(x, p=0)` and `dropout(x, train=False)` are `x`."""
    if is_call(node, aten.dropout.default):
        p, train = arg(node, 1, "p"), arg(node, 2, "train")
        if p == 0 or train is False:
            return node.args[0]
    return None


def _cast_target(node: Node) -> torch.dtype | None:
    """The dtype a pure dtype conversion converts to, whatever its spelling (None otherwise)."""
    if is_call(node, aten.to.dtype):
        if arg(node, 3, "copy", False) or arg(node, 4, "memory_format") is not None:
            return None
        return arg(node, 1, "dtype")
    if is_call(node, aten._to_copy.default, aten.to.dtype_layout):
        extra = {k: v for k, v in node.kwargs.items() if v is not None and k != "dtype"}
        if len(node.args) > 1 or set(extra) - {"layout", "device", "non_blocking"}:
            return None
        src = tensor_val(node.args[0])
        if src is None or extra.get("device", src.device) != src.device:
            return None
        if extra.get("layout", torch.strided) != torch.strided:
            return None
        return node.kwargs.get("dtype")
    if is_call(node, aten.type_as.default):
        other = tensor_val(node.args[1])
        return other.dtype if other is not None else None
    return None


def one_cast_spelling(node: Node, ctx: RuleContext) -> Node | None:
    """Every dtype conversion becomes `aten.to.dtype`; an aliasing one (`to`, `type_as`) to the
    dtype its input already has vanishes. (`_to_copy` always copies, so it stays a copy.)"""
    dtype = _cast_target(node)
    src = tensor_val(node.args[0]) if isinstance(node.args[0], Node) else None
    if dtype is None or src is None:
        return None
    if src.dtype == dtype:
        aliasing = node.target in (aten.to.dtype, aten.to.dtype_layout, aten.type_as.default)
        return node.args[0] if aliasing else None
    if node.target is aten.to.dtype and len(node.args) == 2 and not node.kwargs:
        return None
    return ctx.call(aten.to.dtype, node.args[0], dtype)


def cast_after_reshape(node: Node, ctx: RuleContext) -> Node | None:
    """`reshape(to(x, dtype))` becomes `to(reshape(x), dtype)` when the cast is read only there:
    casts move next to their consumer (a loss absorbs the upcast of its logits)."""
    if not is_call(node, *RESHAPES) or not is_call(node.args[0], aten.to.dtype):
        return None
    cast = node.args[0]
    source = tensor_val(cast.args[0])
    if len(cast.users) != 1 or source is None or not source.is_contiguous():
        return None
    reshaped = ctx.call(node.target, cast.args[0], *node.args[1:])
    return ctx.call(aten.to.dtype, reshaped, cast.args[1])


def div_by_constant(node: Node, ctx: RuleContext) -> Node | None:
    """`x / c` becomes `x * (1 / c)` for a power of two `c`, whose reciprocal is exact, so the
    result is bit for bit the same. Other constants stay divisions; patterns that take a scale
    read both spellings."""
    if is_call(node, aten.div.Tensor, aten.div.Scalar) and len(node.args) == 2 and not node.kwargs:
        x, c = node.args
        value = tensor_val(x)
        if isinstance(c, float | int) and not isinstance(c, bool) and _is_power_of_two(c):
            if value is not None and value.is_floating_point():
                return ctx.call(aten.mul.Tensor, x, 1.0 / c)
    return None


def _is_power_of_two(c: float) -> bool:
    mantissa, exponent = math.frexp(abs(c))
    return c != 0 and math.isfinite(c) and mantissa == 0.5 and -126 <= exponent <= 127


def square_as_pow(node: Node, ctx: RuleContext) -> Node | None:
    """`square(x)`, `x * x` and `x ** 2.0` become `x ** 2` for floating `x` (for integer or
    bool `x` the spellings differ in result dtype)."""
    value = tensor_val(node.args[0]) if node.args else None
    if value is None or not value.is_floating_point():
        return None
    if is_call(node, aten.square.default):
        return ctx.call(aten.pow.Tensor_Scalar, node.args[0], 2)
    if is_call(node, aten.mul.Tensor) and len(node.args) == 2 and node.args[0] is node.args[1]:
        return ctx.call(aten.pow.Tensor_Scalar, node.args[0], 2)
    if is_call(node, aten.pow.Tensor_Scalar) and node.args[1] == 2 and type(node.args[1]) is float:
        return ctx.call(aten.pow.Tensor_Scalar, node.args[0], 2)
    return None


def rsqrt_spellings(node: Node, ctx: RuleContext) -> Node | None:
    """`a / sqrt(b)` becomes `a * rsqrt(b)`; `1 / sqrt(b)` and `b ** -0.5` become `rsqrt(b)`."""
    if is_call(node, aten.div.Tensor) and is_call(node.args[1], aten.sqrt.default):
        rsqrt = ctx.call(aten.rsqrt.default, node.args[1].args[0])
        if isinstance(node.args[0], Node):
            return ctx.call(aten.mul.Tensor, node.args[0], rsqrt)
        if node.args[0] == 1:
            return rsqrt
    if is_call(node, aten.reciprocal.default) and is_call(node.args[0], aten.sqrt.default):
        return ctx.call(aten.rsqrt.default, node.args[0].args[0])
    if is_call(node, aten.pow.Tensor_Scalar) and node.args[1] == -0.5:
        return ctx.call(aten.rsqrt.default, node.args[0])
    return None


_ROW_MAXES = (aten.amax.default, aten.max.dim)
_PASSING = (aten.detach.default, aten.alias.default)


def softmax_of_shifted(node: Node, ctx: RuleContext) -> Node | None:
    """`softmax(x - max(x, d, keepdim=True), d)` becomes `softmax(x, d)`: softmax subtracts each
    row's max itself, so the shift (written against float16 and bfloat16 overflow, as GPT-OSS's
    attention with sinks writes it) changes only a rounding of x - m; a row holding +-inf or only
    -inf gives NaN either way. (`_safe_softmax` keeps its shift: it gives 0, not NaN, for a row
    of -inf, which the shift turns into NaN.)"""
    if not is_call(node, aten.softmax.int, aten._softmax.default):
        return None
    y, rank = node.args[0], rank_of(node)
    if not is_call(y, aten.sub.Tensor) or arg(y, 2, "alpha", 1) != 1 or not rank:
        return None
    x, m = y.args[:2]
    while is_call(m, *_PASSING):
        m = m.args[0]
    if is_call(m, operator.getitem) and m.args[1] == 0:
        m = m.args[0]  # (max.dim's values)
    if not is_call(m, *_ROW_MAXES) or m.args[0] is not x or not arg(m, 2, "keepdim", False):
        return None
    dims = arg(m, 1, "dim")
    dims = dims if isinstance(dims, list | tuple) else [dims]
    if [d % rank for d in dims] != [node.args[1] % rank]:
        return None
    return ctx.call(node.target, x, *node.args[1:], **node.kwargs)
