"""Normalization rules that read math written out as the op it computes: softmax, log_softmax,
logsumexp, layer_norm and rms_norm spelled with reductions and element-wise ops become the aten
op, so the families fuse what follows from it.

Readers (`softmax_reads.py`, `norm_reads.py`) find a candidate loosely, by the reductions that
anchor the function:

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

import math

import torch
from torch.fx import Node

from seqcompile.fx.evaluate import Evaluator, Sizes, Unevaluated, size_at, traced_sizes
from seqcompile.fx.nodes import (
    barrier_between,
    node_order,
    tensor_val,
)
from seqcompile.normalize import norm_reads, softmax_reads
from seqcompile.normalize.candidate import Candidate
from seqcompile.normalize.context import RuleContext

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

READERS = (
    softmax_reads.softmax,
    softmax_reads.log_softmax,
    softmax_reads.logsumexp,
    norm_reads.norm,
)


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
