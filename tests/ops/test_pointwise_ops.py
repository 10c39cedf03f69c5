"""Every element-wise ATen op with a derivative formula, alone in a region, forward and gradient,
on both paths, against the op run eagerly in float64. The ops are read from torch's own metadata
(the pointwise tag the fuser reads), their arguments from each op's schema, and each op's inputs
from where the op is defined: mixed signs where it is defined there, else (0.1, 0.9), else
(1.1, 3). (`frexp`, with its integer exponent, and `mvlgamma` run as normalize writes them, in
ops the kernels spell, as a region built from a function is normalized.)"""

import functools
import math
import warnings

import pytest
import torch

from seqcompile.patterns.pointwise_cut import region_of_function
from seqcompile.patterns.pointwise_ops import element_wise
from tests.ops.test_pointwise import check, run

aten = torch.ops.aten
_CONSTANTS = {"Scalar": 0.75, "int": 1, "float": 0.75, "bool": False}
_DOMAINS = [(-2.0, 2.0), (0.1, 0.9), (1.1, 3.0)]


def constant_arguments(op):
    """The op's positional arguments: each Tensor a slot (None), every other argument its
    default or a plain constant; None where the schema takes something else."""
    args = []
    for a in op._schema.arguments:
        kind = str(a.type)
        if kind == "Tensor":
            args.append(None)
        elif a.has_default_value():
            break
        elif kind in _CONSTANTS:
            args.append(_CONSTANTS[kind])
        else:
            return None
    return args if None in args else None


