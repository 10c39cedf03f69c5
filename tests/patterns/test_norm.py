"""The residual + normalization family end to end: each spelling fuses, output and every gradient
match eager, and each near-miss is refused with its reason."""

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from checks import check_fusion, dumped_add_norms, dumped_fuse_stage

from seqcompile.demo import HandwrittenRMSNorm


def rand(*shape, dtype=torch.float32, grad=True):
    return torch.randn(shape, dtype=dtype).requires_grad_(grad)


class AddNorm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x, y):
        return self.norm(x + y)


@pytest.mark.parametrize(
    "norm",
    [
        nn.LayerNorm(32),
        nn.LayerNorm(32, elementwise_affine=False),
        nn.LayerNorm(32, bias=False),
        nn.RMSNorm(32),
        nn.RMSNorm(32, eps=1e-5, elementwise_affine=False),
        HandwrittenRMSNorm(32),
    ],
    ids=["layer", "layer-no-affine", "layer-no-bias", "rms", "rms-no-affine", "t5-by-hand"],
)
def test_norm_modules_of_a_sum(norm):
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    check_fusion(AddNorm(norm), [rand(2, 5, 32), rand(2, 5, 32)], counts={"norm": 1})


def test_functional_spellings():
    w, b = rand(32), rand(32)

    def fn(x, y, z):
        a = F.layer_norm(x + y, (32,), w, b, eps=1e-6)
        c = F.rms_norm(a + z, (32,), w)
        return F.rms_norm(c, [32], None, eps=1e-3)

    check_fusion(fn, [rand(3, 32), rand(3, 32), rand(3, 32)], counts={"norm": 3})


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_llama_style_handwritten_rms_norm(weight_dtype):
    weight = rand(32, dtype=weight_dtype)

    def fn(x, y):
        h = x + y
        dtype = h.dtype
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        return weight * h.to(dtype)

    check_fusion(fn, [rand(4, 32), rand(4, 32)], counts={"norm": 1}, dtype=weight_dtype)


def test_handwritten_rms_norm_with_other_spellings():
    """`x * x`, `/ sqrt(...)` and a mean over dim 1 of a 2-D tensor are the same idea."""

    def fn(x):
        return x / torch.sqrt((x.float() * x.float()).mean(1, keepdim=True) + 1e-6)

    check_fusion(fn, [rand(6, 32)], counts={"norm": 1})


class PostLN(nn.Module):
    """The LightSeq2 / BERT layer tail: LayerNorm(x + dropout(linear(h)))."""

    def __init__(self, d=32, p=0.0, bias_by_hand=False, branch_first=False):
        super().__init__()
        self.linear = nn.Linear(d, d, bias=not bias_by_hand)
        self.bias = nn.Parameter(torch.randn(d)) if bias_by_hand else None
        self.norm = nn.LayerNorm(d)
        self.p, self.branch_first = p, branch_first

    def forward(self, x, h):
        y = self.linear(h) if self.bias is None else h @ self.linear.weight.t() + self.bias
        y = F.dropout(y, self.p, self.training)
        return self.norm(y + x if self.branch_first else x + y)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"bias_by_hand": True}, {"branch_first": True}],
    ids=["linear-bias", "bias-add", "commuted"],
)
def test_post_ln_folds_bias_and_dropout_into_the_norm(kwargs, tmp_path):
    module = PostLN(**kwargs)
    check_fusion(
        module, [rand(2, 7, 32), rand(2, 7, 32)], counts={"norm": 1}, options={"dump_dir": tmp_path}
    )
    fused = next(tmp_path.glob("*/*_fuse.py")).read_text()
    # the bias add and the residual add both live inside the fused op now
    assert "aten.add" not in fused and "seqfast.add_norm" in fused
    if "bias_by_hand" not in kwargs:
        assert "aten.linear.default(arg2_1, arg0_1)" in fused.replace(" ", "").replace(",", ", ")


