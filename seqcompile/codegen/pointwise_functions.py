"""The pointwise printer's rules for the functions of the math library: exponentials and
logarithms, trigonometric and hyperbolic functions and their inverses, activations and their
gradients, powers, the error, gamma and Bessel functions, and the ops that combine them (`lerp`,
`addcmul`); most print a call to a helper of `templates/pointwise_helpers.py.jinja`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import Node

from seqcompile.codegen.pointwise_printing import (
    Printer,
    Rule,
    Unprintable,
    float_binary,
    literal,
    tensor_and_scalar,
    unary,
)

aten = torch.ops.aten


_SMALL_POWERS = {
    0: "({x} * 0.0 + 1.0)",
    1: "{x}",
    2: "({x} * {x})",
    3: "({x} * {x} * {x})",
    4: "({x} * {x} * {x} * {x})",
    0.5: "tl.sqrt({x})",
    -0.5: "tl.rsqrt({x})",
    -1: "(1.0 / {x})",
    -2: "(1.0 / ({x} * {x}))",
}


def _pow(x: str, exponent: Any) -> str:
    if not isinstance(exponent, int | float) or isinstance(exponent, bool):
        raise Unprintable(f"pow with exponent {exponent!r}")
    if exponent in _SMALL_POWERS:
        return _SMALL_POWERS[exponent].format(x=x)
    magnitude = f"tl.exp2({literal(float(exponent))} * tl.log2(tl.abs({x})))"
    if float(exponent).is_integer():
        return f"signed_like({magnitude}, {x})" if int(exponent) % 2 else magnitude
    return f"tl.exp2({literal(float(exponent))} * tl.log2({x}))"


def _scalar_base_pow(node: Node, a: list[str], p: Printer) -> str:
    """`base ** x` for a constant base, as `exp2(x * log2(base))` for a positive base; a negative
    base has a real power at integer exponents only (negative at the odd ones), NaN elsewhere."""
    base = node.args[0]
    if not isinstance(base, int | float) or isinstance(base, bool):
        raise Unprintable(f"pow with base {base!r}")
    if not node.meta["val"].dtype.is_floating_point:
        raise Unprintable("pow of a constant base to an integer tensor")
    x = p.as_float(a[1], node.args[1])
    if base == 0:  # 0 ** 0 is 1; 0 ** x is 0 above and inf below, NaN at NaN
        return f'tl.where({x} == 0, 1.0, tl.exp2({x} * -float("inf")))'
    if abs(base) == 1:  # 1 ** x is 1 even at inf and NaN, where the exp2 spelling is NaN
        magnitude = f"(tl.zeros_like({x}) + 1.0)"
    else:
        magnitude = f"tl.exp2({x} * {literal(math.log2(abs(base)))})"
    if base > 0:
        return magnitude
    odd = f"({x} - 2.0 * tl.floor({x} * 0.5) == 1.0)"
    signed = f"tl.where({odd}, {magnitude} * -1.0, {magnitude})"
    return f'tl.where({x} == tl.floor({x}), {signed}, float("nan"))'


def _gelu(node: Node, a: list[str], p: Printer) -> str:
    return f"gelu_tanh({a[0]})" if node.kwargs.get("approximate") == "tanh" else f"gelu({a[0]})"


def _gelu_backward(node: Node, a: list[str], p: Printer) -> str:
    tanh = node.kwargs.get("approximate", "none") == "tanh"
    return f"{'gelu_tanh_grad' if tanh else 'gelu_grad'}({a[0]}, {a[1]})"


def _lerp(node: Node, a: list[str], p: Printer) -> str:
    """torch's formula: (weight, or weight - 1 from 0.5 up) * (end - start) + (start, or end),
    which it fuses into one rounding; where the product alone overflows, the same at half scale
    doubled."""
    start, end = a[0], a[1]
    weight = a[2] if isinstance(node.args[2], Node) else literal(node.args[2])
    small = f"(tl.abs({weight}) < 0.5)"
    coeff = f"tl.where({small}, {weight}, {weight} - 1.0)"
    base = f"tl.where({small}, {start}, {end})"
    diff = f"({end} - {start})"
    plain = f"({coeff} * {diff} + {base})"
    halved = f"((0.5 * {coeff}) * {diff} + 0.5 * {base}) * 2.0"
    inf = literal(math.inf)
    return f"tl.where((tl.abs({plain}) == {inf}) & (tl.abs({halved}) < {inf}), {halved}, {plain})"


def _add_product(divide: bool) -> Rule:
    """addcmul and addcdiv: self + value * t1 * t2 (or t1 / t2). An infinite self stays itself
    where the product is finite in exact arithmetic, though it overflows in float32."""

    def rule(node: Node, a: list[str], p: Printer) -> str:
        this, t1, t2 = a[0], a[1], a[2]
        inf = literal(math.inf)
        value = literal(node.kwargs.get("value", 1))
        if divide:
            term, finite = f"({t1} / {t2})", f"(tl.abs({t1}) < {inf}) & (tl.abs({t2}) > 0)"
        else:
            term, finite = f"({t1} * {t2})", f"(tl.abs({t1}) < {inf}) & (tl.abs({t2}) < {inf})"
        stays = f"(tl.abs({this}) == {inf}) & {finite}"
        return f"tl.where({stays}, {this}, {this} + {value} * {term})"

    return rule


def _softshrink(node: Node, a: list[str], p: Printer) -> str:
    lambd = literal(node.args[1] if len(node.args) > 1 else 0.5)
    x = a[0]
    inside = f"tl.where({x} != {x}, {x}, 0.0)"
    return (
        f"tl.where({x} > {lambd}, {x} - {lambd}, tl.where({x} < -{lambd}, {x} + {lambd}, {inside}))"
    )


def _tanh_backward(node: Node, a: list[str], p: Printer) -> str:
    """grad * (1 - y^2) as grad * (1 - y)(1 + y) (exact near |y| = 1); where that product
    overflows, the gradient scales it first."""
    g, y = a[0], a[1]
    factor = f"((1.0 - {y}) * (1.0 + {y}))"
    wide = f"(({g} * (1.0 - {y})) * (1.0 + {y}))"
    return f"tl.where(tl.abs({factor}) == {literal(math.inf)}, {wide}, {g} * {factor})"


def _polygamma(order: Any, x: str) -> str:
    """The derivatives of log Gamma: digamma (order 0), trigamma (1), and past them by Hurwitz's
    zeta function."""
    if not isinstance(order, int) or order < 0:
        raise Unprintable(f"polygamma of order {order!r} has no Triton spelling")
    if order < 2:
        return f"{'digamma' if order == 0 else 'trigamma'}({x})"
    return f"polygamma({float(order)!r}, {float(math.factorial(order))!r}, {x})"


def _unscaled(scaled: str, x: str) -> str:
    """A Bessel function from its exp(-|x|)-scaled form."""
    return f"unscaled({x}, {scaled}({x}))"


def _elu(node: Node, a: list[str], p: Printer) -> str:
    alpha, scale, input_scale = (list(node.args) + [1, 1, 1])[1:4]
    x = a[0]
    negative = f"{literal(alpha * scale)} * expm1({x} * {literal(input_scale)})"
    return f"tl.where({x} > 0, {x} * {literal(scale)}, {negative})"


def _shrink_backward(node: Node, a: list[str], p: Printer) -> str:
    grad, x, lambd = a[0], a[1], node.args[2]
    inside = f"({x} >= {literal(-lambd)}) & ({x} <= {literal(lambd)})"
    return f"tl.where({inside}, 0.0, {grad})"


def _hardtanh(node: Node, a: list[str], p: Printer) -> str:
    lo, hi = (list(node.args) + [-1.0, 1.0])[1:3]
    x, lo, hi = a[0], literal(lo), literal(hi)
    return f"tl.where({x} < {lo}, {lo}, tl.where({x} > {hi}, {hi}, {x}))"


RULES: dict[Any, Rule] = {
    aten.gelu.default: _gelu,
    aten.gelu_backward.default: _gelu_backward,
    aten.silu.default: lambda n, a, p: f"({a[0]} * sigmoid({a[0]}))",
    aten.silu_backward.default: lambda n, a, p: f"silu_grad({a[0]}, {a[1]})",
    aten.sigmoid.default: unary("sigmoid"),
    aten.sigmoid_backward.default: lambda n, a, p: f"({a[0]} * {a[1]} * (1.0 - {a[1]}))",
    aten.tanh.default: unary("tanh"),
    aten.tanh_backward.default: _tanh_backward,
    aten.exp.default: unary("tl.exp"),
    aten.log.default: unary("tl.log"),
    aten.sqrt.default: unary("tl.sqrt"),
    aten.rsqrt.default: unary("tl.rsqrt"),
    aten.erf.default: unary("tl.erf"),
    aten.sin.default: unary("tl.sin"),
    aten.cos.default: unary("tl.cos"),
    aten.pow.Tensor_Scalar: lambda n, a, p: _pow(p.as_float(a[0], n.args[0]), n.args[1]),
    aten.pow.Scalar: _scalar_base_pow,
    aten.ldexp.Tensor: lambda n, a, p: f"({a[0]} * tl.exp2({p.as_float(a[1], n.args[1])}))",
    aten.log1p.default: unary("log1p"),
    aten.expm1.default: unary("expm1"),
    aten.exp2.default: unary("tl.exp2"),
    aten.log2.default: unary("tl.log2"),
    aten.log10.default: lambda n, a, p: (
        f"(tl.log({p.as_float(a[0], n.args[0])}) * 0.4342944819032518)"
    ),
    aten.tan.default: lambda n, a, p: f"(tl.sin({a[0]}) / tl.cos({a[0]}))",
    aten.atan.default: unary("atan"),
    aten.asin.default: lambda n, a, p: f"atan2({a[0]}, tl.sqrt((1.0 - {a[0]}) * (1.0 + {a[0]})))",
    aten.acos.default: lambda n, a, p: f"atan2(tl.sqrt((1.0 - {a[0]}) * (1.0 + {a[0]})), {a[0]})",
    aten.sinh.default: unary("sinh"),
    aten.cosh.default: unary("cosh"),
    aten.asinh.default: unary("asinh"),
    aten.acosh.default: unary("acosh"),
    aten.atanh.default: unary("atanh"),
    aten.erfc.default: unary("erfc"),
    aten.special_erfcx.default: unary("erfcx"),
    aten.special_log_ndtr.default: unary("log_ndtr"),
    aten.special_i0e.default: unary("bessel_i0e"),
    aten.special_i1e.default: unary("bessel_i1e"),
    aten.i0.default: lambda n, a, p: _unscaled("bessel_i0e", p.as_float(a[0], n.args[0])),
    aten.special_i1.default: lambda n, a, p: _unscaled("bessel_i1e", p.as_float(a[0], n.args[0])),
    aten.erfinv.default: unary("erfinv"),
    aten.lgamma.default: unary("lgamma"),
    aten.digamma.default: unary("digamma"),
    aten.polygamma.default: lambda n, a, p: _polygamma(n.args[0], p.as_float(a[1], n.args[1])),
    aten.special_ndtri.default: unary("ndtri"),
    aten.atan2.default: float_binary("atan2"),
    aten.hypot.default: float_binary("hypot"),
    aten.pow.Tensor_Tensor: float_binary("power"),
    aten.elu.default: _elu,
    aten.leaky_relu.default: lambda n, a, p: (
        f"tl.where({a[0]} > 0, {a[0]}, {a[0]} * {literal(n.args[1] if len(n.args) > 1 else 0.01)})"
    ),
    aten.hardtanh.default: _hardtanh,
    aten.hardshrink_backward.default: _shrink_backward,
    aten.softshrink.default: _softshrink,
    aten.sinc.default: unary("sinc"),
    **tensor_and_scalar(aten.lerp, _lerp),
    aten.addcmul.default: _add_product(divide=False),
    aten.addcdiv.default: _add_product(divide=True),
    aten.softshrink_backward.default: _shrink_backward,
}
