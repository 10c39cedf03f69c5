"""Batched products as `matmul`: `bmm` and `einsum` equations that are one product (with
unsqueezes and permutes around it)."""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from seqcompile.fx.nodes import arg, is_call
from seqcompile.normalize.context import RuleContext

aten = torch.ops.aten


def bmm_as_matmul(node: Node, ctx: RuleContext) -> Node | None:
    """`bmm(a, b)` is `matmul(a, b)` on 3-D operands; `baddbmm(c, a, b, beta, alpha)` is
    `matmul(a, b) * alpha + c * beta`, or without c where beta is 0 (baddbmm then ignores it,
    NaN included: Megatron-LM passes an uninitialized buffer)."""
    if is_call(node, aten.bmm.default):
        return ctx.call(aten.matmul.default, *node.args[:2])
    if is_call(node, aten.baddbmm.default):
        beta, alpha = arg(node, 3, "beta", 1), arg(node, 4, "alpha", 1)
        product = ctx.call(aten.matmul.default, node.args[1], node.args[2])
        if alpha != 1:
            product = ctx.call(aten.mul.Tensor, product, alpha)
        if beta == 0:
            return product
        added = node.args[0] if beta == 1 else ctx.call(aten.mul.Tensor, node.args[0], beta)
        return ctx.call(aten.add.Tensor, product, added)
    return None


def einsum_as_matmul(node: Node, ctx: RuleContext) -> Node | None:
    """A two-operand `einsum` that is a batched matrix product (one contracted letter, a free
    letter of each operand, batch letters in the output) becomes permutes around `matmul`, e.g.
    `bhqd,bhkd->bhqk` is `q @ k.transpose(-1, -2)`; a batch letter only one operand has is a
    size-1 dim of the other, which matmul broadcasts (grouped heads, `bhgid,bhjd->bhgij`)."""
    if not is_call(node, aten.einsum.default) or len(node.args[1]) != 2:
        return None
    plan = _einsum_plan(node.args[0])
    if plan is None:
        return None
    operands = node.args[1][::-1] if plan.swapped else node.args[1]
    a, b = (
        _unsqueezed(ctx, _permuted(ctx, operand, order), missing)
        for operand, (order, missing) in zip(operands, plan.operands, strict=True)
    )
    return _permuted(ctx, ctx.call(aten.matmul.default, a, b), plan.out_order)


@dataclasses.dataclass(frozen=True)
class EinsumPlan:
    operands: tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]
    """Per operand (after the swap): the permutation taking it to (its batch dims..., m, k) or
    (its batch dims..., k, n), and the batch positions where it gets a size-1 dim."""
    out_order: list[int]
    """The permutation taking the product (batch..., m, n) to the output's letter order."""
    swapped: bool
    """The operands swap places, so that the output's last free letter is n."""


def _einsum_plan(equation: str) -> EinsumPlan | None:
    """How `equation` is a batched matmul; None where it is not one: m and n are the last free
    letters of each operand in the output, every other output letter a batch dim."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    inputs, out = equation.split("->")
    if inputs.count(",") != 1:
        return None
    left, right = inputs.split(",")
    if any(len(set(s)) != len(s) for s in (left, right, out)):
        return None
    k = [c for c in left if c in right and c not in out]
    if len(k) != 1 or any(c not in out for c in left + right if c != k[0]):
        return None
    left_free = [c for c in out if c in left and c not in right]
    right_free = [c for c in out if c in right and c not in left]
    if not left_free or not right_free:
        return None
    m, n = left_free[-1], right_free[-1]
    swapped = out.index(m) > out.index(n)
    if swapped:
        left, right, m, n = right, left, n, m
    batch = [c for c in out if c not in (m, n)]

    def operand(letters: str, tail: list[str]) -> tuple[list[int], list[int]]:
        present = [c for c in batch if c in letters]
        missing = [i for i, c in enumerate(batch) if c not in letters]
        return [letters.index(c) for c in present + tail], missing

    product = batch + [m, n]
    return EinsumPlan(
        (operand(left, [m, k[0]]), operand(right, [k[0], n])),
        [product.index(c) for c in out],
        swapped,
    )


def _unsqueezed(ctx: RuleContext, node: Node, positions: list[int]) -> Node:
    for position in positions:
        node = ctx.call(aten.unsqueeze.default, node, position)
    return node


def _permuted(ctx: RuleContext, node: Node, order: list[int]) -> Node:
    if order == sorted(order):
        return node
    return ctx.call(aten.permute.default, node, order)