def test_post_ln_with_dropout_folds_dropout(tmp_path):
    module = PostLN(p=0.1).train()
    x, h = rand(2, 7, 32), rand(2, 7, 32)
    out = torch.compile(module, backend="seqfast", options={"dump_dir": tmp_path})(x, h)
    out.sum().backward()
    fused = next(tmp_path.glob("*/*_fuse.py")).read_text()
    assert "aten.dropout" not in fused and "aten.randint" in fused and "seqfast.add_norm" in fused
    backward = next(tmp_path.glob("*/*_lower_backward.py")).read_text()
    assert "seqfast.add_norm_backward" in backward and "native_dropout" not in backward


def test_pre_ln_sum_is_a_second_output(tmp_path):
    norm1, norm2 = nn.LayerNorm(32), nn.LayerNorm(32)
    lin = nn.Linear(32, 32)

    def block(x, y):
        s = x + y  # read by the norm and carried on to the next residual add
        t = s + lin(norm1(s))
        return norm2(t) * 2 + t

    check_fusion(
        block,
        [rand(3, 4, 32), rand(3, 4, 32)],
        counts={"norm": 2, "pointwise": 1},
        options={"dump_dir": tmp_path},
    )
    fused = next(tmp_path.glob("*/*_fuse.py")).read_text()
    # both residual sums come out of the fused ops; the final `* 2 + t` is a pointwise region
    assert "aten.add.Tensor" not in fused and fused.count("seqfast.pointwise.default(") == 1
    assert "add_norm_default[1]" in fused and "add_norm_default_1[1]" in fused


def test_embedding_sum_of_three():
    norm = nn.LayerNorm(32)

    def embed(a, b, c):
        return norm(a + b + c)

    check_fusion(embed, [rand(2, 6, 32), rand(2, 6, 32), rand(2, 6, 32)], counts={"norm": 1})


def test_broadcast_residual_normalizes_without_folding():
    norm = nn.LayerNorm(32)
    check_fusion(lambda x, pos: norm(x + pos), [rand(2, 6, 32), rand(6, 32)], counts={"norm": 1})


def test_mixed_precision_branch_and_residual():
    norm = nn.LayerNorm(32)
    check_fusion(
        lambda x, y: norm(x + y.float()).half(),
        [rand(2, 6, 32), rand(2, 6, 32, dtype=torch.float16)],
        counts={"norm": 1},
        dtype=torch.float16,
    )


def test_inference_graph_is_fused_too():
    module = PostLN().eval()
    with torch.no_grad():
        check_fusion(
            module, [rand(2, 5, 32, grad=False), rand(2, 5, 32, grad=False)], counts={"norm": 1}
        )


# ---------------------------------------------------------------------------------------------
# near-misses


def test_refuses_width_beyond_the_kernel():
    norm = nn.LayerNorm(20000)
    check_fusion(
        lambda x: norm(x),
        [rand(2, 20000)],
        counts={"norm": 0},
        missed=["normalized width 20000 > 16384"],
    )


def test_refuses_float64():
    norm = nn.LayerNorm(16).double()
    check_fusion(
        lambda x, y: norm(x + y),
        [rand(2, 16, dtype=torch.float64), rand(2, 16, dtype=torch.float64)],
        counts={"norm": 0},
        missed=["dtype torch.float64 is not supported"],
        dtype=torch.float64,
    )


def test_refuses_normalization_over_two_dims():
    norm = nn.LayerNorm((4, 8))
    rms = nn.RMSNorm((4, 8))

    def fn(x):
        return norm(x) + rms(x)

    check_fusion(
        fn,
        [rand(3, 4, 8)],
        counts={"norm": 0},
        missed=["over the last 2 dimensions", "over the last 2 dimensions"],
    )


def test_refuses_handwritten_rms_norm_over_another_dim():
    def fn(x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)

    check_fusion(fn, [rand(2, 3, 8)], counts={"norm": 0}, missed=["normalizes over dims [1]"])


def test_refuses_dropout_that_drops_everything():
    norm = nn.LayerNorm(8)

    def fn(x, y):
        return norm(x + F.dropout(y, 1.0, True))

    check_fusion(
        fn, [rand(2, 8), rand(2, 8)], counts={"norm": 0}, missed=["p=1.0 drops every element"]
    )


# ---------------------------------------------------------------------------------------------
# computation must not move across grad-mode switches or in-place ops


