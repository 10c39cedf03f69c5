"""Stage 2, normalize: one spelling for each idea, so patterns state their math once.

Each rule is a small named function from a node to its replacement (or None). The stage applies all
rules until none fires and returns how often each fired.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from seqcompile import normalize_loss, normalize_math, normalize_nll, normalize_special
from seqcompile.fx_aliasing import written_through_a_view
from seqcompile.fx_utils import (
    RESHAPES,
    arg,
    erase_unused,
    grad_enabled_at,
    in_layout_of,
    insert_call,
    is_call,
    site_name,
    source_meta,
    tensor_val,
)
from seqcompile.report import CompileReport, Missed

aten = torch.ops.aten
Rewrite = Callable[[Node, "RuleContext"], Node | None]


@dataclasses.dataclass
class RuleContext:
    gm: GraphModule
    fake_mode: Any
    site: Node | None = None
    """The node being rewritten; new nodes inherit its source location."""
    notes: list[tuple[str, Missed]] = dataclasses.field(default_factory=list)
    """What the rules tell the report: ("rewritten", "refuted" or "missed", the site and what of
    it)."""
    checked: set[Node] = dataclasses.field(default_factory=set)
    """Nodes a rule's evaluation refuted, not read again."""

    def note(self, kind: str, rule: str, node: Node, text: str) -> None:
        self.notes.append((kind, Missed(site_name(node), rule, text)))

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        node = insert_call(self.gm.graph, self.fake_mode, target, args, kwargs)
        if self.site is not None:
            node.meta.update(source_meta(self.site))
        return node

    def size(self, x: Node, dim: int) -> Any:
        """`x`'s size along `dim` as an argument of a new op: the number where static, a
        `sym_size` node where symbolic (a raw SymInt is no argument a graph takes)."""
        size = tensor_val(x).shape[dim]
        return size if isinstance(size, int) else self.call(aten.sym_size.int, x, dim)


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    rewrite: Rewrite


def _drop_inactive_dropout(node: Node, ctx: RuleContext) -> Node | None:
    """`dropout(x, p=0)` and `dropout(x, train=False)` are `x`."""
    if is_call(node, aten.dropout.default):
        p, train = arg(node, 1, "p"), arg(node, 2, "train")
        if p == 0 or train is False:
            return node.args[0]
    return None


def _out_of_place(node: Node, ctx: RuleContext) -> Node | None:
    """An in-place op (`x.add_(y)`, `scores *= c`) on a value the graph made itself, that no view
    shares and no op writes through a view, becomes its out-of-place form, read by the op's
    readers and by every later reader of that value: the families and the region fuser then see
    plain math (an in-place op stops them). The result keeps the value's dtype, as the in-place op
    does."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_") or name in _KEPT_IN_PLACE:
        return None
    functional = getattr(getattr(aten, name[:-1], None), target._overloadname, None)
    value = node.args[0] if node.args else None
    if functional is None or not _fresh(value):
        return None
    if not grad_enabled_at(node) and _turns_grad_on(node.graph):
        return None  # under no_grad the in-place op keeps the value's history; a copy would not
    if any(_aliases(u) for u in value.users if u is not node) or written_through_a_view(value):
        return None  # a write through a view would stay on the value the copy replaces
    result = ctx.call(functional, *node.args, **node.kwargs)
    dtype = tensor_val(value).dtype
    if tensor_val(result) is None or tensor_val(result).shape != tensor_val(value).shape:
        node.graph.erase_node(result)
        return None
    if tensor_val(result).dtype != dtype:
        result = ctx.call(aten.to.dtype, result, dtype)
    result = in_layout_of(ctx, result, tensor_val(value))
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    for reader in list(value.users):
        if reader is not node and order[reader] > order[node]:
            reader.replace_input_with(value, result)
    return result


_KEPT_IN_PLACE = frozenset({"copy_"})
"""In-place ops whose out-of-place form autograd cannot differentiate (`aten.copy`)."""


def _turns_grad_on(graph: Any) -> bool:
    """Whether any value of the graph is made with grad mode on (a graph compiled under no_grad
    that never enables it has no history to keep)."""
    enables = any(
        n.op == "call_function" and n.target is torch._C._set_grad_enabled and n.args[0]
        for n in graph.nodes
    )
    return torch.is_grad_enabled() or enables


def _fresh(node: Any) -> bool:
    """A value an op of the graph made, not a view of another (nor an input)."""
    return (
        isinstance(node, Node)
        and node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and not _aliases(node)
        and isinstance(tensor_val(node), torch.Tensor)
    )


def _aliases(node: Node) -> bool:
    """Whether `node`'s result may share memory with an input (a view, an in-place op); an op
    that only may (`to` a dtype) is asked through the storages of the traced values."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    if all(r.alias_info is None for r in node.target._schema.returns):
        return False
    out = tensor_val(node)
    if out is None:
        return True
    storage = StorageWeakRef(out.untyped_storage())
    return any(
        StorageWeakRef(tensor_val(n).untyped_storage()) == storage
        for n in node.all_input_nodes
        if tensor_val(n) is not None
    )


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


