"""Normalization rules that read math written out as the op it computes: softmax, log_softmax,
logsumexp, layer_norm and rms_norm spelled with reductions and element-wise ops become the aten
op, so the families fuse what follows from it.

A rule reads a candidate loosely, by the reductions that anchor the function:

- softmax: `exp(x - m) / sum(exp(x - m), d, keepdim=True)`, m any value computed from x alone
  (its max along d, with or without `where` guards);
- log_softmax: `y - log(sum(exp(y), d, keepdim=True))` and `y - logsumexp(y, d, keepdim=True)`,
  read from x where y is `x - m`;
- logsumexp: `m + log(sum(exp(x - m), d, keepdim))`, m from x alone (squeezed without keepdim);
- layer_norm: `(x - mean(x, dims, keepdim=True)) * rsqrt(v + eps)` (any variance v: `var`,
  `((x - mu) ** 2).mean`), then a weight and a bias over the normalized dims;
- rms_norm: `x * rsqrt(v + eps)` (v: `(x ** 2).mean`), then a weight.

Whether a candidate computes the op is then decided by evaluating it: its sub-graph runs on
random float64 inputs (at the traced shapes, or on a few rows of them where those are large)
against the op on the same inputs, within the traced dtype's tolerance, at three scales: plain,
shifted far from zero (a softmax or log-sum-exp without its max overflows there) and tiny (an
eps outside the square root shows there). Only a candidate that matches at all three is
rewritten; one that does not (a variance with Bessel's correction, a softmax over the wrong dim)
stays as written, with the largest difference in the report.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx_evaluate import Evaluator, Sizes, Unevaluated, size_at, traced_sizes
from seqcompile.fx_utils import (
    arg,
    barrier_between,
    is_call,
    node_order,
    only_user,
    rank_of,
    same_shape,
    tensor_val,
)

if TYPE_CHECKING:
    from seqcompile.normalize import RuleContext

aten = torch.ops.aten
_FULL_SHAPE_ELEMENTS = 1 << 18
"""Inputs up to this many elements are evaluated at their traced shapes; larger ones on a few
rows (every dim the op does not reduce cut to 3)."""
_SCALES = ((1.0, 0.0), (4.0, 1000.0), (1e-3, 0.0))
"""(scale, shift) of each evaluation's input x."""
_TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (2e-4, 2e-5),
    torch.float16: (2e-2, 2e-3),
    torch.bfloat16: (5e-2, 1e-2),
}
_MAX_DEPTH = 8
"""How many ops a value computed from x alone (the max a softmax subtracts) may take."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """`out` read as `op` of `operands` (x first; then a weight and a bias where it has them)."""

    op: str
    out: Node
    operands: tuple[Node, ...]
    reduced: tuple[int, ...]
    """The dims of x the op reduces over, kept whole when it is evaluated on a few rows."""
    compute: Callable[..., torch.Tensor]
    """The op on concrete operands."""
    build: Callable[[RuleContext], Node]
    """The op's call, inserted where the rule context inserts."""
    text: str
    """What the report says `out` was read as."""


def _from_only(value: Any, x: Node, depth: int = _MAX_DEPTH) -> bool:
    """Whether `value` is a node computed from `x` alone (constants aside), in a few ops."""
    if value is x:
        return True
    if not isinstance(value, Node) or value.op != "call_function" or depth == 0:
        return False
    inputs = value.all_input_nodes
    return bool(inputs) and all(_from_only(i, x, depth - 1) for i in inputs)


def _one_dim(node: Node, rank: int | None) -> int | None:
    dims = arg(node, 1, "dim")
    if rank is None or rank == 0:
        return None
    if isinstance(dims, int):
        return dims % rank
    if isinstance(dims, list | tuple) and len(dims) == 1 and isinstance(dims[0], int):
        return dims[0] % rank
    return None


def _shifted_input(y: Node, dim: int) -> Node | None:
    """x where `y` is `x - m`, m computed from x alone: the stable form's input."""
    if is_call(y, aten.sub.Tensor) and arg(y, 2, "alpha", 1) == 1:
        x, m = y.args[:2]
        if isinstance(x, Node) and _from_only(m, x):
            return x
    return None


def _exp_sum(s: Any, keepdim: bool | None = True) -> tuple[Node, int] | None:
    """(y, d) where `s` is `sum(exp(y), d)` (with `keepdim` where it is given)."""
    if not is_call(s, aten.sum.dim_IntList) or arg(s, 3, "dtype") is not None:
        return None
    e = s.args[0]
    if not is_call(e, aten.exp.default):
        return None
    if keepdim is not None and bool(arg(s, 2, "keepdim", False)) != keepdim:
        return None
    dim = _one_dim(s, rank_of(e))
    return None if dim is None else (e.args[0], dim)


