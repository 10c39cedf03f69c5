"""Normalize rules for the element-wise ops the pointwise kernels compute through their definition
in other element-wise ops: `mvlgamma` as a sum of `lgamma`s, and each output of `frexp` (a
mantissa and an integer exponent) from `log2`, `floor` and `exp2`, checked into range. Written
so, their forward and gradient are ops the printer spells."""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node

from seqcompile.fx.nodes import arg, is_call, tensor_val
from seqcompile.normalize.context import RuleContext

aten = torch.ops.aten


def mvlgamma_as_lgammas(node: Node, ctx: RuleContext) -> Node | None:
    """`mvlgamma(x, p)` as its definition, p (p - 1) / 4 log(pi) plus lgamma(x - j / 2) summed
    over j < p: its gradient is then a sum of digammas the pointwise kernels compute (torch's own
    formula sums over a new dimension, which they cannot). Eager takes every x, as this does."""
    if not is_call(node, aten.mvlgamma.default):
        return None
    x, p = node.args[0], arg(node, 1, "p")
    if not isinstance(p, int) or p < 1 or not tensor_val(x).is_floating_point():
        return None  # eager's own errors
    total = ctx.call(aten.lgamma.default, x)
    for j in range(1, p):
        shifted = ctx.call(aten.sub.Tensor, x, j / 2)
        total = ctx.call(aten.add.Tensor, total, ctx.call(aten.lgamma.default, shifted))
    return ctx.call(aten.add.Tensor, total, p * (p - 1) / 4 * math.log(math.pi))


_LIFT = 64
"""Subnormal magnitudes are scaled by 2 ** this before `log2` (which may flush them to zero on a
GPU), in float32 and float64 alike a normal number then."""


def frexp_parts(node: Node, ctx: RuleContext) -> Node | None:
    """`frexp(x)[0]`, the mantissa m with |m| in [0.5, 1), and `frexp(x)[1]`, the int32 exponent
    e with x = m * 2 ** e, as torch computes them (m = x and e = 0 at zero, infinities and NaN),
    bit for bit where `exp2` of an integer is exact. e is first estimated from `log2(|x|)`,
    then moved by one where the estimate rounded across a power of two; m is x scaled by two
    powers of two (one would overflow at the ends of the range), which is exact. The mantissa's
    gradient is then `grad / 2 ** e`, torch's formula (at e >= 128, where torch computes 2 ** e
    in float32, an infinity, and gives 0, this gives the quotient); nothing the exponent reads
    takes a gradient, and no NaN or infinity reaches a product the gradient passes through."""
    if not (node.target is operator.getitem and is_call(node.args[0], aten.frexp.Tensor)):
        return None
    x = node.args[0].args[0]
    value = tensor_val(x)
    if value is None or not value.is_floating_point():
        return None  # eager's own error
    wide = torch.float64 if value.dtype == torch.float64 else torch.float32
    if value.dtype != wide:  # half formats: every value, subnormals too, is normal in float32
        x = ctx.call(aten.to.dtype, x, wide)

    def where(condition: Node, then: Node | float, otherwise: Node | float) -> Node:
        if isinstance(otherwise, float):
            return ctx.call(aten.where.ScalarOther, condition, then, otherwise)
        return ctx.call(aten.where.self, condition, then, otherwise)

    magnitude = ctx.call(aten.abs.default, x)
    regular = ctx.call(
        aten.logical_and.default,
        ctx.call(aten.gt.Scalar, magnitude, 0.0),
        ctx.call(aten.lt.Scalar, magnitude, math.inf),
    )
    finite = where(regular, x, 1.0)  # zero, infinities and NaN take the last `where` alone
    magnitude = ctx.call(aten.abs.default, finite)
    small = ctx.call(aten.lt.Scalar, magnitude, torch.finfo(wide).tiny)
    lifted = where(small, ctx.call(aten.mul.Tensor, magnitude, 2.0**_LIFT), magnitude)
    estimate = ctx.call(aten.floor.default, ctx.call(aten.log2.default, lifted))
    estimate = ctx.call(aten.add.Tensor, estimate, 1.0)
    exponent = ctx.call(aten.sub.Tensor, estimate, ctx.call(aten.mul.Tensor, small, float(_LIFT)))
    half = ctx.call(aten.floor.default, ctx.call(aten.mul.Tensor, exponent, -0.5))
    rest = ctx.call(aten.sub.Tensor, ctx.call(aten.neg.default, exponent), half)
    mantissa = ctx.call(aten.mul.Tensor, finite, ctx.call(aten.exp2.default, half))
    mantissa = ctx.call(aten.mul.Tensor, mantissa, ctx.call(aten.exp2.default, rest))
    for out_of_range, scale, step in (
        (lambda m: ctx.call(aten.ge.Scalar, m, 1.0), 0.5, 1.0),
        (lambda m: ctx.call(aten.lt.Scalar, m, 0.5), 2.0, -1.0),
    ):
        moved = out_of_range(ctx.call(aten.abs.default, mantissa))
        mantissa = where(moved, ctx.call(aten.mul.Tensor, mantissa, scale), mantissa)
        exponent = where(moved, ctx.call(aten.add.Tensor, exponent, step), exponent)
    mantissa = where(regular, mantissa, x)
    if node.args[1] == 0:
        return mantissa if value.dtype == wide else ctx.call(aten.to.dtype, mantissa, value.dtype)
    return ctx.call(aten.to.dtype, where(regular, exponent, 0.0), torch.int32)