def _one_cast_spelling(node: Node, ctx: RuleContext) -> Node | None:
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


def _cast_after_reshape(node: Node, ctx: RuleContext) -> Node | None:
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


def _div_by_constant(node: Node, ctx: RuleContext) -> Node | None:
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


def _square_as_pow(node: Node, ctx: RuleContext) -> Node | None:
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


def _rsqrt_spellings(node: Node, ctx: RuleContext) -> Node | None:
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


def _bmm_as_matmul(node: Node, ctx: RuleContext) -> Node | None:
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


def _einsum_as_matmul(node: Node, ctx: RuleContext) -> Node | None:
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


RULES: list[Rule] = [
    Rule("out_of_place", _out_of_place),
    Rule("drop_inactive_dropout", _drop_inactive_dropout),
    Rule("one_cast_spelling", _one_cast_spelling),
    Rule("cast_after_reshape", _cast_after_reshape),
    Rule("div_by_constant", _div_by_constant),
    Rule("square_as_pow", _square_as_pow),
    Rule("rsqrt_spellings", _rsqrt_spellings),
    Rule("mvlgamma_as_lgammas", normalize_special.mvlgamma_as_lgammas),
    Rule("frexp_parts", normalize_special.frexp_parts),
    Rule("bmm_as_matmul", _bmm_as_matmul),
    Rule("einsum_as_matmul", _einsum_as_matmul),
    Rule("math_written_out", normalize_math.written_out),
    Rule("softmax_of_shifted", normalize_math.softmax_of_shifted),
    Rule("negation_inside", normalize_nll.negation_inside),
    Rule("nll_rows_written_out", normalize_nll.rows_written_out),
    Rule("reduced_rows", normalize_nll.reduced_rows),
    Rule("nll_of_log_softmax", normalize_loss.nll_of_log_softmax),
    Rule("smoothed_nll_written_out", normalize_loss.smoothed_nll_written_out),
]


def normalize_graph(
    gm: GraphModule, fake_mode: Any, rules: list[Rule] = RULES, report: CompileReport | None = None
) -> Counter[str]:
    """Apply `rules` until none fires; returns how many times each one fired. What the rules
    read written out, or refuted, goes to `report`."""
    ctx = RuleContext(gm, fake_mode)
    fired: Counter[str] = Counter()
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            ctx.site = node
            for rule in rules:
                with gm.graph.inserting_before(node):
                    replacement = rule.rewrite(node, ctx)
                if replacement is None:
                    continue
                if isinstance(replacement, Node) and isinstance(tensor_val(node), torch.Tensor):
                    replacement = in_layout_of(ctx, replacement, tensor_val(node))
                node.replace_all_uses_with(replacement)
                erase_unused([node])
                fired[rule.name] += 1
                changed = True
                break
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    if report is not None:
        report.rewritten += [m for kind, m in ctx.notes if kind == "rewritten"]
        report.refuted += [m for kind, m in ctx.notes if kind == "refuted"]
        report.missed += [m for kind, m in ctx.notes if kind == "missed"]
    return fired