def _softmax(node: Node) -> Candidate | None:
    """`exp(y) / sum(exp(y), d, keepdim=True)` (or times its reciprocal), y = x - m."""
    if is_call(node, aten.div.Tensor):
        e, s = node.args[:2]
    elif is_call(node, aten.mul.Tensor) and is_call(node.args[1], aten.reciprocal.default):
        e, s = node.args[0], node.args[1].args[0]
    else:
        return None
    found = _exp_sum(s)
    if not is_call(e, aten.exp.default) or found is None or s.args[0] is not e:
        return None
    y, dim = found
    return _along(node, _shifted_input(y, dim) or y, dim, torch.softmax, aten.softmax.int)


def _log_softmax(node: Node) -> Candidate | None:
    """`y - log(sum(exp(y), d, keepdim=True))` or `y - logsumexp(y, d, keepdim=True)`."""
    if not is_call(node, aten.sub.Tensor) or arg(node, 2, "alpha", 1) != 1:
        return None
    y, lse = node.args[:2]
    if is_call(lse, aten.log.default):
        found = _exp_sum(lse.args[0])
        if found is None or found[0] is not y:
            return None
        dim = found[1]
    elif is_call(lse, aten.logsumexp.default) and lse.args[0] is y and arg(lse, 2, "keepdim"):
        dim = _one_dim(lse, rank_of(y))
        if dim is None:
            return None
    else:
        return None
    x = _shifted_input(y, dim) or y
    return _along(node, x, dim, torch.log_softmax, aten.log_softmax.int)


def _along(node: Node, x: Node, dim: int, function: Callable, op: Any) -> Candidate:
    """`node` read as `function(x, dim)`, the aten `op`."""
    name = op.__name__.split(".")[0]
    return Candidate(
        name, node, (x,), (dim,),
        lambda t: function(t, dim),
        lambda ctx: ctx.call(op, x, dim),
        f"{name}({x.name}, dim={dim})",
    )  # fmt: skip


def _logsumexp(node: Node) -> Candidate | None:
    """`m + log(sum(exp(x - m), d, keepdim))`, m computed from x alone; or `log(sum(exp(x), d,
    keepdim))` where x is no such difference (evaluation refutes it: it overflows)."""
    found = None
    if is_call(node, aten.add.Tensor) and arg(node, 2, "alpha", 1) == 1:
        readings = (_shifted_log_sum(m, log) for m, log in _both_orders(node))
        found = next(filter(None, readings), None)
    elif is_call(node, aten.log.default):
        summed = _exp_sum(node.args[0], keepdim=None)
        if summed is not None and _shifted_input(*summed) is None:
            found = (*summed, bool(arg(node.args[0], 2, "keepdim", False)))
    if found is None:
        return None
    x, dim, keepdim = found
    return Candidate(
        "logsumexp", node, (x,), (dim,),
        lambda t: torch.logsumexp(t, dim, keepdim),
        lambda ctx: ctx.call(aten.logsumexp.default, x, [dim], keepdim),
        f"logsumexp({x.name}, dim={dim}, keepdim={keepdim})",
    )  # fmt: skip


def _both_orders(node: Node) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    return (node.args[0], node.args[1]), (node.args[1], node.args[0])


def _shifted_log_sum(m: Any, log: Any) -> tuple[Node, int, bool] | None:
    """(x, d, keepdim) where `log` is `log(sum(exp(x - m'), d, keepdim))`, and `m` and m' are
    computed from x alone."""
    if not is_call(log, aten.log.default):
        return None
    found = _exp_sum(log.args[0], keepdim=None)
    if found is None:
        return None
    x = _shifted_input(*found)
    if x is None or not _from_only(m, x):
        return None
    return x, found[1], bool(arg(log.args[0], 2, "keepdim", False))


_REDUCTIONS = (aten.mean.dim, aten.var.correction, aten.var.dim, aten.sum.dim_IntList)


def _reduced_dims(node: Any, rank: int, depth: int = _MAX_DEPTH) -> list[int] | None:
    """The dims of the first reduction found walking up from `node` (the variance's)."""
    if not isinstance(node, Node) or depth == 0:
        return None
    if is_call(node, *_REDUCTIONS):
        dims = arg(node, 1, "dim")
        if isinstance(dims, list | tuple) and all(isinstance(d, int) for d in dims):
            return sorted(d % rank for d in dims)
        return None
    for i in node.all_input_nodes:
        found = _reduced_dims(i, rank, depth - 1)
        if found is not None:
            return found
    return None


