"""The expression printer from post-dispatch ATen to Triton: a traced pointwise graph becomes the
body of the `pointwise` kernel template, one line per node. Floating values are computed in float32
(float64 when the graph holds float64); an explicit cast to a half type rounds there, as eager does.
Loads and stores convert from and to whatever dtype the tensors have at launch."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node

from seqcompile.codegen.render import KernelSpec

aten = torch.ops.aten
Layout = str | tuple[bool, ...]
"""How an operand is indexed: "flat" (contiguous over the whole region), "scalar" (one element),
or, per dimension of the collapsed region shape, whether the operand varies along it (strided)."""


class Unprintable(Exception):
    """A node the printer has no Triton spelling for; the message names it."""


@dataclasses.dataclass(frozen=True)
class Load:
    """A placeholder read from tensor parameter `name` with `layout`."""

    name: str
    layout: Layout


@dataclasses.dataclass(frozen=True)
class Mask:
    """A placeholder that is dropout's keep-mask, regenerated from the seed: element `idx` of
    random stream `stream + offset` is kept when its uniform number is at least `p`."""

    offset: int
    p: float


def _literal(value: Any) -> str:
    if value is None or isinstance(value, bool):  # None: an absent bound (clamp's min or max)
        return repr(value)
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else '-float("inf")'
        return repr(value)
    if isinstance(value, int):
        return repr(value)
    raise Unprintable(f"constant {value!r} of type {type(value).__name__}")


def _kind(dtype: torch.dtype) -> str:
    if dtype is torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


_TL_DTYPES = {
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
}


class _Printer:
    def __init__(self, float_type: str) -> None:
        self.float_type = float_type

    def cast(self, x: str, dtype: torch.dtype) -> str:
        """`x` (computed as its kind) converted to `dtype`, rounded when `dtype` is a half type."""
        if dtype is torch.bool:
            return f"({x} != 0)"
        if dtype not in _TL_DTYPES:
            raise Unprintable(f"cast to {dtype}")
        if dtype.is_floating_point:
            if dtype in (torch.float16, torch.bfloat16) or (
                dtype is torch.float32 and self.float_type == "tl.float64"
            ):
                return f"{x}.to({_TL_DTYPES[dtype]}).to({self.float_type})"
            return f"{x}.to({self.float_type})"
        return f"{x}.to({_TL_DTYPES[dtype]})"

    def as_float(self, x: str, node_arg: Any) -> str:
        if isinstance(node_arg, Node) and _kind(node_arg.meta["val"].dtype) != "float":
            return f"{x}.to({self.float_type})"
        return x


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
    magnitude = f"tl.exp2({_literal(float(exponent))} * tl.log2(tl.abs({x})))"
    if float(exponent).is_integer():
        return f"signed_like({magnitude}, {x})" if int(exponent) % 2 else magnitude
    return f"tl.exp2({_literal(float(exponent))} * tl.log2({x}))"


def _scalar_base_pow(node: Node, a: list[str], p: _Printer) -> str:
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
        magnitude = f"tl.exp2({x} * {_literal(math.log2(abs(base)))})"
    if base > 0:
        return magnitude
    odd = f"({x} - 2.0 * tl.floor({x} * 0.5) == 1.0)"
    signed = f"tl.where({odd}, {magnitude} * -1.0, {magnitude})"
    return f'tl.where({x} == tl.floor({x}), {signed}, float("nan"))'


def _alpha(node: Node) -> Any:
    return node.kwargs.get("alpha", 1)


def _scaled(b: str, alpha: Any) -> str:
    return b if alpha == 1 else f"{b} * {_literal(alpha)}"


_Rule = Callable[[Node, list[str], _Printer], str]


def _unary(fn: str) -> _Rule:
    return lambda node, a, p: f"{fn}({p.as_float(a[0], node.args[0])})"


def _compare(op: str) -> _Rule:
    return lambda node, a, p: f"({a[0]} {op} {a[1]})"


def _logical(op: str) -> _Rule:
    return lambda node, a, p: f"(({a[0]} != 0) {op} ({a[1]} != 0))"


def _gelu(node: Node, a: list[str], p: _Printer) -> str:
    return f"gelu_tanh({a[0]})" if node.kwargs.get("approximate") == "tanh" else f"gelu({a[0]})"


def _gelu_backward(node: Node, a: list[str], p: _Printer) -> str:
    tanh = node.kwargs.get("approximate", "none") == "tanh"
    return f"{'gelu_tanh_grad' if tanh else 'gelu_grad'}({a[0]}, {a[1]})"


def _to_copy(node: Node, a: list[str], p: _Printer) -> str:
    dtype = node.kwargs.get("dtype")
    return a[0] if dtype is None else p.cast(a[0], dtype)


def _in_dtype(value: Any, dtype: torch.dtype) -> str:
    """A constant as an op of `dtype` writes it: torch converts the scalar to the tensor's dtype
    (`masked_fill` of a boolean tensor with -inf writes True, of an integer one with -0.4 writes
    0)."""
    if isinstance(value, Node):
        raise Unprintable(f"constant {value} computed by the graph")
    return _literal(torch.tensor(value, dtype=dtype).item())


def _constant(value_index: int) -> _Rule:
    def rule(node: Node, a: list[str], p: _Printer) -> str:
        value = node.args[value_index] if value_index >= 0 else -value_index - 1
        return _in_dtype(value, node.meta["val"].dtype)

    return rule


def _masked_fill(node: Node, a: list[str], p: _Printer) -> str:
    value = node.args[2]
    fill = a[2] if isinstance(value, Node) else _in_dtype(value, node.meta["val"].dtype)
    return f"tl.where({a[1]}, {fill}, {a[0]})"


def _clamp(node: Node, a: list[str], p: _Printer) -> str:
    lo, hi = (node.args + (None, None))[1:3]
    x = a[0]
    if lo is not None:
        x = f"tl.maximum({x}, {_literal(lo)})"
    if hi is not None:
        x = f"tl.minimum({x}, {_literal(hi)})"
    return x


def _rounding(fn: str) -> _Rule:
    """floor, ceil, trunc and round: the identity on integers."""

    def rule(node: Node, a: list[str], p: _Printer) -> str:
        if not node.meta["val"].dtype.is_floating_point:
            return a[0]
        if fn == "round":
            exact = "4503599627370496.0" if p.float_type == "tl.float64" else "8388608.0"
            return f"round_half_even({a[0]}, {exact})"
        return f"{fn}({a[0]})"

    return rule


def _float_binary(fn: str) -> _Rule:
    """A helper of two floating operands (integers refused: their rules differ)."""

    def rule(node: Node, a: list[str], p: _Printer) -> str:
        if not node.meta["val"].dtype.is_floating_point:
            raise Unprintable(f"{node.target} of integers")
        return f"{fn}({p.as_float(a[0], node.args[0])}, {p.as_float(a[1], node.args[1])})"

    return rule


def _quotient(node: Node, a: list[str], p: _Printer) -> str:
    """`div(a, b, rounding_mode=...)`: the quotient truncated or floored."""
    mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
    if not node.meta["val"].dtype.is_floating_point:
        raise Unprintable(f"{node.target} of integers")
    q = f"({a[0]} / {a[1]})"
    return {"trunc": f"trunc({q})", "floor": f"tl.floor({q})"}.get(mode, q)


def _modulo(floored: bool) -> _Rule:
    """fmod (the remainder of the truncated quotient) and remainder (of the floored one).
    Triton's `%` is C's: it truncates on integers and is fmod, exact, on floats; the floored
    remainder takes the divisor's sign."""

    def rule(node: Node, a: list[str], p: _Printer) -> str:
        r = f"({a[0]} % {a[1]})"
        if not floored:
            return r
        return f"tl.where(({r} != 0) & (({r} < 0) != ({a[1]} < 0)), {r} + {a[1]}, {r})"

    return rule


