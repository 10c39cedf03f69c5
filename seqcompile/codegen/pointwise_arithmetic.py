"""The pointwise printer's rules for the ops IEEE arithmetic defines exactly: arithmetic,
comparisons, logic, casts and constants (each value held in its op's dtype), `where`, clamps,
rounding to integers, remainders, signs and the bits of a format (`nextafter`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from seqcompile.codegen.pointwise_printing import (
    Printer,
    Rule,
    Unprintable,
    float_binary,
    in_dtype,
    literal,
    signbit,
    tensor_and_scalar,
    unary,
)

aten = torch.ops.aten


def _alpha(node: Node) -> Any:
    return node.kwargs.get("alpha", 1)


def _scaled(b: str, alpha: Any) -> str:
    return b if alpha == 1 else f"{b} * {literal(alpha)}"


def _compare(op: str) -> Rule:
    return lambda node, a, p: f"({a[0]} {op} {a[1]})"


def _logical(op: str) -> Rule:
    return lambda node, a, p: f"(({a[0]} != 0) {op} ({a[1]} != 0))"


def _to_copy(node: Node, a: list[str], p: Printer) -> str:
    dtype = node.kwargs.get("dtype")
    return a[0] if dtype is None else p.cast(a[0], dtype)


def _constant(value_index: int) -> Rule:
    def rule(node: Node, a: list[str], p: Printer) -> str:
        value = node.args[value_index] if value_index >= 0 else -value_index - 1
        return in_dtype(value, node.meta["val"].dtype)

    return rule


def _masked_fill(node: Node, a: list[str], p: Printer) -> str:
    value = node.args[2]
    fill = a[2] if isinstance(value, Node) else in_dtype(value, node.meta["val"].dtype)
    return f"tl.where({a[1]}, {fill}, {a[0]})"


def _clamp(node: Node, a: list[str], p: Printer) -> str:
    lo, hi = (node.args + (None, None))[1:3]
    x = a[0]
    if lo is not None:
        x = f"tl.maximum({x}, {literal(lo)})"
    if hi is not None:
        x = f"tl.minimum({x}, {literal(hi)})"
    return x


def _rounding(fn: str) -> Rule:
    """floor, ceil, trunc and round: the identity on integers."""

    def rule(node: Node, a: list[str], p: Printer) -> str:
        if not node.meta["val"].dtype.is_floating_point:
            return a[0]
        if fn == "round":
            exact = "4503599627370496.0" if p.float_type == "tl.float64" else "8388608.0"
            return f"round_half_even({a[0]}, {exact})"
        return f"{fn}({a[0]})"

    return rule


def _quotient(node: Node, a: list[str], p: Printer) -> str:
    """`div(a, b, rounding_mode=...)`: the quotient truncated or floored."""
    mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
    if not node.meta["val"].dtype.is_floating_point:
        raise Unprintable(f"{node.target} of integers")
    q = f"({a[0]} / {a[1]})"
    return {"trunc": f"trunc({q})", "floor": f"tl.floor({q})"}.get(mode, q)


def _modulo(floored: bool) -> Rule:
    """fmod (the remainder of the truncated quotient) and remainder (of the floored one).
    Triton's `%` is C's: it truncates on integers and is fmod, exact, on floats; the floored
    remainder takes the divisor's sign."""

    def rule(node: Node, a: list[str], p: Printer) -> str:
        r = f"({a[0]} % {a[1]})"
        if not floored:
            return r
        return f"tl.where(({r} != 0) & (({r} < 0) != ({a[1]} < 0)), {r} + {a[1]}, {r})"

    return rule


def _negated(node: Node, a: list[str], p: Printer) -> str:
    """Triton's unary minus is 0 - x, which loses a zero's sign: floats are multiplied."""
    return f"({a[0]} * -1.0)" if node.meta["val"].dtype.is_floating_point else f"(-{a[0]})"


_BITS = {
    torch.float16: ("tl.float16", "tl.int16", 1),
    torch.bfloat16: ("tl.float32", "tl.int32", 1 << 16),
    torch.float32: ("tl.float32", "tl.int32", 1),
    torch.float64: ("tl.float64", "tl.int64", 1),
}
"""Each float format: the type its bits are stepped in, their integer type and one step (a
bfloat16 is the top half of a float32)."""