def test_sum_computed_under_no_grad_is_not_folded():
    w = rand(16)

    def fn(x, y):
        with torch.no_grad():
            s = x + y
        return F.layer_norm(s, (16,), w)

    check_fusion(fn, [rand(3, 16), rand(3, 16)], counts={"norm": 1})


def test_sum_read_under_no_grad_before_the_norm_is_not_folded():
    w = rand(16)

    def fn(x, y):
        s = x + y
        with torch.no_grad():
            t = s * 2
        return F.layer_norm(s, (16,), w), t

    check_fusion(fn, [rand(3, 16), rand(3, 16)], counts={"norm": 1})


def test_operand_mutated_between_the_add_and_the_norm_is_not_folded():
    def fn(x, y):
        t = y * 3
        s = x + t
        t.zero_()
        return F.layer_norm(s, (16,)), t

    check_fusion(fn, [rand(3, 16), rand(3, 16)], counts={"norm": 1})


def test_handwritten_rms_norm_spanning_a_grad_mode_switch_is_refused():
    def fn(x):
        variance = x.pow(2).mean(-1, keepdim=True)
        with torch.no_grad():
            scale = torch.rsqrt(variance + 1e-6)
        return x * scale

    check_fusion(
        fn, [rand(3, 16)], counts={"norm": 0}, missed=["grad mode, autocast or an in-place op"]
    )


@pytest.mark.parametrize("bias_shape", [(), (1,)], ids=["0d", "1"])
@pytest.mark.kernels("add_norm_fwd", "add_norm_bwd", "column_sum")
def test_linear_bias_that_is_not_a_row_vector_stays_in_the_linear(interpret, bias_shape):
    w, b = rand(16, 16), rand(*bias_shape)
    norm = nn.LayerNorm(16)

    def fn(x, h):
        return norm(x + F.linear(h, w, b))

    check_fusion(fn, [rand(3, 16), rand(3, 16)], counts={"norm": 1})


def test_one_dimensional_inputs():
    norm = nn.LayerNorm(24)
    check_fusion(lambda x, y: norm(x + y), [rand(24), rand(24)], counts={"norm": 1})