def _negated(node: Node, a: list[str], p: _Printer) -> str:
    """Triton's unary minus is 0 - x, which loses a zero's sign: floats are multiplied."""
    return f"({a[0]} * -1.0)" if node.meta["val"].dtype.is_floating_point else f"(-{a[0]})"


def _lerp(node: Node, a: list[str], p: _Printer) -> str:
    """torch's formula: (weight, or weight - 1 from 0.5 up) * (end - start) + (start, or end),
    which it fuses into one rounding; where the product alone overflows, the same at half scale
    doubled."""
    start, end = a[0], a[1]
    weight = a[2] if isinstance(node.args[2], Node) else _literal(node.args[2])
    small = f"(tl.abs({weight}) < 0.5)"
    coeff = f"tl.where({small}, {weight}, {weight} - 1.0)"
    base = f"tl.where({small}, {start}, {end})"
    diff = f"({end} - {start})"
    plain = f"({coeff} * {diff} + {base})"
    halved = f"((0.5 * {coeff}) * {diff} + 0.5 * {base}) * 2.0"
    inf = _literal(math.inf)
    return f"tl.where((tl.abs({plain}) == {inf}) & (tl.abs({halved}) < {inf}), {halved}, {plain})"


def _add_product(divide: bool) -> _Rule:
    """addcmul and addcdiv: self + value * t1 * t2 (or t1 / t2). An infinite self stays itself
    where the product is finite in exact arithmetic, though it overflows in float32."""

    def rule(node: Node, a: list[str], p: _Printer) -> str:
        this, t1, t2 = a[0], a[1], a[2]
        inf = _literal(math.inf)
        value = _literal(node.kwargs.get("value", 1))
        if divide:
            term, finite = f"({t1} / {t2})", f"(tl.abs({t1}) < {inf}) & (tl.abs({t2}) > 0)"
        else:
            term, finite = f"({t1} * {t2})", f"(tl.abs({t1}) < {inf}) & (tl.abs({t2}) < {inf})"
        stays = f"(tl.abs({this}) == {inf}) & {finite}"
        return f"tl.where({stays}, {this}, {this} + {value} * {term})"

    return rule


