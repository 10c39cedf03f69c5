"""seqfast::cross_entropy and seqfast::linear_cross_entropy called directly: the kernels (Triton's
interpreter) and the reference against eager PyTorch, forward and every gradient, on vocabularies
that are not multiples of any block, with label smoothing, ignored and all-ignored rows, half
precision, chunking and what the backward keeps."""

import math

import pytest
import torch
import torch.nn.functional as F

import seqcompile.ops.linear_cross_entropy  # noqa: F401  (registers the op)
from seqcompile.ops.cross_entropy import kernels as ce_kernels
from seqcompile.ops.linear_head import default_chunk

IGNORE = -100
REDUCTIONS = {"mean": True, "sum": False}
pytestmark = pytest.mark.kernels("cross_entropy:forward", "cross_entropy:backward")
LINEAR_KERNELS = pytest.mark.kernels("cross_entropy:forward_grad")
"""The linear + cross-entropy finishes each chunk's gradient in its forward kernel."""


def logits_and_targets(rows, vocab, *, seed=0, dtype=torch.float32, ignored=(1,)):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype).requires_grad_()
    target = torch.randint(vocab, (rows,), generator=g)
    target[list(ignored)] = IGNORE
    return logits, target


def per_row(logits, target, smoothing):
    return torch.ops.seqfast.cross_entropy(logits, target, IGNORE, smoothing)[0]


def eager_rows(logits, target, smoothing):
    return F.cross_entropy(
        logits.float(), target, ignore_index=IGNORE, label_smoothing=smoothing, reduction="none"
    )


@pytest.mark.parametrize("vocab", [97, 1000, 50257])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_rows_and_gradient_match_eager(impl, vocab, smoothing):
    logits, target = logits_and_targets(3, vocab)
    cotangent = torch.randn(3, generator=torch.Generator().manual_seed(1))
    loss = per_row(logits, target, smoothing)
    expected = eager_rows(logits, target, smoothing)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logits, cotangent)
    (eager_grad,) = torch.autograd.grad(expected, logits, cotangent)
    torch.testing.assert_close(grad, eager_grad)
    assert loss[1] == 0 and not grad[1].any()  # the ignored row


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_logits_compute_in_float32(impl, dtype):
    logits, target = logits_and_targets(4, 300, dtype=dtype)
    loss = per_row(logits, target, 0.1)
    expected = eager_rows(logits, target, 0.1)  # eager upcasts, as the fused loss absorbs
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    (eager_grad,) = torch.autograd.grad(expected.sum(), logits)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, eager_grad)


def test_strided_rows_and_a_broadcast_incoming_gradient(impl):
    wide, target = logits_and_targets(4, 130)
    logits = wide[:, 10:110]  # rows 130 apart
    target = target.clamp(max=99)
    target[1] = IGNORE
    loss = per_row(logits, target, 0.0)
    torch.testing.assert_close(loss, eager_rows(logits, target, 0.0))
    (grad,) = torch.autograd.grad(loss.sum(), wide)  # sum's backward: an expanded scalar
    (eager_grad,) = torch.autograd.grad(eager_rows(logits, target, 0.0).sum(), wide)
    torch.testing.assert_close(grad, eager_grad)


TARGET_LAYOUTS = ["contiguous", "step", "column", "offset", "expanded"]


def in_layout(t, layout):
    """The 1-d tensor `t` laid out as `layout`: every other element of a longer tensor (`step`),
    the second column of (rows, 2) pairs, one element into its storage (`offset`), or its first
    value expanded with stride 0 (its values change). The elements between are `t` shifted, so
    a kernel reading the wrong ones reads other valid classes."""
    if layout == "contiguous":
        return t
    if layout == "expanded":
        return t[:1].expand(t.shape[0])
    if layout == "offset":
        return torch.cat([t[-1:], t])[1:]
    pairs = torch.stack([t.roll(1), t], dim=1)
    return pairs.flatten()[1::2] if layout == "step" else pairs[:, 1]


@pytest.mark.parametrize("layout", TARGET_LAYOUTS)
def test_targets_in_any_layout(impl, layout):
    logits, target = logits_and_targets(6, 97)
    target = in_layout(target, layout)
    assert layout == "contiguous" or not target.is_contiguous() or target.storage_offset()
    cotangent = torch.randn(6, generator=torch.Generator().manual_seed(1))
    loss = per_row(logits, target, 0.1)
    expected = eager_rows(logits, target, 0.1)
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logits, cotangent)
    (eager_grad,) = torch.autograd.grad(expected, logits, cotangent)
    torch.testing.assert_close(grad, eager_grad)