def test_llama_norm_with_narrowing_cast_keeps_the_weight_multiply_outside(tmp_path):
    """bf16 activations, float32 weight: eager rounds to bf16 before the weight multiply, which the
    kernel (rounding once, at the end) would not do; so only the normalization is fused, and it
    writes the bf16 the multiply reads (its one rounding is the cast's)."""
    weight = rand(32)

    def fn(x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return weight * h.to(torch.bfloat16)

    check_fusion(
        fn,
        [rand(4, 32, dtype=torch.bfloat16)],
        counts={"norm": 1},
        dtype=torch.bfloat16,
        options={"dump_dir": str(tmp_path)},
    )
    fused = next(tmp_path.glob("*/*_fuse.py")).read_text()
    assert "aten.mul.Tensor" in fused and "out_dtype = torch.bfloat16" in fused


# ---------------------------------------------------------------------------------------------
# reshapes between the residual sum and the norm (OPT's `(residual + x).view(shape)`)


class ReshapedPostLN(nn.Module):
    """OPT's feed-forward tail: the sum is flattened to rows (or a view), then normalized."""

    def __init__(self, d=32, p=0.0, view=False):
        super().__init__()
        self.linear, self.norm = nn.Linear(d, d), nn.LayerNorm(d)
        self.p, self.view = p, view

    def forward(self, x, h):
        s = x + F.dropout(self.linear(h), self.p, self.training)
        return self.norm(s.view(-1, 4, s.shape[-1]) if self.view else s.reshape(-1, s.shape[-1]))


@pytest.mark.parametrize("view", [False, True], ids=["reshape", "view"])
def test_sum_reshaped_before_the_norm_is_folded(view, tmp_path):
    check_fusion(
        ReshapedPostLN(view=view),
        [rand(2, 8, 32), rand(2, 8, 32)],
        counts={"norm": 1},
        options={"dump_dir": tmp_path},
    )
    assert dumped_add_norms(tmp_path) == [(True, 0.0)]


def test_dropout_on_a_reshaped_sum_is_folded(tmp_path):
    module = ReshapedPostLN(p=0.1).train()
    out = torch.compile(module, backend="seqfast", options={"dump_dir": tmp_path})(
        rand(2, 8, 32), rand(2, 8, 32)
    )
    assert out.shape == (16, 32)
    out.sum().backward()
    assert dumped_add_norms(tmp_path) == [(True, 0.1)]


def test_pre_ln_reshaped_sum_read_elsewhere_is_the_second_output(tmp_path):
    """The reshaped sum is the next residual (OPT's pre-LN feed-forward block)."""
    norm, lin = nn.LayerNorm(32), nn.Linear(32, 32)

    def block(x, y):
        r = (x + y).reshape(-1, 32)
        return lin(norm(r)) * r

    check_fusion(
        block, [rand(2, 4, 32), rand(2, 4, 32)], counts={"norm": 1}, options={"dump_dir": tmp_path}
    )
    fused = dumped_fuse_stage(tmp_path)
    assert "aten.add" not in fused and "add_norm_default[1]" in fused
    assert dumped_add_norms(tmp_path) == [(True, 0.0)]


@pytest.mark.parametrize("read", ["sum", "first-reshape"])
def test_sum_read_elsewhere_on_the_way_to_the_norm_is_the_second_output(read, tmp_path):
    norm = nn.LayerNorm(32)

    def fn(x, y):
        s = x + y
        rows = s.view(8, 32)
        return norm(rows.view(4, 2, 32)), (s if read == "sum" else rows) * 3

    check_fusion(
        fn, [rand(2, 4, 32), rand(2, 4, 32)], counts={"norm": 1}, options={"dump_dir": tmp_path}
    )
    fused = dumped_fuse_stage(tmp_path)
    assert "aten.add" not in fused and "add_norm_default[1]" in fused
    assert dumped_add_norms(tmp_path) == [(True, 0.0)]


def test_reshape_that_changes_the_rows_keeps_the_sum_outside(tmp_path):
    """Rows of 8 summed, rows of 32 normalized: the sum cannot be folded."""
    norm = nn.LayerNorm(32)
    check_fusion(
        lambda x, y: norm((x + y).reshape(2, 32)),
        [rand(2, 4, 8), rand(2, 4, 8)],
        counts={"norm": 1},
        options={"dump_dir": tmp_path},
    )
    assert "aten.add.Tensor" in dumped_fuse_stage(tmp_path)
    assert dumped_add_norms(tmp_path) == [(False, 0.0)]


@pytest.mark.parametrize("readers", ["one", "two"])
def test_a_norm_read_only_through_autocasts_cast_writes_that_dtype(tmp_path, readers):
    """Under bfloat16 autocast a LayerNorm's output is float32 and the matmuls after it cast it:
    the fused op writes bfloat16 itself (the same rounding, no cast between) and takes its
    gradient in bfloat16."""
    norm, first, second = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 8)

    def fn(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = norm(x + y)
            return first(h) if readers == "one" else (first(h), second(h))

    options = {"dump_dir": str(tmp_path)}
    inputs = [rand(3, 16), rand(3, 16)]
    check_fusion(fn, inputs, counts={"norm": 1}, options=options, dtype=torch.bfloat16)
    graph = dumped_fuse_stage(tmp_path)
    assert "out_dtype = torch.bfloat16" in graph
    (norm_out,) = re.findall(r"(getitem\w*): \"bf16\[3, 16\][^\n]*add_norm_default\[0\]", graph)
    assert not re.search(rf"to\.dtype\({norm_out}\b", graph)


def test_a_norm_also_read_in_its_own_dtype_keeps_it(tmp_path):
    norm, linear = nn.LayerNorm(16), nn.Linear(16, 16)

    def fn(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = norm(x + y)
            return linear(h), h.sum()

    options = {"dump_dir": str(tmp_path)}
    inputs = [rand(3, 16), rand(3, 16)]
    check_fusion(fn, inputs, counts={"norm": 1}, options=options, dtype=torch.bfloat16)
    assert "out_dtype = torch.float32" in dumped_fuse_stage(tmp_path)