def _softshrink(node: Node, a: list[str], p: _Printer) -> str:
    lambd = _literal(node.args[1] if len(node.args) > 1 else 0.5)
    x = a[0]
    inside = f"tl.where({x} != {x}, {x}, 0.0)"
    return (
        f"tl.where({x} > {lambd}, {x} - {lambd}, tl.where({x} < -{lambd}, {x} + {lambd}, {inside}))"
    )


def _tanh_backward(node: Node, a: list[str], p: _Printer) -> str:
    """grad * (1 - y^2) as grad * (1 - y)(1 + y) (exact near |y| = 1); where that product
    overflows, the gradient scales it first."""
    g, y = a[0], a[1]
    factor = f"((1.0 - {y}) * (1.0 + {y}))"
    wide = f"(({g} * (1.0 - {y})) * (1.0 + {y}))"
    return f"tl.where(tl.abs({factor}) == {_literal(math.inf)}, {wide}, {g} * {factor})"


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


_BITS = {
    torch.float16: ("tl.float16", "tl.int16", 1),
    torch.bfloat16: ("tl.float32", "tl.int32", 1 << 16),
    torch.float32: ("tl.float32", "tl.int32", 1),
    torch.float64: ("tl.float64", "tl.int64", 1),
}
"""Each float format: the type its bits are stepped in, their integer type and one step (a
bfloat16 is the top half of a float32)."""


def _nextafter(node: Node, a: list[str], p: _Printer) -> str:
    """A step of the value's bits in its own format (a half type's, not the float32 it is
    computed in)."""
    dtype = node.meta["val"].dtype
    if dtype not in _BITS:
        raise Unprintable(f"nextafter of {dtype}")
    float_type, bits, step = _BITS[dtype]
    x, y = (f"{v}.to({float_type})" for v in a[:2])
    return f"nextafter({x}, {y}, {bits}, {step}).to({p.float_type})"


def _signbit(x: str, p: _Printer) -> str:
    bits = "tl.int64" if p.float_type == "tl.float64" else "tl.int32"
    return f"({x}.to({bits}, bitcast=True) < 0)"


def _clamp_tensor(node: Node, a: list[str], p: _Printer) -> str:
    bounds = (list(node.args) + [None, None])[1:3]
    x = a[0]
    if bounds[0] is not None:
        x = f"tl.maximum({x}, {a[1]})"
    if bounds[1] is not None:
        x = f"tl.minimum({x}, {a[2]})"
    return x


def _elu(node: Node, a: list[str], p: _Printer) -> str:
    alpha, scale, input_scale = (list(node.args) + [1, 1, 1])[1:4]
    x = a[0]
    negative = f"{_literal(alpha * scale)} * expm1({x} * {_literal(input_scale)})"
    return f"tl.where({x} > 0, {x} * {_literal(scale)}, {negative})"


