"""Math written out fuses as the op it computes: softmax, log_softmax, logsumexp, LayerNorm and
RMSNorm spelled with reductions are read as the aten op (each reading confirmed by evaluating the
code, and named in the report), and the families fuse what follows; near-misses (a variance with
Bessel's correction, a softmax over another dim, a log-sum-exp without its max) are left as
written with the difference evaluation found. Also the attention spellings between the scores
and the values: a floor at the lowest finite value after the masks (XGLM), a clamp by a tensor
constant, copies of the probabilities, torch's `_safe_softmax`, a bias after a finfo.min mask.
Output and every gradient match eager, on both paths."""

import math

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion
from conftest import KERNELS_IN_SLOW_TIER

from seqcompile.report import collecting

B, H, L, D, WIDTH = 2, 2, 6, 8, 16
MIN = torch.finfo(torch.float32).min
ATTENTION_KERNELS = (
    "attention_fwd",
    "attention_bwd_delta",
    "attention_bwd_dkdv:with_dq",
)


def rand(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).requires_grad_(grad)


def qkv():
    return [rand(B, H, L, D, seed=i) for i in range(3)]


def keep_mask(every_row=True):
    keep = torch.rand(B, 1, L, L, generator=torch.Generator().manual_seed(5)) > 0.4
    if every_row:
        keep[..., 0] = True
    return keep


def scores(q, k):
    return q @ k.transpose(-1, -2) * D**-0.5


def read_as(report, op):
    return [m for m in report.rewritten if m.pattern == op]


# ---------------------------------------------------------------------------------------------
# softmax written out: attention


def softmax_amax(s):
    e = (s - s.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def softmax_max_detached(s):
    e = torch.exp(s - s.max(dim=-1, keepdim=True).values.detach())
    return e / e.sum(dim=-1, keepdim=True)


def softmax_guarded(s):
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "softmax", [softmax_amax, softmax_max_detached, softmax_guarded], ids=lambda f: f.__name__
)
@pytest.mark.kernels(*ATTENTION_KERNELS)
@KERNELS_IN_SLOW_TIER
def test_a_softmax_written_out_is_attention(impl, softmax):
    keep = keep_mask()

    def fn(q, k, v):
        return softmax(scores(q, k).masked_fill(~keep, -math.inf)) @ v

    report = check_fusion(fn, qkv(), counts={"attention": 1})
    assert len(read_as(report, "softmax")) == 1, report


@pytest.mark.parametrize(
    "near_miss, why",
    [
        (lambda s: (e := (s - s.amax(-2, keepdim=True)).exp()) / e.sum(-1, keepdim=True), "by up"),
        (lambda s: (e := s.exp()) / e.sum(-1, keepdim=True), "shifted by 1000"),
    ],
    ids=["max-over-queries", "no-max"],
)
def test_a_softmax_near_miss_stays_as_written_with_the_reason(near_miss, why):
    """A max over the queries does not cancel; without a max, the sum overflows far from zero."""
    report = check_fusion(lambda q, k, v: near_miss(scores(q, k)) @ v, qkv(), counts={})
    assert not read_as(report, "softmax") and report.counts["attention"] == 0
    (refuted,) = [m for m in report.refuted if m.pattern == "softmax"]
    assert "not read as softmax" in refuted.reason and why in refuted.reason, refuted


# ---------------------------------------------------------------------------------------------
# norms written out


def layer_norm_var(x, w, b):
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    return (x - mu) / torch.sqrt(var + 1e-5) * w + b


def layer_norm_squares(x, w, b):
    """Older GPT code: the centred squares averaged, eps inside the square root."""
    mu = x.mean(-1, keepdim=True)
    centred = x - mu
    return w * (centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6)) + b


def cohere_layer_norm(x, w, b):
    """CohereLayerNorm: in float32, a weight and no bias."""
    dtype = x.dtype
    x = x.to(torch.float32)
    mean = x.mean(-1, keepdim=True)
    variance = (x - mean).pow(2).mean(-1, keepdim=True)
    x = (x - mean) * torch.rsqrt(variance + 1e-5)
    return (w.to(torch.float32) * x).to(dtype)


def rms_norm_written(x, w, b):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


