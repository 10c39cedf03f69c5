"""Folding autograd's gradient sums into region backwards, on small backward graphs traced by hand:
which sums fold, which stay (a reader before the region's backward, mixed dtypes, a nested sum
read elsewhere), and that the rewritten graph computes what the original did."""

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from seqcompile.memory.gradient_sums import fold_gradient_sums
from seqcompile.ops.fused_op import Call
from seqcompile.ops.pointwise import region as regions
from seqcompile.patterns.pointwise_cut import region_of_function

SHAPE = (3, 5)
SEED = torch.tensor(1234, dtype=torch.int64)
BACKWARD = torch.ops.seqfast.pointwise_backward.default
ADD = torch.ops.aten.add.Tensor


def residual_region():
    """x + dropout(y): x's gradient passes through, y's is computed."""
    example = [torch.randn(SHAPE, requires_grad=True) for _ in range(2)]
    return region_of_function(lambda x, y: x + F.dropout(y, 0.1), example).key


def region_backward(key, grad, seed):
    plan = regions.backward_plan(key, (True, True), (1,), (False,))
    outputs = BACKWARD(
        [], [grad], seed, 0, key, [True, True], [1], [False], [0] * len(plan.computed)
    )
    return outputs[0]


def trace(fn, *inputs):
    return make_fx(fn, tracing_mode="fake")(*inputs)


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def inputs(*dtypes):
    return [torch.randn(SHAPE).to(d) for d in dtypes]


def test_a_sum_read_after_the_backward_folds_and_is_written():
    key = residual_region()

    def backward(a, c, seed):
        total = a + c
        return region_backward(key, total, seed), total * 3  # the residual's use of the sum

    gm = trace(backward, *inputs(torch.float32, torch.float32), SEED)
    args = [*inputs(torch.float32, torch.float32), SEED]
    expected = gm(*args)
    assert fold_gradient_sums(gm)
    assert not calls(gm, ADD)
    (call,) = calls(gm, BACKWARD)
    assert (Call.of(call)["grad_terms"], Call.of(call)["written"]) == ([2], [True])
    for got, want in zip(gm(*args), expected, strict=True):
        torch.testing.assert_close(got, want)


def test_nested_sums_fold_into_one_call():
    key = residual_region()

    def backward(a, c, d, seed):
        return region_backward(key, (a + c) + d, seed)

    gm = trace(backward, *inputs(torch.float32, torch.float32, torch.float32), SEED)
    args = [*inputs(torch.float32, torch.float32, torch.float32), SEED]
    expected = gm(*args)
    assert fold_gradient_sums(gm)
    (call,) = calls(gm, BACKWARD)
    assert (Call.of(call)["grad_terms"], Call.of(call)["written"]) == ([3], [False])
    assert not calls(gm, ADD)
    torch.testing.assert_close(gm(*args), expected)


def test_a_nested_sum_read_elsewhere_stays_one_term():
    key = residual_region()

    def backward(a, c, d, seed):
        inner = a + c
        return region_backward(key, inner + d, seed), inner

    gm = trace(backward, *inputs(torch.float32, torch.float32, torch.float32), SEED)
    assert fold_gradient_sums(gm)
    (call,) = calls(gm, BACKWARD)
    (inner,) = calls(gm, ADD)
    assert Call.of(call)["grads"][0] is inner and Call.of(call)["grad_terms"] == [2]


def test_sums_that_cannot_fold_stay():
    key = residual_region()

    def read_before(a, c, seed):
        total = a + c
        early = total * 3  # the sum is read before the region's backward runs
        return early, region_backward(key, total, seed)

    def mixed_dtypes(a, c, seed):
        return region_backward(key, a + c, seed)

    for fn, dtypes in [
        (read_before, (torch.float32, torch.float32)),
        (mixed_dtypes, (torch.float16, torch.float32)),
    ]:
        gm = trace(fn, *inputs(*dtypes), SEED)
        before = gm.code
        assert fold_gradient_sums(gm) == []
        assert gm.code == before