def _shrink_backward(node: Node, a: list[str], p: _Printer) -> str:
    grad, x, lambd = a[0], a[1], node.args[2]
    inside = f"({x} >= {_literal(-lambd)}) & ({x} <= {_literal(lambd)})"
    return f"tl.where({inside}, 0.0, {grad})"


def _hardtanh(node: Node, a: list[str], p: _Printer) -> str:
    lo, hi = (list(node.args) + [-1.0, 1.0])[1:3]
    x, lo, hi = a[0], _literal(lo), _literal(hi)
    return f"tl.where({x} < {lo}, {lo}, tl.where({x} > {hi}, {hi}, {x}))"


_RULES: dict[Any, _Rule] = {
    aten.add.Tensor: lambda n, a, p: f"({a[0]} + {_scaled(a[1], _alpha(n))})",
    aten.add.Scalar: lambda n, a, p: f"({a[0]} + {_scaled(a[1], _alpha(n))})",
    aten.sub.Tensor: lambda n, a, p: f"({a[0]} - {_scaled(a[1], _alpha(n))})",
    aten.sub.Scalar: lambda n, a, p: f"({a[0]} - {_scaled(a[1], _alpha(n))})",
    aten.rsub.Tensor: lambda n, a, p: f"({a[1]} - {_scaled(a[0], _alpha(n))})",
    aten.rsub.Scalar: lambda n, a, p: f"({a[1]} - {_scaled(a[0], _alpha(n))})",
    aten.mul.Tensor: lambda n, a, p: f"({a[0]} * {a[1]})",
    aten.mul.Scalar: lambda n, a, p: f"({a[0]} * {a[1]})",
    aten.div.Tensor: lambda n, a, p: f"({p.as_float(a[0], n.args[0])} / {a[1]})",
    aten.div.Scalar: lambda n, a, p: f"({p.as_float(a[0], n.args[0])} / {a[1]})",
    aten.neg.default: _negated,
    aten.reciprocal.default: lambda n, a, p: f"(1.0 / {a[0]})",
    aten.where.self: lambda n, a, p: f"tl.where({a[0]}, {a[1]}, {a[2]})",
    aten.masked_fill.Scalar: _masked_fill,
    aten.masked_fill.Tensor: _masked_fill,
    aten.logical_not.default: lambda n, a, p: f"({a[0]} == 0)",
    aten.logical_and.default: _logical("&"),
    aten.logical_or.default: _logical("|"),
    aten.logical_xor.default: _logical("^"),
    aten.bitwise_not.default: lambda n, a, p: (
        f"({a[0]} == 0)" if n.meta["val"].dtype is torch.bool else f"(~{a[0]})"
    ),
    aten.bitwise_and.Tensor: lambda n, a, p: f"({a[0]} & {a[1]})",
    aten.bitwise_or.Tensor: lambda n, a, p: f"({a[0]} | {a[1]})",
    aten.bitwise_xor.Tensor: lambda n, a, p: f"({a[0]} ^ {a[1]})",
    aten.relu.default: lambda n, a, p: f"tl.where({a[0]} < 0, 0, {a[0]})",
    aten.threshold_backward.default: lambda n, a, p: f"tl.where({a[1]} <= {a[2]}, 0, {a[0]})",
    aten.gelu.default: _gelu,
    aten.gelu_backward.default: _gelu_backward,
    aten.silu.default: lambda n, a, p: f"({a[0]} * sigmoid({a[0]}))",
    aten.silu_backward.default: lambda n, a, p: f"silu_grad({a[0]}, {a[1]})",
    aten.sigmoid.default: _unary("sigmoid"),
    aten.sigmoid_backward.default: lambda n, a, p: f"({a[0]} * {a[1]} * (1.0 - {a[1]}))",
    aten.tanh.default: _unary("tanh"),
    aten.tanh_backward.default: _tanh_backward,
    aten.exp.default: _unary("tl.exp"),
    aten.log.default: _unary("tl.log"),
    aten.sqrt.default: _unary("tl.sqrt"),
    aten.rsqrt.default: _unary("tl.rsqrt"),
    aten.erf.default: _unary("tl.erf"),
    aten.sin.default: _unary("tl.sin"),
    aten.cos.default: _unary("tl.cos"),
    aten.abs.default: lambda n, a, p: f"tl.abs({a[0]})",
    aten.sgn.default: _unary("sign"),
    aten.sign.default: _unary("sign"),
    aten.pow.Tensor_Scalar: lambda n, a, p: _pow(p.as_float(a[0], n.args[0]), n.args[1]),
    aten.pow.Scalar: _scalar_base_pow,
    aten.clamp.default: _clamp,
    aten.clamp_min.default: _clamp,
    aten.clamp_max.default: lambda n, a, p: f"tl.minimum({a[0]}, {a[1]})",
    aten.maximum.default: lambda n, a, p: f"tl.maximum({a[0]}, {a[1]})",
    aten.minimum.default: lambda n, a, p: f"tl.minimum({a[0]}, {a[1]})",
    aten._to_copy.default: _to_copy,
    aten.scalar_tensor.default: _constant(0),
    aten.full_like.default: _constant(1),
    aten.zeros_like.default: _constant(-1),
    aten.zeros.default: _constant(-1),
    aten.ones_like.default: _constant(-2),
    aten.full.default: _constant(1),
    aten._efficientzerotensor.default: _constant(-1),
    aten.ldexp.Tensor: lambda n, a, p: f"({a[0]} * tl.exp2({p.as_float(a[1], n.args[1])}))",
    aten.log1p.default: _unary("log1p"),
    aten.expm1.default: _unary("expm1"),
    aten.exp2.default: _unary("tl.exp2"),
    aten.log2.default: _unary("tl.log2"),
    aten.log10.default: lambda n, a, p: (
        f"(tl.log({p.as_float(a[0], n.args[0])}) * 0.4342944819032518)"
    ),
    aten.floor.default: _rounding("tl.floor"),
    aten.ceil.default: _rounding("tl.ceil"),
    aten.trunc.default: _rounding("trunc"),
    aten.round.default: _rounding("round"),
    aten.tan.default: lambda n, a, p: f"(tl.sin({a[0]}) / tl.cos({a[0]}))",
    aten.atan.default: _unary("atan"),
    aten.asin.default: lambda n, a, p: f"atan2({a[0]}, tl.sqrt((1.0 - {a[0]}) * (1.0 + {a[0]})))",
    aten.acos.default: lambda n, a, p: f"atan2(tl.sqrt((1.0 - {a[0]}) * (1.0 + {a[0]})), {a[0]})",
    aten.sinh.default: _unary("sinh"),
    aten.cosh.default: _unary("cosh"),
    aten.asinh.default: _unary("asinh"),
    aten.acosh.default: _unary("acosh"),
    aten.atanh.default: _unary("atanh"),
    aten.erfc.default: _unary("erfc"),
    aten.special_erfcx.default: _unary("erfcx"),
    aten.special_log_ndtr.default: _unary("log_ndtr"),
    aten.special_i0e.default: _unary("bessel_i0e"),
    aten.special_i1e.default: _unary("bessel_i1e"),
    aten.i0.default: lambda n, a, p: _unscaled("bessel_i0e", p.as_float(a[0], n.args[0])),
    aten.special_i1.default: lambda n, a, p: _unscaled("bessel_i1e", p.as_float(a[0], n.args[0])),
    aten.erfinv.default: _unary("erfinv"),
    aten.lgamma.default: _unary("lgamma"),
    aten.digamma.default: _unary("digamma"),
    aten.polygamma.default: lambda n, a, p: _polygamma(n.args[0], p.as_float(a[1], n.args[1])),
    aten.special_ndtri.default: _unary("ndtri"),
    aten.atan2.default: _float_binary("atan2"),
    aten.nextafter.default: _nextafter,
    aten.hypot.default: _float_binary("hypot"),
    aten.fmax.default: _float_binary("fmax"),
    aten.fmin.default: _float_binary("fmin"),
    aten.pow.Tensor_Tensor: _float_binary("power"),
    aten.copysign.Tensor: lambda n, a, p: (
        f"tl.where({_signbit(p.as_float(a[1], n.args[1]), p)}, tl.abs({a[0]}) * -1.0,"
        f" tl.abs({a[0]}))"
    ),
    aten.div.Tensor_mode: _quotient,
    aten.fmod.Tensor: _modulo(floored=False),
    aten.fmod.Scalar: _modulo(floored=False),
    aten.remainder.Tensor: _modulo(floored=True),
    aten.remainder.Scalar: _modulo(floored=True),
    aten.isnan.default: lambda n, a, p: f"({a[0]} != {a[0]})",
    aten.isinf.default: lambda n, a, p: f'(tl.abs({a[0]}) == float("inf"))',
    aten.signbit.default: lambda n, a, p: _signbit(p.as_float(a[0], n.args[0]), p),
    aten.angle.default: lambda n, a, p: (
        f"tl.where({a[0]} != {a[0]}, {a[0]}, tl.where({a[0]} < 0, 3.141592653589793, 0.0))"
    ),
    aten.clamp.Tensor: _clamp_tensor,
    aten.elu.default: _elu,
    aten.leaky_relu.default: lambda n, a, p: (
        f"tl.where({a[0]} > 0, {a[0]}, {a[0]} * {_literal(n.args[1] if len(n.args) > 1 else 0.01)})"
    ),
    aten.hardtanh.default: _hardtanh,
    aten.hardshrink_backward.default: _shrink_backward,
    aten.softshrink.default: _softshrink,
    aten.sinc.default: _unary("sinc"),
    aten.lerp.Scalar: _lerp,
    aten.lerp.Tensor: _lerp,
    aten.addcmul.default: _add_product(divide=False),
    aten.addcdiv.default: _add_product(divide=True),
    aten.softshrink_backward.default: _shrink_backward,
}
for _name, _op in (
    ("eq", "=="),
    ("ne", "!="),
    ("lt", "<"),
    ("le", "<="),
    ("gt", ">"),
    ("ge", ">="),
):
    _RULES[getattr(aten, _name).Tensor] = _compare(_op)
    _RULES[getattr(aten, _name).Scalar] = _compare(_op)