@pytest.mark.parametrize(
    "norm, op",
    [
        (layer_norm_var, "layer_norm"),
        (layer_norm_squares, "layer_norm"),
        (cohere_layer_norm, "layer_norm"),
        (rms_norm_written, "rms_norm"),
    ],
    ids=["var", "squares", "cohere", "rms"],
)
@pytest.mark.kernels("add_norm_fwd", "add_norm_bwd")
@KERNELS_IN_SLOW_TIER
def test_a_norm_written_out_is_a_norm_of_the_sum(impl, norm, op):
    w, b = rand(WIDTH, seed=3), rand(WIDTH, seed=4)

    def fn(x, r):
        return norm(x + r, w, b)

    report = check_fusion(fn, [rand(3, 5, WIDTH), rand(3, 5, WIDTH, seed=1)], counts={"norm": 1})
    assert len(read_as(report, op)) == 1, report


@pytest.mark.parametrize(
    "near_miss, why",
    [
        (lambda x: (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5),
         "scale 1"),
        (lambda x: (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5), None),
        (lambda x: (x - (m := x.mean(-1, keepdim=True))) * torch.rsqrt(
            (x - m).pow(2).mean(-1, keepdim=True) + 1e-2), "scale 0.001"),
    ],
    ids=["bessel", "eps-outside", "eps-as-written"],
)  # fmt: skip
def test_a_norm_near_miss_stays_as_written(near_miss, why):
    """Bessel's correction differs everywhere; an eps outside the root has no rsqrt to anchor on.
    The third is LayerNorm with eps 1e-2, read as that (its eps is the one written)."""
    report = check_fusion(near_miss, [rand(4, WIDTH)], counts={})
    if why is None:
        assert not report.rewritten and not report.refuted and report.counts["norm"] == 0
    elif why == "scale 0.001":
        (read,) = read_as(report, "layer_norm")
        assert "eps=0.01" in read.reason and report.counts["norm"] == 1
    else:
        assert report.counts["norm"] == 0
        (refuted,) = report.refuted
        assert refuted.pattern == "layer_norm" and why in refuted.reason, refuted


def test_a_norm_written_over_another_dim_is_refused_with_the_reason():
    def fn(x):
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)

    check_fusion(fn, [rand(2, 3, 8)], counts={"norm": 0}, missed=["normalizes over dims [1]"])


# ---------------------------------------------------------------------------------------------
# log-sum-exp and log-softmax written out, and the losses they make


def test_log_sum_exp_written_out_is_logsumexp():
    def fn(x):
        m = x.amax(-1, keepdim=True)
        return m.squeeze(-1) + (x - m).exp().sum(-1).log()

    report = check_fusion(fn, [rand(4, 7)], counts={})
    (read,) = read_as(report, "logsumexp")
    assert "keepdim=False" in read.reason


def test_log_sum_exp_without_its_max_stays_as_written():
    report = check_fusion(lambda x: x.exp().sum(-1).log(), [rand(4, 7)], counts={})
    assert not report.rewritten
    (refuted,) = report.refuted
    assert refuted.pattern == "logsumexp" and "shifted by 1000" in refuted.reason


@pytest.mark.kernels("cross_entropy:forward", "cross_entropy:backward")
def test_log_softmax_written_out_under_nll_is_the_loss(impl):
    def fn(x, t):
        y = x - x.amax(-1, keepdim=True).detach()
        return F.nll_loss(y - y.exp().sum(-1, keepdim=True).log(), t)

    target = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(2))
    report = check_fusion(fn, [rand(6, 11), target], counts={"loss": 1})
    assert len(read_as(report, "log_softmax")) == 1


def test_the_report_names_what_it_read():
    x = rand(3, 5)
    with collecting() as report:
        torch.compile(lambda x: (e := x.exp()) / e.sum(-1, keepdim=True), backend="seqfast")(x)
    text = str(report)
    assert "readings refuted by evaluating the model's code" in text
    assert "not read as softmax" in text


# ---------------------------------------------------------------------------------------------
# attention as the last spellings write it


@pytest.mark.kernels(*ATTENTION_KERNELS)
@KERNELS_IN_SLOW_TIER
def test_a_floor_at_the_lowest_finite_value_after_the_mask(impl):
    """XGLM: `torch.max(scores + mask, finfo.min)`; the -inf the mask fills becomes finfo.min."""
    keep = keep_mask()
    bias = torch.zeros(B, 1, L, L).masked_fill(~keep, MIN)

    def fn(q, k, v):
        s = scores(q, k) + bias
        return torch.softmax(torch.max(s, torch.full((), MIN)), -1) @ v

    check_fusion(fn, qkv(), counts={"attention": 1})