def _inputs(args, domain, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = domain
    count = args.count(None)
    return [
        (lo + (hi - lo) * torch.rand(3, 5, generator=g, dtype=torch.float64)).requires_grad_()
        for _ in range(count)
    ]


def _call(op, args):
    """The op, then a scale: a region's output is never its input (`clone`, `positive`), and
    an op whose gradient is the incoming one (`add`) still has a backward kernel."""

    def fn(*tensors):
        it = iter(tensors)
        out = op(*(next(it) if a is None else a for a in args))
        if not isinstance(out, torch.Tensor):
            return out
        return out * 1.5 if out.is_floating_point() else out

    return fn


def _sample(op):
    """(fn, args, float64 inputs) where the op is defined and differentiable; None where it
    has no derivative formula."""
    args = constant_arguments(op)
    if args is None:
        return None
    for domain in _DOMAINS:
        inputs = _inputs(args, domain, seed=0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = _call(op, args)(*inputs)
        except (RuntimeError, TypeError, NotImplementedError):
            return None
        outs = out if isinstance(out, tuple) else (out,)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            return None
        floating = [o for o in outs if o.is_floating_point()]
        if not floating or not all(o.requires_grad for o in floating):
            return None
        if all(torch.isfinite(o).all() for o in floating):
            break
    try:
        torch.autograd.grad(floating, inputs, [torch.ones_like(o) for o in floating])
    except (RuntimeError, NotImplementedError):
        return None  # no derivative formula
    return _call(op, args), inputs


def element_wise_ops():
    """Every ATen overload torch tags pointwise that the fuser reads as element-wise."""
    for name in dir(aten):
        packet = getattr(aten, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if element_wise(op) and torch.Tag.pointwise in op.tags:
                    yield op


def _differentiable():
    samples = {str(op): _sample(op) for op in element_wise_ops()}
    return {name: sample for name, sample in samples.items() if sample is not None}


DIFFERENTIABLE = _differentiable()


def test_the_sweep_covers_the_element_wise_ops_people_write():
    """The list is read from torch, so a filter that went wrong would shrink it silently."""
    assert len(DIFFERENTIABLE) >= 90
    for name in ("softplus", "ceil", "log1p", "expm1", "atan2", "erfinv", "lerp", "hypot"):
        assert any(key.startswith(f"aten.{name}.") for key in DIFFERENTIABLE), name


SPELLED = [
    pytest.param(name, marks=() if k % 5 == 0 else pytest.mark.slow)
    for k, name in enumerate(sorted(DIFFERENTIABLE))
]
"""Every op, a fifth of them in the default run."""


@pytest.mark.parametrize("name", SPELLED)
@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
def test_every_element_wise_op_alone(impl, name):
    fn, inputs = DIFFERENTIABLE[name]
    check(*run(fn, [t.detach().float().requires_grad_() for t in inputs]))


@pytest.mark.parametrize(
    "fn, dtype",
    [
        (lambda t: torch.where(t > 0, t, 0) * 3, torch.int64),
        (lambda t: t.masked_fill(t < 0, -0.4) + 2, torch.int64),
        (lambda t: (t * 40).to(torch.int8) + 100, torch.int32),  # wraps at int8's width
        (lambda t: t.bool().masked_fill(t == 1, float("-inf")).float() + 1, torch.int64),
        (lambda t: ((t > -3) + (t < 3)).float() * 2, torch.int64),  # a boolean sum is an or
    ],
    ids=["where-zero", "fill-truncated", "int8-wraps", "bool-filled", "bool-sum"],
)
@pytest.mark.kernels("pointwise:forward")
def test_integer_and_boolean_values_stay_in_their_dtype(impl, fn, dtype):
    """Each value is its op's dtype, as torch holds it: constants converted to it, integer sums
    wrapping at its width, a boolean filled with -inf True, a sum of booleans a boolean (Triton
    would promote them)."""
    x = torch.arange(-7, 8, dtype=dtype).view(3, 5)
    region = region_of_function(fn, [x])
    (out,) = torch.ops.seqfast.pointwise([x], None, 0, region.key)
    assert out.dtype == fn(x).dtype and torch.equal(out, fn(x))


@pytest.mark.parametrize(
    "fn",
    [
        lambda t: (t % 3) * 2 + 1,
        lambda t: (t % -3) * 2 + 1,
        lambda t: torch.fmod(t, 3) * 2 + 1,
        lambda t: torch.fmod(t, -3) * 2 + 1,
    ],
    ids=["remainder", "remainder-negative-divisor", "fmod", "fmod-negative-divisor"],
)
@pytest.mark.kernels("pointwise:forward")
def test_integer_remainders_take_torchs_signs(impl, fn):
    """The remainder takes the divisor's sign, fmod the dividend's (Triton's `%` truncates)."""
    x = torch.arange(-7, 8).view(3, 5)
    region = region_of_function(fn, [x])
    (out,) = torch.ops.seqfast.pointwise([x], None, 0, region.key)
    assert torch.equal(out, fn(x))


SPECIAL_VALUES = [
    -math.inf,
    -3.0,
    -1.0,
    -0.5,
    -0.0,
    0.0,
    0.5,
    1.0,
    2.5,
    3.0,
    1e30,
    math.inf,
    math.nan,
]


@pytest.mark.parametrize(
    "name",
    [
        "log1p", "expm1", "exp2", "log2", "log10", "atan", "asin", "acos", "tan", "sinh", "cosh",
        "asinh", "acosh", "atanh", "erfc", "erfinv", "lgamma", "digamma", "special.ndtri",
        "round", "trunc", "floor", "ceil", "special.erfcx", "special.log_ndtr", "i0",
        "special.i0e", "special.i1", "special.i1e",
    ],
)  # fmt: skip
@pytest.mark.kernels("pointwise:forward")
def test_the_written_functions_at_poles_infinities_signed_zeros_and_nan(impl, name):
    """The functions written from Triton's own give torch's values where their formulas could
    not: inf, NaN, -0.0, poles, the ends of their domains."""
    fn = functools.reduce(getattr, name.split("."), torch)
    x = torch.tensor(SPECIAL_VALUES)
    region = region_of_function(lambda t: fn(t) * 1.0, [x])
    (out,) = torch.ops.seqfast.pointwise([x], None, 0, region.key)
    expected = fn(x.double()).float()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5, equal_nan=True)


TAILS = {
    "erfc": [0.6, 3.0, 5.0, 9.0, -0.7, -4.0],
    "special.erfcx": [-3.0, 0.5, 3.9, 4.1, 30.0, 1e4],
    "special.log_ndtr": [-40.0, -12.0, -1.5, -0.5, 2.0, 6.0],
    "special.i0e": [0.01, 7.9, 8.1, 50.0, 1e5],
    "special.i1e": [-0.01, 7.9, 8.1, -50.0, 1e5],
    "i0": [0.01, 8.5, 60.0],
    "special.i1": [0.01, -8.5, 60.0],
}
"""Points where a value is small next to what a plain formula would subtract or multiply it by:
erfc(5) is 1.5e-12, where 1 - erf(5) rounds to 0."""


@pytest.mark.parametrize("name", sorted(TAILS))
@pytest.mark.kernels("pointwise:forward")
def test_special_functions_keep_their_relative_precision_in_the_tails(impl, name):
    fn = functools.reduce(getattr, name.split("."), torch)
    x = torch.tensor(TAILS[name])
    region = region_of_function(lambda t: fn(t) * 1.0, [x])
    (out,) = torch.ops.seqfast.pointwise([x], None, 0, region.key)
    torch.testing.assert_close(out.double(), fn(x.double()), rtol=1e-5, atol=0)


@pytest.mark.parametrize("order", [2, 3, 4])
@pytest.mark.kernels("pointwise:forward")
def test_polygamma_past_trigamma_at_poles_negative_and_large_values(impl, order):
    x = torch.tensor([-2.0, -1.5, -0.3, 0.0, 0.2, 1.0, 2.5, 30.0, 1e4, math.inf, math.nan])
    region = region_of_function(lambda t: torch.polygamma(order, t) * 1.0, [x])
    (out,) = torch.ops.seqfast.pointwise([x], None, 0, region.key)
    expected = torch.polygamma(order, x.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.kernels("pointwise:forward")
def test_nextafter_steps_the_bits_of_its_own_format(impl, dtype):
    x = torch.tensor([1.0, 1.0, -2.0, -2.0, 0.0, 0.0, 3.0, math.nan, math.inf], dtype=dtype)
    y = torch.tensor([2.0, 0.0, -3.0, 5.0, 1.0, -1.0, 3.0, 1.0, 0.0], dtype=dtype)
    region = region_of_function(lambda a, b: torch.nextafter(a, b), [x, y])
    (out,) = torch.ops.seqfast.pointwise([x, y], None, 0, region.key)
    expected = torch.nextafter(x, y)
    checked = ~expected.isnan()
    if impl == "kernels" and dtype == torch.bfloat16:
        # Triton's interpreter stores bfloat16 subnormals wrongly (a region's t * 1e-40 gives
        # 1.0e-39); the kernel's bits for them are checked in float32 and float16
        checked &= (expected == 0) | (expected.abs() >= torch.finfo(dtype).tiny)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[checked], expected[checked])


@pytest.mark.parametrize("p", [1, 3])
@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
def test_mvlgamma_at_poles_and_below_its_usual_domain(impl, p):
    """Eager takes every x (below (p - 1) / 2 too, poles inf), and so does its sum of lgammas."""
    x = torch.tensor([[0.6, 0.9, 1.0, 1.7], [2.5, 4.0, 7.3, 30.0]], requires_grad=True)
    check(*run(lambda t: torch.mvlgamma(t, p), [x]))


FREXP_VALUES = [0.0, -0.0, 1.0, 0.75, -3.0, 1.5, 2.0, 0.99999994, 4.0000005, 1e30, -1e-30]
FREXP_VALUES += [math.inf, -math.inf, math.nan, 1e-40, -5e-45, 2**-126, 3.4e38]
"""Zeros, powers of two and their neighbours (where `log2` rounds across one), the ends of the
range, subnormals, infinities and NaN."""


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64]
    + [pytest.param(d, marks=pytest.mark.slow) for d in (torch.float16, torch.bfloat16)],
    ids=str,
)
@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
def test_frexp_gives_torchs_bits_and_gradient(impl, dtype):
    x = torch.tensor(FREXP_VALUES, dtype=dtype)
    if dtype == torch.float64:
        x = torch.cat([x, torch.tensor([5e-324, 1e-310, 1.7e308, 1 - 2**-53], dtype=dtype)])
    x.requires_grad_()
    region = region_of_function(torch.frexp, [x])
    mantissa, exponent = torch.ops.seqfast.pointwise([x], None, 0, region.key)
    expected = torch.frexp(x.detach())
    checked = torch.ones(len(x), dtype=torch.bool)
    if impl == "kernels" and dtype == torch.bfloat16:
        # Triton's interpreter reads bfloat16 subnormals as 0 (float32 and float16 check them)
        checked = (x == 0) | (x.abs() >= torch.finfo(dtype).tiny)
    assert exponent.dtype == torch.int32
    assert torch.equal(exponent[checked], expected.exponent[checked])
    torch.testing.assert_close(
        mantissa[checked], expected.mantissa[checked], rtol=0, atol=0, equal_nan=True
    )
    cotangent = torch.linspace(-1, 1, len(x), dtype=dtype)
    (grad,) = torch.autograd.grad(mantissa, x, cotangent)
    (eager,) = torch.autograd.grad(torch.frexp(x)[0], x, cotangent)
    # torch computes 2 ** e in float32, an infinity at e >= 128, and gives 0 there
    same = checked & (expected.exponent < 128)
    assert not grad.isnan().any()
    torch.testing.assert_close(grad[same], eager[same], rtol=0, atol=0)
    divisor = expected.exponent.double().exp2()
    torch.testing.assert_close(grad[checked], (cotangent / divisor).to(dtype)[checked])