_CONSTANTS = frozenset(
    _RULES[op]
    for op in (
        aten.scalar_tensor.default, aten.full_like.default, aten.zeros_like.default,
        aten.zeros.default, aten.ones_like.default, aten.full.default,
        aten._efficientzerotensor.default,
    )
)  # fmt: skip
"""The rules that print a literal, already the value the op's dtype holds (a literal has no
`.to`; Triton promotes it with what it meets)."""
PRINTABLE = frozenset(_RULES)
"""Post-dispatch ATen ops the printer spells in Triton."""


def _float_type(gm: GraphModule) -> str:
    wide = any(
        isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dtype is torch.float64
        for n in gm.graph.nodes
    )
    return "tl.float64" if wide else "tl.float32"


def _offset(name: str, layout: Layout) -> str:
    if layout == "flat":
        return "idx"
    terms = [f"c{d} * {name}_stride{d}" for d, varies in enumerate(layout) if varies]
    return " + ".join(terms) or "0"


def _print_nodes(gm: GraphModule, names: dict[Node, str], printer: _Printer) -> list[str]:
    """One line per call in `gm`, assigning its value to `v_<name>` (recorded in `names`, which
    holds the placeholders' variables)."""
    lines = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        rule = _RULES.get(node.target)
        if rule is None:
            raise Unprintable(f"{node.target} has no Triton spelling in the pointwise printer")
        # a list is a constant's size (zeros): the constant broadcasts over the region
        args = [
            names[a] if isinstance(a, Node) else _literal(a)
            for a in node.args
            if not isinstance(a, torch.dtype | torch.device | torch.layout | str | list)
        ]
        var = names[node] = f"v_{node.name}"
        value = rule(node, args, printer)
        lines.append(f"{var} = {value if rule in _CONSTANTS else _in_kind(value, node)}")
    return lines


