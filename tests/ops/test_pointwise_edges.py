"""Every element-wise op the pointwise family takes, at the values where torch's float32 CPU
kernels may answer differently from machine to machine: infinities, NaN, signed zeros,
subnormals, the ends of the float32 range and of the ops' domains. For each op the test lists
torch's float32 answer (vectorized, and one element at a time) beside its float64 one on the
machine it runs on, and requires both of seqfast's paths (the reference, and the generated kernels)
to give the float64 one rounded to float32: the mathematical value, whatever torch's float32
kernels do here (`_agree` says how close). `pytest -s` prints the table where torch's float32
differs."""

import itertools
import math
import warnings

import pytest
import torch

from seqcompile.capture import trace_function
from seqcompile.patterns.pointwise_cut import region_of_function
from seqcompile.patterns.pointwise_ops import refusal
from tests.ops.test_pointwise_ops import constant_arguments, element_wise_ops

aten = torch.ops.aten
F32 = torch.finfo(torch.float32)
SUBNORMAL_MIN, SUBNORMAL_MAX = 2.0**-149, F32.tiny - 2.0**-149
EDGES = [
    -math.inf, -F32.max, -1e30, -103.5, -88.8, -2.0, -1.0, -F32.tiny, -SUBNORMAL_MAX,
    -SUBNORMAL_MIN, -0.0, 0.0, SUBNORMAL_MIN, SUBNORMAL_MAX, F32.tiny, 0.5, 1.0, 2.0, 88.7,
    88.8, 1e30, F32.max, math.inf, math.nan,
]  # fmt: skip
"""Unary ops take all of these; a binary op every pair of them."""
FEW_EDGES = [-math.inf, -1.0, -0.0, 0.0, SUBNORMAL_MIN, 1.0, F32.max, math.nan]
"""An op of three tensors takes every triple of these."""


def _points(arity: int) -> list[torch.Tensor]:
    values = EDGES if arity < 3 else FEW_EDGES
    columns = zip(*itertools.product(values, repeat=arity), strict=True)
    return [torch.tensor(c, dtype=torch.float32) for c in columns]


def _refusal(op, args, inputs) -> str | None:
    """Why the family does not take `op` at these arguments (None: it does)."""
    gm = trace_function(lambda *t: _apply(op, args, t), inputs, str(op))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    reasons = [r.reason for r in map(refusal, calls) if r is not None]
    return "; ".join(reasons) or None


def _ops() -> dict[str, tuple]:
    found = {}
    for op in element_wise_ops():
        args = constant_arguments(op)
        if args is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = _apply(op, args, _points(args.count(None)))
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        if not isinstance(out, torch.Tensor) or out.dtype not in (torch.float32, torch.bool):
            continue
        why = _refusal(op, args, _points(args.count(None)))
        if why is None:
            found[str(op)] = (op, args)
        else:
            REFUSED[str(op)] = why
    return found


def _apply(op, args, tensors):
    it = iter(tensors)
    out = op(*(next(it) if a is None else a for a in args))
    return out[0] if isinstance(out, tuple) else out


REFUSED: dict[str, str] = {}
"""The element-wise ops the family does not take (the region ends there), with the reason."""
OPS = _ops()


def test_the_edge_sweep_covers_the_ops_people_write():
    """The list is read from torch, so a filter that went wrong would shrink it silently."""
    assert len(OPS) >= 110, sorted(OPS)
    assert len(REFUSED) <= 40, REFUSED  # (special functions without a Triton spelling, mostly)
    for name in ("gelu", "erf", "tanh", "log1p", "expm1", "sigmoid", "pow", "atan2", "lgamma"):
        assert any(key.startswith(f"aten.{name}.") for key in OPS), name


OWN_FORMAT = {"aten.nextafter.default", "aten.nan_to_num.default"}
"""Ops their format defines (a step of its bits, its largest value): their float32 answer is the
mathematical one, where a float64 evaluation would step or fill a float64."""
TINY = 1e-30
"""Below this a value is small in itself, not a cancellation's residue next to 1: a path that
gives 0 there flushed it."""
NOT_FLOAT64 = {
    "aten.sinc.default": (
        lambda x: (x.abs() >= 2.0**24) & x.isfinite(),
        0.0,
        "every float32 from 2^24 is an integer, where sinc is 0; float64 rounds pi x to another",
    ),
    "aten.polygamma.default": (
        lambda x: x < 0,
        None,
        "below 0 torch's float64 series gives finite values at its poles (the negative integers)"
        " and is not the mathematical value between them",
    ),
}
"""Where torch's float64 answer is not the mathematical value: the points (a predicate of the
op's tensor arguments), the value there (None: not compared), and why."""


