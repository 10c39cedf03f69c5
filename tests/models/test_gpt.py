"""The GPT-style test model under real training conditions: every norm site fused, loss and every
gradient equal to eager, autocast, changing sequence lengths, seeded dropout, a short loss curve."""

import copy

import pytest
import torch
from checks import check_fusion, kept_for_backward
from conftest import TOLERANCES

from seqcompile.demo import GPT, Block, GPTConfig, toy_batch, train
from seqcompile.report import collecting


def config(**kwargs):
    return GPTConfig(
        **{"vocab": 64, "max_len": 32, "d_model": 32, "n_heads": 2, "dropout": 0.0, **kwargs}
    )


def batch(cfg, length=16, size=2, seed=0):
    return toy_batch(cfg, size, length, torch.device("cpu"), torch.Generator().manual_seed(seed))


def norm_sites(cfg):
    return 2 * cfg.n_layers + 1


@pytest.mark.parametrize("norm", ["layer", "rms", "t5"])
def test_loss_and_every_gradient_match_eager(norm):
    torch.manual_seed(0)
    cfg = config(norm=norm)
    check_fusion(GPT(cfg), list(batch(cfg)), counts={"norm": norm_sites(cfg)})


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", ["layer", "t5"])
def test_autocast_still_fuses_and_keeps_eager_dtypes(dtype, norm):
    torch.manual_seed(0)
    cfg = config(norm=norm)
    block = Block(cfg)
    x = torch.randn(2, 8, cfg.d_model, requires_grad=True)

    def two_outputs(x):
        return block.ln1(x), block(x)

    x_fast = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        eager = two_outputs(x)
        with collecting() as report:
            fast = torch.compile(two_outputs, backend="seqfast")(x_fast)
    assert report.counts["norm"] == 3 and report.counts["attention"] == 1, report
    for a, e in zip(fast, eager, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, **TOLERANCES[dtype])
    sum(t.float().sum() for t in eager).backward()
    sum(t.float().sum() for t in fast).backward()
    torch.testing.assert_close(x_fast.grad, x.grad, **TOLERANCES[dtype])


@pytest.mark.slow
def test_four_sequence_lengths_compile_at_most_two_graphs_all_fused():
    torch.manual_seed(0)
    cfg = config()
    model = GPT(cfg)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="seqfast")
    with collecting() as report:
        for length in (8, 12, 16, 24):
            idx, targets = batch(cfg, length)
            loss = compiled(idx, targets)
            torch.testing.assert_close(loss, eager(idx, targets), **TOLERANCES[torch.float32])
    assert len(report.graphs) == 2
    # the dynamic graph is fused as well
    assert report.counts["norm"] == 2 * norm_sites(cfg)
    assert report.counts["attention"] == 2 * cfg.n_layers
    assert report.missed == []


def loss_and_grads(model, idx, targets, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_seeded_dropout_runs_repeat_and_differ_across_seeds():
    torch.manual_seed(0)
    cfg = config(dropout=0.2)
    model = GPT(cfg).train()
    compiled = torch.compile(model, backend="seqfast")
    idx, targets = batch(cfg)
    with collecting() as report:
        first = loss_and_grads(compiled, idx, targets, seed=1)
    assert report.counts["norm"] == norm_sites(cfg)
    again = loss_and_grads(compiled, idx, targets, seed=1)
    other = loss_and_grads(compiled, idx, targets, seed=2)
    assert torch.equal(first[0], again[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], again[1], strict=True))
    assert not torch.equal(first[0], other[0])


def test_training_loss_curve_tracks_eager():
    torch.manual_seed(0)
    cfg = config()
    model = GPT(cfg)
    fast_model = copy.deepcopy(model)
    kwargs = dict(steps=5, batch=4, length=16, device=torch.device("cpu"))
    eager = train(model, model, cfg, **kwargs)
    fast = train(fast_model, torch.compile(fast_model, backend="seqfast"), cfg, **kwargs)
    assert eager.losses[-1] < eager.losses[0]
    torch.testing.assert_close(fast.losses, eager.losses, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_attention_keeps_memory_linear_in_length_and_under_a_third_of_eager():
    kept = {}
    for length in (128, 256):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab=64, max_len=length, d_model=64, n_heads=4, dropout=0.1)
        model = GPT(cfg)
        idx, targets = batch(cfg, length)
        compiled = torch.compile(model, backend="seqfast")
        with collecting() as report:
            compiled(idx, targets).backward()  # compile outside the hooks: tracing saves too
        assert report.counts["attention"] == cfg.n_layers
        kept[length] = (
            kept_for_backward(model, idx, targets),
            kept_for_backward(compiled, idx, targets),
        )
    (eager_128, fast_128), (eager_256, fast_256) = kept[128], kept[256]
    assert fast_256 < eager_256 / 3, kept
    assert fast_256 / fast_128 < 2.2 < 3 < eager_256 / eager_128, kept


# --------------------------------------------------------------------------------------------
# a batch of no tokens: eager answers NaN (a mean of nothing) and zero gradients

EMPTY = pytest.mark.parametrize("size, length", [(0, 16), (2, 0)], ids=["batch0", "length0"])


def _empty_step(size, length, *, with_loss):
    """A step of a one-layer GPT compiled and eager on a batch of no tokens: the two losses (the
    cross-entropy, or the logits' mean), the report, and each parameter's gradient in both."""
    torch.manual_seed(0)
    cfg = config(n_layers=1)
    model = GPT(cfg)
    eager = copy.deepcopy(model)
    idx, targets = batch(cfg, length=length, size=size)
    args = (idx, targets) if with_loss else (idx,)
    with collecting() as report:
        loss = torch.compile(model, backend="seqfast")(*args)
    loss = loss if with_loss else loss.mean()
    expected = eager(*args) if with_loss else eager(*args).mean()
    loss.backward()
    expected.backward()
    grads = [(name, p.grad, e.grad) for (name, p), e in
             zip(model.named_parameters(), eager.parameters(), strict=True)]  # fmt: skip
    return loss, expected, report, grads


@EMPTY
@pytest.mark.kernels()  # nothing to compute: no kernel launches
def test_an_empty_batch_through_every_fused_op_gives_eager_answer(impl, size, length):
    """Attention, add + norm and the MLP's pointwise region, compiled, on a batch of no tokens."""
    loss, expected, report, grads = _empty_step(size, length, with_loss=False)
    assert all(report.counts[family] for family in ("attention", "norm", "pointwise"))
    assert loss.isnan() and expected.isnan()
    for name, actual, want in grads:
        assert actual is not None and torch.equal(actual, want), name


@EMPTY
@pytest.mark.kernels()
def test_an_empty_batch_trains_through_a_region_before_the_fused_loss(impl, size, length):
    """The fused linear + cross-entropy hands the MLP's pointwise region no gradient (None) for
    an empty batch; the region's backward answered with None for its list of inputs, which
    autograd refused ("Expected the return from backward to be of the same structure as the
    inputs"), failing the compile."""
    loss, expected, report, grads = _empty_step(size, length, with_loss=True)
    assert report.counts["loss"] == 1 and report.counts["pointwise"] == 1
    assert loss.isnan() and expected.isnan()
    tied = {name: (a, e) for name, a, e in grads}["tok.weight"]  # the head's weight, tied
    assert torch.equal(*tied)


@EMPTY
def test_an_empty_batch_gives_every_parameter_eagers_zero_gradient(size, length):
    *_, grads = _empty_step(size, length, with_loss=True)
    for name, actual, want in grads:
        assert actual is not None and torch.equal(actual, want), name