def _in_kind(expression: str, node: Node) -> str:
    """`expression` held as `node`'s boolean or integer dtype holds it: Triton promotes an op's
    operands among themselves, where torch writes the result in the op's own dtype (a boolean
    `where` of a float branch is a boolean, an integer sum wraps at its width)."""
    dtype = node.meta["val"].dtype
    if dtype is torch.bool:
        return f"({expression} != 0)"
    if not dtype.is_floating_point and dtype in _TL_DTYPES:
        return f"({expression}).to({_TL_DTYPES[dtype]})"
    return expression


def jit_function(gm: GraphModule, name: str) -> tuple[str, ...]:
    """`gm` as the source lines of a `@triton.jit` function `name` of its placeholders (float
    values) returning its outputs, one line per node."""
    printer = _Printer(_float_type(gm))
    names = {n: f"v_{n.name}" for n in gm.graph.nodes if n.op == "placeholder"}
    params = list(names.values())
    lines = _print_nodes(gm, names, printer)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    returned = ", ".join(names[value] for value in output.args[0])
    return (
        "@triton.jit",
        f"def {name}({', '.join(params)}):",
        *(f"    {line}" for line in lines),
        f"    return {returned}",
    )


def render(
    gm: GraphModule,
    operands: Sequence[Load | Mask | None],
    outputs: Sequence[str],
    rank: int,
    mode: str,
    region: str,
    label: str | None = None,
) -> tuple[KernelSpec, tuple[str, ...]]:
    """The `mode` ("forward" or "backward") kernel of `region` (named after `label`, a user
    pattern, when given), computing `gm`: placeholder i
    is read as `operands[i]` (None: unused), and the graph's i-th output is stored to the tensor
    parameter `outputs[i]`. Returns the spec and the kernel's parameter names in order (tensors
    by name; `<name>_stride<d>`, `size<d>`, `inner<d>`, `N`, `SEED`, `stream`)."""
    printer = _Printer(_float_type(gm))
    names: dict[Node, str] = {}
    body: list[str] = []
    params: list[tuple[str, str]] = []
    scalars: list[str] = []
    used_dims: set[int] = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    masks = False

    for node, operand in zip(placeholders, operands, strict=True):
        if not node.users:
            continue
        var = names[node] = f"v_{node.name}"
        if isinstance(operand, Mask):
            masks = True
            body.append(
                f"{var} = philox_uniform_run(seed, tl.program_id(0).to(tl.int64) * BLOCK,"
                f" stream + {operand.offset}, BLOCK) >= {operand.p!r}"
            )
            continue
        assert operand is not None, f"placeholder {node.name} is read but has no operand"
        params.append((operand.name, what_of(node)))
        if isinstance(operand.layout, tuple):
            for d, varies in enumerate(operand.layout):
                if varies:
                    scalars.append(f"{operand.name}_stride{d}")
                    used_dims.add(d)
        if operand.layout == "scalar":
            load = f"tl.load({operand.name})"
        else:
            offset = _offset(operand.name, operand.layout)
            load = f"tl.load({operand.name} + {offset}, mask=live, other=0)"
        kind = _kind(node.meta["val"].dtype)
        if kind == "float":
            load += f".to({printer.float_type})"
        elif kind == "bool":
            load = f"({load} != 0)"
        body.append(f"{var} = {load}")

    body += _print_nodes(gm, names, printer)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for name, value in zip(outputs, output.args[0], strict=True):
        params.append((name, "output, contiguous over the region"))
        body.append(f"tl.store({name} + idx, {names[value]}, mask=live)")

    coords = []
    for d in sorted(used_dims):
        if rank == 1:  # the region collapsed to one dimension: its index is the coordinate
            coords.append("c0 = idx")
        elif d == 0:
            coords.append("c0 = idx // inner0")
        elif d == rank - 1:
            coords.append(f"c{d} = idx % size{d}")
        else:
            coords.append(f"c{d} = idx // inner{d} % size{d}")
    dims = [f"size{d}" for d in sorted(used_dims) if d > 0] + [
        f"inner{d}" for d in sorted(used_dims) if d < rank - 1
    ]
    seed = ["seed = tl.load(SEED)"] if masks else []
    if masks:
        params.append(("SEED", "() int64 seed of the graph"))
        scalars.append("stream")
    params += [(s, "") for s in scalars + dims + ["N"]]
    spec = KernelSpec.of(
        "pointwise",
        mode=mode,
        region=region,
        philox=masks,
        params=tuple(params),
        body=tuple(seed + coords + body),
        **({"label": label} if label is not None else {}),
    )
    return spec, tuple(p for p, _ in params)


def what_of(node: Node) -> str:
    val = node.meta.get("val")
    return f"{node.name}: {val.dtype} in the trace" if isinstance(val, torch.Tensor) else node.name