def _nextafter(node: Node, a: list[str], p: Printer) -> str:
    """A step of the value's bits in its own format (a half type's, not the float32 it is
    computed in)."""
    dtype = node.meta["val"].dtype
    if dtype not in _BITS:
        raise Unprintable(f"nextafter of {dtype}")
    float_type, bits, step = _BITS[dtype]
    x, y = (f"{v}.to({float_type})" for v in a[:2])
    return f"nextafter({x}, {y}, {bits}, {step}).to({p.float_type})"


def _clamp_tensor(node: Node, a: list[str], p: Printer) -> str:
    bounds = (list(node.args) + [None, None])[1:3]
    x = a[0]
    if bounds[0] is not None:
        x = f"tl.maximum({x}, {a[1]})"
    if bounds[1] is not None:
        x = f"tl.minimum({x}, {a[2]})"
    return x


RULES: dict[Any, Rule] = {
    **tensor_and_scalar(aten.add, lambda n, a, p: f"({a[0]} + {_scaled(a[1], _alpha(n))})"),
    **tensor_and_scalar(aten.sub, lambda n, a, p: f"({a[0]} - {_scaled(a[1], _alpha(n))})"),
    **tensor_and_scalar(aten.rsub, lambda n, a, p: f"({a[1]} - {_scaled(a[0], _alpha(n))})"),
    **tensor_and_scalar(aten.mul, lambda n, a, p: f"({a[0]} * {a[1]})"),
    **tensor_and_scalar(aten.div, lambda n, a, p: f"({p.as_float(a[0], n.args[0])} / {a[1]})"),
    aten.neg.default: _negated,
    aten.reciprocal.default: lambda n, a, p: f"(1.0 / {a[0]})",
    aten.where.self: lambda n, a, p: f"tl.where({a[0]}, {a[1]}, {a[2]})",
    **tensor_and_scalar(aten.masked_fill, _masked_fill),
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
    aten.abs.default: lambda n, a, p: f"tl.abs({a[0]})",
    aten.sgn.default: unary("sign"),
    aten.sign.default: unary("sign"),
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
    aten.floor.default: _rounding("tl.floor"),
    aten.ceil.default: _rounding("tl.ceil"),
    aten.trunc.default: _rounding("trunc"),
    aten.round.default: _rounding("round"),
    aten.nextafter.default: _nextafter,
    aten.fmax.default: float_binary("fmax"),
    aten.fmin.default: float_binary("fmin"),
    aten.copysign.Tensor: lambda n, a, p: (
        f"tl.where({signbit(p.as_float(a[1], n.args[1]), p)}, tl.abs({a[0]}) * -1.0,"
        f" tl.abs({a[0]}))"
    ),
    aten.div.Tensor_mode: _quotient,
    **tensor_and_scalar(aten.fmod, _modulo(floored=False)),
    **tensor_and_scalar(aten.remainder, _modulo(floored=True)),
    aten.isnan.default: lambda n, a, p: f"({a[0]} != {a[0]})",
    aten.isinf.default: lambda n, a, p: f'(tl.abs({a[0]}) == float("inf"))',
    aten.signbit.default: lambda n, a, p: signbit(p.as_float(a[0], n.args[0]), p),
    aten.angle.default: lambda n, a, p: (
        f"tl.where({a[0]} != {a[0]}, {a[0]}, tl.where({a[0]} < 0, 3.141592653589793, 0.0))"
    ),
    aten.clamp.Tensor: _clamp_tensor,
}
for _name, _op in (
    ("eq", "=="),
    ("ne", "!="),
    ("lt", "<"),
    ("le", "<="),
    ("gt", ">"),
    ("ge", ">="),
):
    RULES[getattr(aten, _name).Tensor] = _compare(_op)
    RULES[getattr(aten, _name).Scalar] = _compare(_op)

CONSTANT_RULES = frozenset(
    RULES[op]
    for op in (
        aten.scalar_tensor.default, aten.full_like.default, aten.zeros_like.default,
        aten.zeros.default, aten.ones_like.default, aten.full.default,
        aten._efficientzerotensor.default,
    )
)  # fmt: skip
"""The rules that print a literal, already the value the op's dtype holds (a literal has no
`.to`; Triton promotes it with what it meets)."""
