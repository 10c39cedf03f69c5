"""The pointwise region fuser through torch.compile: which regions fuse, that outputs and every
gradient match eager, where regions split and why, linear biases folded into regions, dropout in
the compiled path, and pointwise user patterns."""

import math

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion
from torch import nn

import seqcompile
from seqcompile.report import collecting


def leaf(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_()


class MLP(nn.Module):
    """GPT's MLP: bias + GELU between the projections, dropout + residual after."""

    def __init__(self, width=8, p=0.0, act=F.gelu):
        super().__init__()
        self.up, self.down, self.p, self.act = (
            nn.Linear(width, 4 * width),
            nn.Linear(4 * width, width),
            p,
            act,
        )

    def forward(self, x):
        return x + F.dropout(self.down(self.act(self.up(x))), self.p, self.training)


def test_bias_gelu_and_bias_residual_are_two_regions():
    torch.manual_seed(0)
    report = check_fusion(MLP(), [leaf(2, 5, 8)], counts={"pointwise": 2})
    # a forward each; only bias + GELU needs a backward kernel: the gradients of
    # bias + residual are the incoming gradient itself (summed over rows for the bias)
    assert len({k.source for k in report.kernels}) == 3
    # the backward launches bias + GELU's forward again: its output, down's input, is recomputed
    # from up's output (kept for GELU's backward) instead of being kept beside it
    forward = {k.source for k in report.kernels if k.direction == "forward"}
    backward = [k for k in report.kernels if k.direction == "backward"]
    assert len(backward) == 2 and len(forward & {k.source for k in backward}) == 1


def test_linear_bias_is_folded_into_the_region(tmp_path):
    torch.manual_seed(0)
    check_fusion(
        MLP(), [leaf(2, 5, 8)], counts={"pointwise": 2}, options={"dump_dir": str(tmp_path)}
    )
    fused = next(tmp_path.glob("*/*_fuse.py")).read_text()
    assert fused.count("aten.linear.default") == 2
    calls = [
        line.split("aten.linear.default(")[1]
        for line in fused.splitlines()
        if "aten.linear.default(" in line
    ]
    assert all(call.count(",") == 1 for call in calls), f"a linear kept its bias: {calls}"


def test_new_gelu_written_out_is_one_region():
    def new_gelu(x):
        return (
            0.5
            * x
            * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
        )

    check_fusion(new_gelu, [leaf(3, 16)], counts={"pointwise": 1})


@pytest.mark.parametrize("act", [F.silu, F.gelu], ids=["swiglu", "geglu"])
def test_gated_activations(act):
    torch.manual_seed(0)
    gate, up = nn.Linear(8, 16), nn.Linear(8, 16)

    def fn(x):
        return act(gate(x)) * up(x)

    check_fusion(fn, [leaf(2, 3, 8)], counts={"pointwise": 1})


def test_a_value_used_inside_and_outside_is_an_output():
    def fn(x, b):
        h = torch.sigmoid(x + b)
        return (h * 3).tanh(), h.sum(-1)

    check_fusion(fn, [leaf(4, 6), leaf(6, seed=1)], counts={"pointwise": 1})


def test_a_region_with_a_boolean_output_differentiates_its_floating_one():
    """A learned slope times key - query beside the mask `rel < 0`: autograd passes no gradient
    for the boolean output, and the backward kernel takes one term for the other."""

    def fn(rel, slope):
        shifted = rel + 1
        return torch.tanh(shifted * slope), shifted < 0

    check_fusion(fn, [leaf(4, 6), leaf(6, seed=1)], counts={"pointwise": 1})


def test_a_region_reading_a_value_made_under_no_grad():
    """The backward is planned, inside AOTAutograd's trace, for fewer inputs than the fuser
    planned it for."""

    def fn(x, y):
        total = x.sum()
        with torch.no_grad():
            weight = y.norm()
        return (total / 3.0) * weight

    check_fusion(fn, [leaf(5), leaf(5, seed=1)], counts={"pointwise": 1})


def test_masks_over_middle_dims_and_row_scalars():
    def fn(x, mask, scale):
        return torch.where(mask, F.relu(x) * scale, -x).exp()

    mask = torch.rand(2, 1, 5, 1) > 0.3
    check_fusion(fn, [leaf(2, 3, 5, 4), mask, leaf(2, 3, 5, 1, seed=1)], counts={"pointwise": 1})


def test_frexp_joins_the_region_around_it():
    """Both outputs of `frexp`, as normalize writes them, in the one region with their readers."""

    def fn(x):
        mantissa, exponent = torch.frexp(torch.tanh(x * 2) * 3)
        return mantissa.exp() * exponent

    check_fusion(fn, [leaf(4, 6)], counts={"pointwise": 1})


def test_an_unsupported_op_splits_the_region_with_its_reason():
    def fn(x):
        h = torch.tanh(x * 2) * 0.5 + 1
        return (h * torch.special.bessel_j0(h.detach())).exp() * 3

    report = check_fusion(
        fn, [leaf(4, 6)], counts={"pointwise": 2}, missed=["aten.special_bessel_j0.default"]
    )
    reason = report.missed[0].reason
    assert "has no Triton spelling in the pointwise printer; the region is split here" in reason


def test_a_region_read_before_it_ends_is_placed_before_the_read():
    """The matmul reads `h` ahead of the region's last ops; everything the region reads exists
    by then, so the fused call goes before the matmul."""

    def fn(x, w):
        h = torch.tanh(x) * 2
        m = h @ w
        return m, h.exp() + 1

    check_fusion(fn, [leaf(4, 6), leaf(6, 3, seed=1)], counts={"pointwise": 1})


def test_a_region_read_before_a_value_it_reads_is_made_is_split_at_the_read():
    """`r` is made after the matmul reads `h`: the ops before the read are one call, the ops
    after it another."""

    def fn(x, w, y):
        h = torch.tanh(x) * 2
        m = h @ w
        r = y.sum(-1, keepdim=True)
        return m, h.exp() * r + 1

    check_fusion(fn, [leaf(4, 6), leaf(6, 3, seed=1), leaf(4, 5, seed=2)], counts={"pointwise": 2})


def test_a_region_whose_parts_are_single_ops_is_refused_with_the_reason():
    def fn(x, w, y):
        h = torch.tanh(x)
        m = h @ w
        return m, h * y.sum(-1, keepdim=True)

    check_fusion(
        fn,
        [leaf(4, 6), leaf(6, 3, seed=1), leaf(4, 5, seed=2)],
        counts={"pointwise": 0},
        missed=["used before the region ends, ahead of a value the region reads"],
    )


def test_a_region_read_early_stays_on_its_side_of_a_grad_mode_switch():
    """The ops under no_grad are a region of their own: the call placed before the matmul holds
    only the ops made with grad, which keep their gradients."""

    def fn(x, w):
        h = torch.tanh(x) * 2
        m = h @ w
        g = h.exp() + 1
        with torch.no_grad():
            c = (h * 3).sigmoid()
        return m, g, g * c

    check_fusion(fn, [leaf(4, 6), leaf(6, 3, seed=1)], counts={"pointwise": 2})


def test_a_constant_raised_to_a_tensor_joins_the_region():
    """MPT's ALiBi slopes, `1 / 2 ** x`, and a base below one, with gradients."""

    def fn(x):
        return 1.0 / torch.pow(2, x * 0.5) + 0.7**x

    check_fusion(fn, [leaf(4, 6)], counts={"pointwise": 1})


def test_reductions_and_matmuls_end_regions():
    def fn(x, w):
        h = F.gelu(x * 2)
        return F.silu(h @ w) * 2 + h.mean(-1, keepdim=True)

    check_fusion(fn, [leaf(4, 6), leaf(6, 6, seed=1)], counts={"pointwise": 2})


def test_a_lone_op_is_left_to_the_executor():
    check_fusion(lambda x, y: x * y, [leaf(3), leaf(3, seed=1)], counts={"pointwise": 0})


@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
def test_fused_regions_run_their_kernels(interpret):
    torch.manual_seed(0)
    check_fusion(MLP(act=F.silu), [leaf(2, 3, 8)], counts={"pointwise": 2})


def test_dropout_in_the_compiled_step_keeps_its_statistics_and_masks():
    torch.manual_seed(0)
    model = MLP(width=16, p=0.25).train()
    x = leaf(8, 32, 16)
    with collecting() as report:
        out = torch.compile(model, backend="seqfast")(x)
    assert report.counts["pointwise"] == 2
    branch = out - x
    kept = branch != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.03
    # the output bias reaches the loss only through the kept elements, scaled by 1 / (1 - p):
    # its gradient counts, per column, what the forward kept
    (bias_grad,) = torch.autograd.grad(out, model.down.bias, torch.ones_like(out))
    torch.testing.assert_close(bias_grad, kept.sum((0, 1)).float() / 0.75)


def test_dropout_masks_repeat_under_manual_seed():
    model = MLP(width=8, p=0.5).train()
    compiled = torch.compile(model, backend="seqfast")
    x = leaf(4, 8)
    torch.manual_seed(3)
    a = compiled(x)
    torch.manual_seed(3)
    b = compiled(x)
    c = compiled(x)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dropout_backward_drops_where_the_forward_did():
    def fn(x):
        return F.dropout(x * 2, 0.4)

    x = torch.ones(64, 32, requires_grad=True)
    out = torch.compile(fn, backend="seqfast")(x)
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert torch.equal(grad != 0, out != 0)
    torch.testing.assert_close(grad[out != 0], torch.full_like(grad[out != 0], 2 / 0.6))


@pytest.fixture
def squared_relu_pattern():
    seqcompile.register_pattern("squared_relu", lambda x: F.relu(x) ** 2, [torch.randn(4, 8)])
    yield
    seqcompile.unregister_pattern("squared_relu")


@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
def test_a_pointwise_user_pattern_gets_generated_kernels(squared_relu_pattern, interpret):
    torch.manual_seed(0)
    report = check_fusion(
        MLP(act=lambda t: F.relu(t) ** 2),
        [leaf(2, 3, 8)],
        counts={"squared_relu": 1, "pointwise": 1},
    )
    assert "squared_relu" in str(report)


def test_a_user_pattern_that_is_not_pointwise_needs_a_replacement():
    with pytest.raises(ValueError, match="must be pointwise.*aten.sum"):
        seqcompile.register_pattern("row_sum", lambda x: x.sum(-1) * 2, [torch.randn(4, 8)])
    with pytest.raises(TypeError, match="replacement_fn="):
        seqcompile.register_pattern("old_order", F.relu, F.relu, [torch.randn(2)])


def test_a_region_over_transposed_inputs_keeps_their_layout_for_a_view_after_it():
    """Element-wise ops lay their result out like their inputs; a view after the region may rely
    on it (here it views the transposed-back result, contiguous only in that layout)."""
    x = torch.randn(2, 8, 5, requires_grad=True)

    def fn(x):
        y = F.gelu(x.transpose(1, 2)) * 2 + 1
        return y.transpose(1, 2).view(2, 40)

    check_fusion(fn, [x], counts={"pointwise": 1})