@pytest.mark.kernels(*ATTENTION_KERNELS)
@KERNELS_IN_SLOW_TIER
def test_a_clamp_by_a_tensor_constant_is_a_score_modification(impl):
    def fn(q, k, v):
        return torch.softmax(torch.max(scores(q, k), torch.tensor(-0.5)), -1) @ v

    check_fusion(fn, qkv(), counts={"attention": 1})


@pytest.mark.parametrize("copy", ["clone", "contiguous", "clone-channels-last"])
@pytest.mark.kernels(*ATTENTION_KERNELS)
@KERNELS_IN_SLOW_TIER
def test_copies_of_the_probabilities_pass_through(impl, copy):
    copies = {
        "clone": torch.clone,
        "contiguous": torch.Tensor.contiguous,
        "clone-channels-last": lambda p: p.clone(memory_format=torch.channels_last),
    }

    def fn(q, k, v):
        return copies[copy](torch.softmax(scores(q, k), -1)) @ v

    check_fusion(fn, qkv(), counts={"attention": 1})


@pytest.mark.kernels(*ATTENTION_KERNELS)
@KERNELS_IN_SLOW_TIER
def test_safe_softmax_gives_zeros_for_rows_with_every_key_masked(impl):
    keep = keep_mask(every_row=False)
    keep[0, 0, 2] = False  # one row keeps nothing

    def fn(q, k, v):
        s = scores(q, k).masked_fill(~keep, -math.inf)
        return torch.ops.aten._safe_softmax(s, -1) @ v

    check_fusion(fn, qkv(), counts={"attention": 1})


@pytest.mark.kernels(*ATTENTION_KERNELS)
@KERNELS_IN_SLOW_TIER
def test_a_bias_added_after_a_mask_filled_with_finfo_min(impl):
    keep = keep_mask()
    bias = rand(1, H, L, L, seed=7)

    def fn(q, k, v, bias):
        return torch.softmax(scores(q, k).masked_fill(~keep, MIN) + bias, -1) @ v

    check_fusion(fn, [*qkv(), bias], counts={"attention": 1})


# ---------------------------------------------------------------------------------------------
# cross-entropy written out per row, and the report where logits stay apart from their linear

V = 11


def targets(shape=(2, 5), seed=2):
    t = torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[1] = 0  # one padding token
    return t


def ce_neg_mean(x, t):
    return -(F.log_softmax(x, -1).gather(-1, t[..., None]).squeeze(-1)).mean()


def ce_masked_mean(x, t):
    rows = torch.logsumexp(x, -1) - x.gather(-1, t.unsqueeze(-1)).squeeze(-1)
    keep = (t != 0).float()
    return (rows * keep).sum() / keep.sum()


def ce_log_sum_exp_written(x, t):
    m = x.amax(-1, keepdim=True)
    lse = (x - m).exp().sum(-1, keepdim=True).log() + m
    return (lse - x.gather(-1, t[..., None])).sum()


@pytest.mark.parametrize(
    "loss", [ce_neg_mean, ce_masked_mean, ce_log_sum_exp_written], ids=lambda f: f.__name__
)
@pytest.mark.kernels("cross_entropy:forward", "cross_entropy:backward")
@KERNELS_IN_SLOW_TIER
def test_a_cross_entropy_written_out_is_the_loss(impl, loss):
    report = check_fusion(loss, [rand(2, 5, V), targets()], counts={"loss": 1})
    assert len(read_as(report, "cross_entropy")) == 1, report


def test_a_linear_before_a_written_out_cross_entropy_joins_it():
    """The mean read as the loss's own reduction lets the linear join: the logits are never
    built (the joined op's kernel computes the loss and its gradient per chunk)."""
    w = rand(V, 8, seed=3)

    def fn(h, t):
        return ce_neg_mean(h @ w.T, t)

    report = check_fusion(fn, [rand(2, 5, 8), targets()], counts={"loss": 1})
    assert [dict(k.key)["mode"] for k in report.kernels] == ["forward_grad"], report