def test_the_backward_reads_lse_and_incoming_gradients_through_their_strides(impl):
    logits, target = logits_and_targets(5, 97)
    logits = logits.detach()
    _, lse = torch.ops.seqfast.cross_entropy(logits, target, IGNORE, 0.1)
    grad = torch.randn(5, generator=torch.Generator().manual_seed(2))
    arguments = dict(logits=logits, target=target, ignore_index=IGNORE, smoothing=0.1)
    expected = torch.ops.seqfast.cross_entropy_backward(grad=grad, lse=lse, **arguments)
    got = torch.ops.seqfast.cross_entropy_backward(
        grad=in_layout(grad, "step"), lse=in_layout(lse, "offset"),
        **{**arguments, "target": in_layout(target, "column")},
    )  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_all_ignored_rows_give_zero_loss_and_zero_gradient(impl):
    logits, target = logits_and_targets(3, 50, ignored=(0, 1, 2))
    loss = per_row(logits, target, 0.2)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    assert not loss.any() and not grad.any()


INF = float("inf")


def rows_with_infinities(vocab):
    """Rows with a -inf logit off the target, on the target, on an ignored row, every logit
    -inf (eager: NaN), every logit -inf on an ignored row, a +inf logit, a NaN logit, and a
    plain row."""
    logits, target = logits_and_targets(8, vocab, ignored=(2, 4))
    x = logits.detach()
    x[0, (target[0] + 1) % vocab] = -INF
    x[1, target[1]] = -INF
    x[2, :5] = -INF
    x[3] = -INF
    x[4] = -INF
    x[5, 3] = INF
    x[6, 3] = float("nan")
    return x.requires_grad_(), target


def assert_matches_eager(loss, expected, logits):
    """Loss and gradient as eager's, infinities and NaN in the same places."""
    torch.testing.assert_close(loss, expected, equal_nan=True)
    cotangent = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(loss, logits, cotangent)
    (eager_grad,) = torch.autograd.grad(expected, logits, cotangent)
    torch.testing.assert_close(grad, eager_grad, equal_nan=True)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
def test_infinite_and_nan_logits_give_eager_loss_and_gradient(impl, smoothing):
    logits, target = rows_with_infinities(37)
    loss = per_row(logits, target, smoothing)
    assert loss[0].isfinite() == (smoothing == 0)  # with smoothing a -inf logit costs inf
    assert_matches_eager(loss, eager_rows(logits, target, smoothing), logits)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_block_of_the_vocabulary_that_is_all_minus_inf(impl, smoothing, monkeypatch):
    """The online log-sum-exp meets a block whose maximum is -inf (the first, or the first two)
    before any finite logit."""
    monkeypatch.setattr(ce_kernels, "MAX_BLOCK_V", 16)
    logits, target = logits_and_targets(3, 40, ignored=())
    x = logits.detach()
    x[0, :16] = -INF
    x[1, :32] = -INF
    x[2, 20:] = -INF
    target[:2] = 35
    logits = x.requires_grad_()
    loss = per_row(logits, target, smoothing)
    assert loss[:2].isfinite().all() == (smoothing == 0)
    assert_matches_eager(loss, eager_rows(logits, target, smoothing), logits)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_the_in_place_backward_writes_what_the_backward_returns(impl, layout):
    logits, target = logits_and_targets(5, 97, dtype=torch.bfloat16)
    logits = logits.detach()
    _, lse = torch.ops.seqfast.cross_entropy(logits, target, IGNORE, 0.1)
    grad = torch.randn(5, generator=torch.Generator().manual_seed(2))
    arguments = dict(grad=grad, target=target, lse=lse, ignore_index=IGNORE, smoothing=0.1)
    expected = torch.ops.seqfast.cross_entropy_backward(logits=logits, **arguments)
    over = logits.clone() if layout == "contiguous" else logits.t().contiguous().t()
    torch.ops.seqfast.cross_entropy_backward_in_place(logits=over, **arguments)
    assert over.dtype == torch.bfloat16
    torch.testing.assert_close(over, expected, rtol=0, atol=0)


@pytest.mark.kernels()  # no row, nothing to launch
def test_no_rows(impl):
    logits = torch.randn(0, 97).requires_grad_()
    target = torch.zeros(0, dtype=torch.long)
    loss = per_row(logits, target, 0.1)
    assert loss.shape == (0,)
    mean = loss.sum() / (target != IGNORE).sum()  # the fused loss's mean
    eager_mean = F.cross_entropy(logits, target, label_smoothing=0.1)
    assert mean.isnan() and eager_mean.isnan()
    (grad,) = torch.autograd.grad(mean, logits)
    (eager_grad,) = torch.autograd.grad(eager_mean, logits)
    assert grad.shape == eager_grad.shape == (0, 97)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.kernels()  # no class, nothing to launch