def _norm_parts(node: Any) -> tuple[Node, Node | None, Node | None] | None:
    """(core, weight, bias) where `node` is `core * weight + bias` (each optional, a bias only
    after a weight), the core `h * rsqrt(v + eps)`."""
    weight = bias = None
    if is_call(node, aten.add.Tensor) and arg(node, 2, "alpha", 1) == 1:
        node, bias = _vector_operand(node)
    if is_call(node, aten.mul.Tensor) and _rsqrt_operand(node) is None:
        node, weight = _vector_operand(node)
        if weight is None:
            return None
    if bias is not None and weight is None or _rsqrt_operand(node) is None:
        return None
    return node, weight, bias


def _vector_operand(node: Node) -> tuple[Any, Node | None]:
    """(the other operand, the vector) of a binary op one of whose operands is a vector over
    the last dims of the other; (None, None) where neither is."""
    out = tensor_val(node)
    for a, b in (node.args[:2], node.args[1::-1]):
        if rank_of(a) is not None and rank_of(b) is not None and same_shape(tensor_val(a), out):
            value = tensor_val(b)
            if value is not None and value.is_floating_point() and 0 < value.dim() < out.dim():
                if all(
                    statically_known_true(v == o)
                    for v, o in zip(value.shape, out.shape[out.dim() - value.dim() :], strict=True)
                ):
                    return a, b
    return None, None


def _rsqrt_operand(node: Any) -> Node | None:
    """The `rsqrt(v + eps)` factor of a product."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for a in node.args[:2]:
        if is_call(a, aten.rsqrt.default) and is_call(a.args[0], aten.add.Tensor):
            if arg(a.args[0], 2, "alpha", 1) == 1:
                return a
    return None


def _norm(node: Node) -> Candidate | str | None:
    """`h * rsqrt(v + eps)`: layer_norm where h is `x - mean(x, dims, keepdim=True)`, rms_norm
    where h is x; then a weight (and for layer_norm a bias) over the normalized dims. A product
    whose only reader extends it by a weight or bias is read from that reader."""
    parts = _norm_parts(node)
    if parts is None:
        return None
    extended = _norm_parts(only_user(node))
    if extended is not None and extended[0] is parts[0]:
        return None
    core, weight, bias = parts
    r = _rsqrt_operand(core)
    h = core.args[1] if core.args[0] is r else core.args[0]
    v, eps = r.args[0].args[:2]
    if isinstance(v, int | float):
        v, eps = eps, v
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not isinstance(v, Node):
        return None
    rank = rank_of(h)
    if rank is None:
        return None
    layer = is_call(h, aten.sub.Tensor) and is_call(h.args[1], aten.mean.dim)
    x = h.args[0] if layer else h
    if rank_of(x) != rank or layer and h.args[1].args[0] is not x or not layer and bias is not None:
        return None
    dims = _reduced_dims(h.args[1] if layer else v, rank)
    if dims is None or not _from_only(v, x):
        return None
    if dims != list(range(rank - len(dims), rank)):
        name = "layer_norm" if layer else "rms_norm"
        return f"{name} written out normalizes over dims {dims}; the norms take the last ones"
    shape = list(tensor_val(x).shape[rank - len(dims) :])
    if weight is not None and not all(
        statically_known_true(w == d) for w, d in zip(tensor_val(weight).shape, shape, strict=False)
    ):
        return None
    eps = float(eps)
    operands = tuple(n for n in (x, weight, bias) if n is not None)
    parts_text = f"{x.name}, {shape}" + "".join(f", {n.name}" for n in operands[1:])
    reduced = tuple(range(rank - len(dims), rank))
    if layer:
        return Candidate(
            "layer_norm", node, operands, reduced,
            lambda t, *wb: F.layer_norm(t, t.shape[reduced[0] :], *wb, eps=eps),
            lambda ctx: ctx.call(
                aten.layer_norm.default, x, [ctx.size(x, d) for d in reduced], weight, bias, eps
            ),
            f"layer_norm({parts_text}, eps={eps:g})",
        )  # fmt: skip
    return Candidate(
        "rms_norm", node, operands, reduced,
        lambda t, *w: F.rms_norm(t, t.shape[reduced[0] :], *w, eps=eps),
        lambda ctx: ctx.call(
            aten.rms_norm.default, x, [ctx.size(x, d) for d in reduced], weight, eps
        ),
        f"rms_norm({parts_text}, eps={eps:g})",
    )  # fmt: skip


READERS = (_softmax, _log_softmax, _logsumexp, _norm)


def _inputs(
    candidate: Candidate, scale: float, shift: float, rows: bool, seed: int, sizes: Sizes
) -> list:
    """Random float64 operands: x at `scale` and `shift` (its non-reduced dims cut to 3 with
    `rows`), weights and biases near 1 and 0."""
    g = torch.Generator().manual_seed(seed)
    values = []
    for k, node in enumerate(candidate.operands):
        shape = [size_at(s, sizes) for s in tensor_val(node).shape]
        if rows and k == 0:
            shape = [s if d in candidate.reduced else min(s, 3) for d, s in enumerate(shape)]
        t = torch.randn(shape, generator=g, dtype=torch.float64)
        values.append(t * scale + shift if k == 0 else t * 0.5 + (1.0 if k == 1 else 0.0))
    return values


def refutation(candidate: Candidate) -> str | None:
    """Why evaluating the candidate's code refutes that it computes its op (None: it does)."""
    x = tensor_val(candidate.operands[0])
    if x.dtype not in _TOLERANCES:
        return f"its input has dtype {x.dtype}"
    sizes = traced_sizes([candidate.out])
    try:
        elements = math.prod(size_at(s, sizes) for s in x.shape)
    except (TypeError, ValueError):
        return "its input's shape is not known"
    rows = elements > _FULL_SHAPE_ELEMENTS
    rtol, atol = _TOLERANCES[x.dtype]
    # both sides run in float64 (the code's own casts apply): the two differ by what they
    # compute, not by how each rounds
    for seed, (scale, shift) in enumerate(_SCALES):
        values = _inputs(candidate, scale, shift, rows, seed, sizes)
        given = dict(zip(candidate.operands, values, strict=True))
        got = Evaluator(given=given).value(candidate.out, sizes)
        if isinstance(got, Unevaluated):
            return f"its code could not be evaluated: {got.reason}"
        want = candidate.compute(*values)
        if got.shape != want.shape:
            return f"it gives shape {list(got.shape)}, {candidate.op} {list(want.shape)}"
        got, want = got.double(), want.double()
        both_nan = got.isnan() & want.isnan()
        same_inf = (got == want) & got.isinf()
        error = (got - want).abs().masked_fill(both_nan | same_inf, 0).nan_to_num(math.inf)
        bound = atol + rtol * want.abs().nan_to_num(0, 0, 0)
        if (error > bound).any():
            worst = float(error.max())
            return (
                f"evaluated on inputs of scale {scale:g} shifted by {shift:g}, it differs from"
                f" {candidate.op} by up to {worst:.3g}"
            )
    return None