@pytest.mark.parametrize(
    "near_miss, x, t",
    [
        (lambda x, t: -(torch.softmax(x, -1).gather(-1, t[..., None]).log()).mean(),
         rand(6, V), targets((6,))),
        (lambda x, t: -(F.log_softmax(x, 1).gather(1, t[:, None]).squeeze(1)).mean(),
         rand(5, 4, V), targets((5, V)).clamp(max=3)),
    ],
    ids=["log-after-gather", "classes-not-last"],
)  # fmt: skip
def test_a_cross_entropy_near_miss_is_not_read(near_miss, x, t):
    """A log of the gathered probabilities underflows where the loss does not; log-probabilities
    over another dim than the last are not read as the loss. The report says so."""
    report = check_fusion(
        near_miss, [x, t], counts={"loss": 0}, missed=["reaches the loss but is no cross-entropy"]
    )
    assert not read_as(report, "cross_entropy")


def test_logits_scaled_after_their_linear_join_the_loss_in_chunks():
    w = rand(V, 8, seed=3)

    def fn(h, t):
        return F.cross_entropy((h @ w.T * 0.5).flatten(0, 1), t.flatten())

    report = check_fusion(fn, [rand(2, 5, 8), targets()], counts={"loss": 1})
    assert any("linear_row_loss" in site for site in report.sites), report.sites


def soft_targets(x, p):
    """The loss under mixup: probability targets against the log-probabilities."""
    return torch.sum(-p * F.log_softmax(x, dim=-1), dim=-1).mean()


@pytest.mark.kernels("soft_cross_entropy:forward", "soft_cross_entropy:backward")
def test_soft_targets_written_out_are_the_loss_against_probabilities(impl):
    p = torch.softmax(rand(6, V, seed=8, grad=False), -1)
    report = check_fusion(soft_targets, [rand(6, V), p], counts={"loss": 1})
    (read,) = read_as(report, "cross_entropy")
    assert "against probability targets" in read.reason


def label_smoothing_as_a_mean(x, t):
    """As timm writes it: the smoothing term is the mean of -log p over the classes."""
    lp = F.log_softmax(x, dim=-1)
    nll = -lp.gather(dim=-1, index=t.unsqueeze(1)).squeeze(1)
    smooth = -lp.mean(dim=-1)
    return (0.9 * nll + 0.1 * smooth).mean()


@pytest.mark.kernels("cross_entropy:forward", "cross_entropy:backward")
def test_label_smoothing_written_as_a_mean_over_classes(impl):
    report = check_fusion(
        label_smoothing_as_a_mean, [rand(6, V), targets((6,))], counts={"loss": 1}
    )
    (read,) = read_as(report, "cross_entropy")
    assert "label smoothing 0.1" in read.reason


def test_weights_that_are_no_label_smoothing_stay_as_written():
    """1.5 * nll - 0.5 * smooth would be smoothing -0.5: no loss torch has."""

    def fn(x, t):
        lp = F.log_softmax(x, dim=-1)
        nll = -lp.gather(dim=-1, index=t.unsqueeze(1)).squeeze(1)
        return (1.5 * nll + 0.5 * lp.mean(dim=-1)).mean()

    report = check_fusion(
        fn, [rand(6, V), targets((6,))], counts={"loss": 0},
        missed=["log_softmax reaches the loss but is no cross-entropy"],
    )  # fmt: skip
    assert not read_as(report, "cross_entropy")


@pytest.mark.parametrize("dynamic", [None, True], ids=["length", "every-size"])
def test_a_norm_written_out_in_a_dynamic_graph_is_read_without_fixing_its_sizes(dynamic):
    """Evaluated at the sizes' hints, not by reading them (which would guard on them): a second
    length runs the same graph. Where every size is symbolic the width is passed to the norm as
    the graph's size, and the norm family, which takes no symbolic width, refuses it."""
    w, b = rand(WIDTH, seed=3), rand(WIDTH, seed=4)
    compiled = torch.compile(lambda x: layer_norm_var(x, w, b), backend="seqfast", dynamic=dynamic)
    with collecting() as report:
        for length in (5, 9):
            x = rand(2, length, WIDTH, seed=length)
            if dynamic is None:
                torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), layer_norm_var(x, w, b))
    assert len(report.graphs) == 1 and len(read_as(report, "layer_norm")) == 1, report
    assert report.counts["norm"] == (dynamic is None), report


def test_a_cross_entropy_written_out_in_a_dynamic_graph():
    compiled = torch.compile(ce_masked_mean, backend="seqfast", dynamic=True)
    with collecting() as report:
        for rows in (5, 9):
            x, t = rand(2, rows, V, seed=rows), targets((2, rows), seed=rows)
            torch.testing.assert_close(compiled(x, t), ce_masked_mean(x, t))
    assert len(report.graphs) == 1 and report.counts["loss"] == 1, report