def test_no_classes_and_every_row_ignored(impl, smoothing):
    """Eager: each row costs 0, or NaN with smoothing (its smoothing term is divided by 0)."""
    logits = torch.randn(3, 0).requires_grad_()
    target = torch.full((3,), IGNORE)
    loss = per_row(logits, target, smoothing)
    torch.testing.assert_close(loss, eager_rows(logits, target, smoothing), equal_nan=True)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    assert grad.shape == (3, 0)


@pytest.mark.kernels()  # refused before any launch
def test_no_classes_and_a_target_is_an_error(impl):
    logits = torch.randn(3, 0)
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(logits, torch.tensor([IGNORE, 0, IGNORE]))
    with pytest.raises(IndexError, match=r"outside \[0, 0\)"):
        per_row(logits, torch.tensor([IGNORE, 0, IGNORE]), 0.0)


@pytest.mark.kernels()  # refused before any launch
def test_a_target_out_of_range_is_an_error(impl):
    logits, target = logits_and_targets(3, 50)
    target[0] = 50
    with pytest.raises(IndexError, match=r"outside \[0, 50\)"):
        per_row(logits, target, 0.0)


def test_the_backward_keeps_logits_targets_and_lse_only():
    logits, target = logits_and_targets(3, 50)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(saved.append, lambda t: t):
        per_row(logits, target, 0.0)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == [(3,), (3,), (3, 50)]  # target, lse, logits: no softmax, no log-probs


# --------------------------------------------------------------------------------------------
# linear + cross-entropy


def linear_inputs(rows, width, vocab, *, bias, seed=0, ignored=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g).requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) / math.sqrt(width)).requires_grad_()
    b = torch.randn(vocab, generator=g).requires_grad_() if bias else None
    target = torch.randint(vocab, (rows,), generator=g)
    target[list(ignored)] = IGNORE
    return hidden, weight, b, target


