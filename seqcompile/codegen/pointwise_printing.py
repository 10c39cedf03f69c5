"""What the pointwise printer's rules share: a constant as Triton source, the kind a value is
computed as (floats in float32, or float64 where the graph holds float64), casts, and the rule
factories for a function of one or two floating operands."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node


class Unprintable(Exception):
    """A node the printer has no Triton spelling for; the message names it."""


def literal(value: Any) -> str:
    """A Python constant as Triton source."""
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


def kind(dtype: torch.dtype) -> str:
    """What a value of `dtype` is computed as: "bool", "int" or "float"."""
    if dtype is torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


TL_DTYPES = {
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


class Printer:
    """Casts in a kernel whose floats are computed as `float_type` (tl.float32, or tl.float64
    where the graph holds float64)."""

    def __init__(self, float_type: str) -> None:
        self.float_type = float_type

    def cast(self, x: str, dtype: torch.dtype) -> str:
        """`x` (computed as its kind) converted to `dtype`, rounded when `dtype` is a half type."""
        if dtype is torch.bool:
            return f"({x} != 0)"
        if dtype not in TL_DTYPES:
            raise Unprintable(f"cast to {dtype}")
        if dtype.is_floating_point:
            if dtype in (torch.float16, torch.bfloat16) or (
                dtype is torch.float32 and self.float_type == "tl.float64"
            ):
                return f"{x}.to({TL_DTYPES[dtype]}).to({self.float_type})"
            return f"{x}.to({self.float_type})"
        return f"{x}.to({TL_DTYPES[dtype]})"

    def as_float(self, x: str, node_arg: Any) -> str:
        """`x`, the value of `node_arg`, as a float where it is a boolean or an integer."""
        if isinstance(node_arg, Node) and kind(node_arg.meta["val"].dtype) != "float":
            return f"{x}.to({self.float_type})"
        return x


Rule = Callable[[Node, list[str], "Printer"], str]
"""A node's Triton expression from the node, its arguments' expressions and the printer."""


def in_dtype(value: Any, dtype: torch.dtype) -> str:
    """A constant as an op of `dtype` writes it: torch converts the scalar to the tensor's dtype
    (`masked_fill` of a boolean tensor with -inf writes True, of an integer one with -0.4 writes
    0)."""
    if isinstance(value, Node):
        raise Unprintable(f"constant {value} computed by the graph")
    return literal(torch.tensor(value, dtype=dtype).item())


def tensor_and_scalar(packet: Any, rule: Rule) -> dict[Any, Rule]:
    """One rule for an op's `Tensor` and `Scalar` overloads, which differ only in the operand."""
    return {packet.Tensor: rule, packet.Scalar: rule}


def unary(fn: str) -> Rule:
    """The rule that calls `fn` on the node's one operand, as a float."""
    return lambda node, a, p: f"{fn}({p.as_float(a[0], node.args[0])})"


def float_binary(fn: str) -> Rule:
    """A helper of two floating operands (integers refused: their rules differ)."""

    def rule(node: Node, a: list[str], p: Printer) -> str:
        if not node.meta["val"].dtype.is_floating_point:
            raise Unprintable(f"{node.target} of integers")
        return f"{fn}({p.as_float(a[0], node.args[0])}, {p.as_float(a[1], node.args[1])})"

    return rule


def signbit(x: str, p: Printer) -> str:
    """Whether `x`'s sign bit is set (-0.0 and NaNs of either sign included), by its bits."""
    bits = "tl.int64" if p.float_type == "tl.float64" else "tl.int32"
    return f"({x}.to({bits}, bitcast=True) < 0)"