def _agree(actual: torch.Tensor, expected: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Elementwise: NaN where NaN, the same infinity, a zero of the same sign where the exact
    value (`exact`, before rounding to float32) is zero, no tiny value (below `TINY`) flushed to
    zero that float32 holds, and otherwise float32's rounding (1e-5 relative, or 1e-6 absolute
    where the value cancels to about 0); a subnormal, which has few bits, within a factor of two,
    and a value below the smallest subnormal as either neighbour (0 or that subnormal)."""
    if actual.dtype is torch.bool:
        return actual == expected
    a, e, x = actual.double(), expected.double(), exact.double()
    subnormal = (e != 0) & (e.abs() < F32.tiny)
    close = (a - e).abs() <= torch.where(subnormal, 0.5 * e.abs(), 1e-5 * e.abs() + 1e-6)
    flushed = (a == 0) & (x.abs() >= SUBNORMAL_MIN) & (x.abs() < TINY)
    zeros = (a == 0) & (e == 0)
    agree = torch.where(zeros, (a.signbit() == e.signbit()) | (x != 0), close & ~flushed)
    below = (x != 0) & (x.abs() < SUBNORMAL_MIN)
    agree |= below & ((a == 0) | (a == e))
    agree = torch.where(a.isinf() | e.isinf(), a == e, agree)
    return torch.where(a.isnan() | e.isnan(), a.isnan() & e.isnan(), agree)


def _expected(name, inputs, one_by_one, wide):
    """The mathematical value at each point (NaN-free mask of the points compared) and the
    exact value before rounding."""
    expected = (one_by_one if name in OWN_FORMAT else wide.to(one_by_one.dtype)).clone()
    exact = one_by_one if name in OWN_FORMAT else wide
    compared = torch.ones(len(expected), dtype=torch.bool)
    if name in NOT_FLOAT64:
        points, value, _ = NOT_FLOAT64[name]
        there = points(*inputs)
        if value is None:
            compared &= ~there
        else:
            expected[there] = value
            exact = torch.where(there, torch.full_like(exact, 1.0), exact)  # either sign
    return expected, exact, compared


def _table(name, inputs, rows, columns) -> str:
    lines = [f"{name}: " + " | ".join(["inputs", *columns])]
    for i in rows:
        point = ", ".join(f"{t[i].item():.9g}" for t in inputs)
        lines.append("  " + " | ".join([point, *(f"{c[i].item():.9g}" for c in columns.values())]))
    return "\n".join(lines)


def _cases() -> list:
    """Each op on the reference path, the one whose answer depends on the CPU; on the kernel path
    a fifth of them in the default run, the rest in the slow tier."""
    cases = []
    for k, name in enumerate(sorted(OPS)):
        kernel_marks = [pytest.mark.interpreter] + ([] if k % 5 == 0 else [pytest.mark.slow])
        cases.append(pytest.param(name, "reference", id=f"reference-{name}"))
        cases.append(pytest.param(name, "kernels", id=f"kernels-{name}", marks=kernel_marks))
    return cases


@pytest.mark.parametrize("name, impl", _cases(), indirect=["impl"])
@pytest.mark.kernels("pointwise:forward")
def test_every_element_wise_op_gives_its_float64_value_at_the_edges(impl, name):
    op, args = OPS[name]
    inputs = _points(args.count(None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vectorized = _apply(op, args, inputs)
        one_by_one = torch.cat(
            [_apply(op, args, [t[i : i + 1] for t in inputs]) for i in range(len(inputs[0]))]
        )
        wide = _apply(op, args, [t.double() for t in inputs])
    expected, exact, compared = _expected(name, inputs, one_by_one, wide)
    machine = compared & ~(
        _agree(vectorized, expected, exact) & _agree(one_by_one, expected, exact)
    )
    if machine.any():
        columns = {"float32": vectorized, "one element": one_by_one, "float64": wide}
        print(_table(name, inputs, machine.nonzero().flatten().tolist(), columns))

    scale = (lambda t: t) if vectorized.dtype is torch.bool else (lambda t: t * 1.0)
    region = region_of_function(lambda *t: scale(_apply(op, args, t)), inputs)
    (out,) = torch.ops.seqfast.pointwise(inputs, None, 0, region.key)
    wrong = compared & ~_agree(out, expected, exact)
    columns = {"seqfast": out, "expected": expected, "float32": vectorized}
    assert not wrong.any(), _table(name, inputs, wrong.nonzero().flatten().tolist()[:20], columns)