def fused_linear_loss(hidden, weight, bias, target, *, smoothing=0.0, mean=True, chunk=0,
                      compute_dtype=torch.float32):  # fmt: skip
    needs = [hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
    return torch.ops.seqfast.linear_cross_entropy(
        hidden, weight, bias, target, IGNORE, smoothing, mean, chunk, compute_dtype, needs
    )[0]


def eager_linear_loss(hidden, weight, bias, target, *, smoothing=0.0, mean=True):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(
        logits.float(), target, ignore_index=IGNORE, label_smoothing=smoothing,
        reduction="mean" if mean else "sum",
    )  # fmt: skip


@pytest.mark.parametrize("vocab", [97, 1000])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
@LINEAR_KERNELS
def test_linear_loss_and_every_gradient_match_eager(impl, vocab, bias, reduction):
    inputs = linear_inputs(10, 16, vocab, bias=bias)
    options = dict(smoothing=0.1, mean=REDUCTIONS[reduction])
    # the backward scales by the incoming gradient: a scaled loss, as for gradient accumulation
    loss = 0.25 * fused_linear_loss(*inputs, chunk=3, **options)
    expected = 0.25 * eager_linear_loss(*inputs, **options)
    torch.testing.assert_close(loss, expected)
    wrt = [t for t in inputs[:3] if t is not None]
    for got, want in zip(
        torch.autograd.grad(loss, wrt), torch.autograd.grad(expected, wrt), strict=True
    ):
        torch.testing.assert_close(got, want)


@LINEAR_KERNELS
def test_chunked_equals_unchunked(impl):
    inputs = linear_inputs(12, 8, 97, bias=True)
    wrt = [t for t in inputs[:3] if t is not None]
    results = []
    for chunk in (1, 5, 12):
        loss = fused_linear_loss(*inputs, chunk=chunk, smoothing=0.05)
        results.append([loss, *torch.autograd.grad(loss, wrt)])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("layout", TARGET_LAYOUTS)
@pytest.mark.parametrize("chunk", [1, 4, 0])
@LINEAR_KERNELS
def test_linear_loss_with_targets_in_any_layout(impl, layout, chunk):
    hidden, weight, bias, target = linear_inputs(20, 8, 97, bias=True)  # default chunk: every row
    target = in_layout(target, layout)
    loss = fused_linear_loss(hidden, weight, bias, target, chunk=chunk, smoothing=0.1)
    expected = eager_linear_loss(hidden, weight, bias, target, smoothing=0.1)
    torch.testing.assert_close(loss, expected)
    wrt = [hidden, weight, bias]
    for got, want in zip(
        torch.autograd.grad(loss, wrt), torch.autograd.grad(expected, wrt), strict=True
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@LINEAR_KERNELS
def test_linear_loss_with_classes_masked_by_a_minus_inf_bias(impl, smoothing):
    hidden, weight, bias, target = linear_inputs(10, 8, 40, bias=True)
    masked = torch.zeros(40, dtype=torch.bool)
    masked[::3] = True
    bias = bias.detach().masked_fill(masked, -INF).requires_grad_()
    target[target % 3 == 0] += 1  # targets are never masked
    loss = fused_linear_loss(hidden, weight, bias, target, chunk=4, smoothing=smoothing)
    expected = eager_linear_loss(hidden, weight, bias, target, smoothing=smoothing)
    assert loss.isfinite() == (smoothing == 0)
    torch.testing.assert_close(loss, expected)
    wrt = [hidden, weight, bias]
    for got, want in zip(
        torch.autograd.grad(loss, wrt), torch.autograd.grad(expected, wrt), strict=True
    ):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("reduction", sorted(REDUCTIONS))
@pytest.mark.kernels()  # no token, nothing to launch
def test_linear_loss_of_no_tokens(impl, reduction):
    """A mean over no token is NaN, a sum 0; the gradients are eager's: empty for the hidden
    states (not missing), zeros for the weight and bias."""
    hidden, weight, bias, target = linear_inputs(0, 8, 40, bias=True, ignored=())
    mean = REDUCTIONS[reduction]
    loss = fused_linear_loss(hidden, weight, bias, target, mean=mean)
    expected = eager_linear_loss(hidden, weight, bias, target, mean=mean)
    torch.testing.assert_close(loss, expected, equal_nan=True)
    wrt = [hidden, weight, bias]
    for got, want in zip(
        torch.autograd.grad(loss, wrt), torch.autograd.grad(expected, wrt), strict=True
    ):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.kernels()  # no class, nothing to launch
def test_linear_loss_over_no_classes(impl, smoothing):
    hidden = torch.randn(5, 8).requires_grad_()
    weight, bias = torch.randn(0, 8).requires_grad_(), torch.randn(0).requires_grad_()
    target = torch.full((5,), IGNORE)
    options = dict(mean=False, smoothing=smoothing)
    loss = fused_linear_loss(hidden, weight, bias, target, chunk=2, **options)
    expected = eager_linear_loss(hidden, weight, bias, target, **options)
    torch.testing.assert_close(loss, expected, equal_nan=True)
    wrt = [hidden, weight, bias]
    for got, want in zip(
        torch.autograd.grad(loss, wrt), torch.autograd.grad(expected, wrt), strict=True
    ):
        torch.testing.assert_close(got, want, equal_nan=True)


@LINEAR_KERNELS
def test_all_ignored_tokens(impl):
    hidden, weight, _, target = linear_inputs(4, 8, 50, bias=False, ignored=(0, 1, 2, 3))
    total = fused_linear_loss(hidden, weight, None, target, mean=False)
    grads = torch.autograd.grad(total, [hidden, weight])
    assert total == 0 and not any(g.any() for g in grads)
    mean = fused_linear_loss(hidden, weight, None, target, mean=True)
    eager_mean = eager_linear_loss(hidden, weight, None, target)
    assert torch.isnan(mean) and torch.isnan(eager_mean)
    grads = torch.autograd.grad(mean, [hidden, weight])
    eager_grads = torch.autograd.grad(eager_mean, [hidden, weight])
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want)  # zeros: eager's, though the mean is NaN


@LINEAR_KERNELS
def test_only_the_gradients_asked_for_are_computed(impl):
    hidden, weight, _, target = linear_inputs(6, 8, 40, bias=False)
    frozen = weight.detach()
    loss = fused_linear_loss(hidden, frozen, None, target)
    (grad,) = torch.autograd.grad(loss, hidden)
    (expected,) = torch.autograd.grad(eager_linear_loss(hidden, frozen, None, target), hidden)
    torch.testing.assert_close(grad, expected)


def test_half_compute_dtype_matches_autocast():
    hidden, weight, bias, target = linear_inputs(8, 16, 97, bias=True)
    loss = fused_linear_loss(hidden, weight, bias, target, compute_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight, bias)
    expected = F.cross_entropy(logits.float(), target, ignore_index=IGNORE)
    torch.testing.assert_close(loss, expected)
    wrt = [hidden, weight, bias]
    for got, want in zip(
        torch.autograd.grad(loss, wrt), torch.autograd.grad(expected, wrt), strict=True
    ):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_the_default_chunk_is_at_most_an_eighth_of_the_tokens_unless_the_logits_are_small():
    for rows in (100, 1000, 4096, 8192 + 5, 32768):
        chunk = default_chunk(rows, 50257)
        assert 1 <= chunk <= max(1, rows // 8)
    for rows in (1, 7, 8):
        assert default_chunk(rows, 50257) == rows
    assert default_chunk(8192, 50257) == 1024
    assert default_chunk(256, 256) == 256  # the demo: every row in one chunk
    assert default_chunk(2**20 // 97 + 1, 97) < 2**20 // 97 + 1
