"""A custom autograd.Function whose forward and own backward are element-wise is a pointwise
region: the kernels compute its forward and its backward as the user wrote it (traced through
the Function, not derived from the forward), joined with the ops around it. A Function that is
not element-wise, or has more than one output, runs as written, with the reason in the report."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion
from conftest import KERNELS_IN_SLOW_TIER


class StraightThrough(torch.autograd.Function):
    """Forward clamps; backward passes every gradient (the derivative of the clamp would zero
    it outside [-1, 1])."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1.0, 1.0)

    @staticmethod
    def backward(ctx, grad):
        return grad


class BloomGelu(torch.autograd.Function):
    """BLOOM's GeLUFunction: the tanh approximation, differentiated by hand."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        slope = (1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)
        return (0.5 * x * slope + 0.5 * (1 + tanh_out)) * grad


class RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x - x.sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx, grad):
        return grad - grad.sum(-1, keepdim=True)


class TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, a, b):
        return a * 2 + b * 3


def rand(*shape, seed=0):
    return (3 * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).requires_grad_()


@pytest.mark.parametrize("function", [StraightThrough, BloomGelu], ids=lambda f: f.__name__)
@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
@KERNELS_IN_SLOW_TIER
def test_an_element_wise_function_joins_a_region_with_its_own_backward(impl, function):
    def fn(x, b):
        return function.apply(x + b) * 2

    report = check_fusion(fn, [rand(4, 8), rand(8, seed=1)], counts={"pointwise": 1})
    assert report.counts["pointwise"] == 1


def test_the_backward_is_the_functions_not_the_forwards_derivative():
    """The straight-through gradient is 2 everywhere; the clamp's derivative would give 0 where
    |x + b| > 1 (the inputs are spread so that many are)."""
    x, b = rand(4, 8), rand(8, seed=1)
    compiled = torch.compile(lambda x, b: StraightThrough.apply(x + b) * 2, backend="seqfast")
    compiled(x, b).sum().backward()
    assert ((x.detach() + b.detach()).abs() > 1).any()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_a_function_alone_is_a_region_of_its_own():
    """In eager it is many ops each way; fused, one kernel each way."""
    check_fusion(lambda x: BloomGelu.apply(x), [rand(4, 8)], counts={"pointwise": 1})


@pytest.mark.parametrize(
    "function, why",
    [(RowSum, "aten.sum"), (TwoOutputs, "nothing inside it is fused")],
    ids=["not-element-wise", "two-outputs"],
)
def test_a_function_the_kernels_cannot_take_runs_as_written(function, why):
    def fn(x):
        out = function.apply(F.gelu(x))
        return out if isinstance(out, torch.Tensor) else out[0] + out[1]

    report = check_fusion(fn, [rand(4, 8)], counts={}, missed=["runs as written with its own"])
    (missed,) = report.missed
    assert why in missed.reason, missed


def test_a_function_and_the_plain_ops_of_its_forward_are_different_regions():
    """StraightThrough's forward traces to the clamp a plain region computes; the two regions'
    backwards differ, so they must not share a key (the first registered had served both)."""
    x = rand(4, 8)
    check_fusion(lambda x: StraightThrough.apply(x * 2) * 3, [x], counts={"pointwise": 1})
    check_fusion(lambda x: (x * 2).clamp(-1.0, 1.0) * 3, [x], counts={"pointwise": 1})