def _spans_barrier(candidate: Candidate) -> bool:
    """Whether a barrier lies between the first node of the candidate's code and its output."""
    inside, stack = set(), [candidate.out]
    while stack:
        node = stack.pop()
        if node in inside or node in candidate.operands:
            continue
        inside.add(node)
        stack.extend(node.all_input_nodes)
    order = node_order(candidate.out.graph)
    return barrier_between(min(inside, key=order.__getitem__), candidate.out)


def written_out(node: Node, ctx: RuleContext) -> Node | None:
    """The op `node` computes, where a reader finds a candidate that its code confirms."""
    if node.op != "call_function" or not node.users or node in ctx.checked:
        return None
    if tensor_val(node) is None:
        return None  # (a node without readers is what an earlier rewrite left behind)
    for read in READERS:
        candidate = read(node)
        if candidate is None:
            continue
        if isinstance(candidate, str):
            ctx.checked.add(node)
            ctx.note("missed", "norm", node, candidate)
            return None
        if _spans_barrier(candidate):
            ctx.checked.add(node)
            why = "grad mode, autocast or an in-place op changes inside it"
            ctx.note("missed", candidate.op, node, f"not read as {candidate.op}: {why}")
            return None
        why = refutation(candidate)
        if why is not None:
            ctx.checked.add(node)
            ctx.note("refuted", candidate.op, node, f"not read as {candidate.op}: {why}")
            return None
        ctx.note("rewritten", candidate.op, node, f"read as {candidate.text}")
        replacement = candidate.build(ctx)
        dtype = tensor_val(node).dtype
        if tensor_val(replacement).dtype != dtype:
            replacement = ctx.call(aten.to.dtype, replacement, dtype)
        return replacement
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
