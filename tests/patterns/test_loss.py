"""The loss family through torch.compile: every spelling of cross-entropy becomes one fused loss,
a linear feeding it joins it when nothing else reads the logits (and says why not otherwise), and
the backward keeps no vocabulary-sized tensor."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion, kept_for_backward
from conftest import KERNELS_IN_SLOW_TIER
from torch import nn

from seqcompile.capture import trace_function
from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.options import OptionError
from seqcompile.patterns.engine import Reject
from seqcompile.patterns.loss import LossPattern
from seqcompile.report import collecting

VOCAB, ROWS, WIDTH = 97, 12, 16


def logits_and_targets(vocab=VOCAB, rows=ROWS, seed=0, pad=None):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, vocab, generator=g)).requires_grad_()
    target = torch.randint(vocab, (rows,), generator=g)
    if pad is not None:
        target[[1, rows - 1]] = pad
    return logits, target


def modes(report):
    """Which cross-entropy kernels a compile prepared."""
    return sorted(dict(k.key)["mode"] for k in report.kernels if k.template == "cross_entropy")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_options(reduction, smoothing):
    def loss(x, t):
        return F.cross_entropy(
            x, t, ignore_index=-100, label_smoothing=smoothing, reduction=reduction
        )

    report = check_fusion(loss, logits_and_targets(pad=-100), counts={"loss": 1})
    assert modes(report) == ["backward", "forward"]


def test_module_spelling_and_a_large_vocabulary():
    criterion = nn.CrossEntropyLoss(ignore_index=0)
    check_fusion(criterion, logits_and_targets(vocab=50257, rows=3, pad=0), counts={"loss": 1})


def test_log_softmax_then_nll_loss():
    def loss(x, t):
        return F.nll_loss(F.log_softmax(x.float(), dim=-1), t, ignore_index=3, reduction="sum")

    check_fusion(loss, logits_and_targets(pad=3), counts={"loss": 1})


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=None):
    """fairseq's (and LightSeq's) label-smoothed loss, as they write it."""
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss = nll_loss.masked_fill(pad_mask, 0.0)
        smooth_loss = smooth_loss.masked_fill(pad_mask, 0.0)
    else:
        nll_loss = nll_loss.squeeze(-1)
        smooth_loss = smooth_loss.squeeze(-1)
    nll_loss, smooth_loss = nll_loss.sum(), smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


def test_fairseq_label_smoothed_loss_and_its_logged_nll():
    def loss(x, t):
        return label_smoothed_nll_loss(F.log_softmax(x, dim=-1), t, 0.1, ignore_index=1)

    # the nll it also returns (for logging) becomes a second loss without smoothing
    check_fusion(loss, logits_and_targets(pad=1), counts={"loss": 2})


def label_smoothed_nll_loss_summed_in_turn(lprobs, target, epsilon, ignore_index):
    """The same loss with each masked term summed as soon as it is made."""
    target = target.unsqueeze(-1)
    pad_mask = target.eq(ignore_index)
    nll_loss = (-lprobs.gather(dim=-1, index=target)).masked_fill(pad_mask, 0.0).sum()
    smooth_loss = (-lprobs.sum(dim=-1, keepdim=True)).masked_fill(pad_mask, 0.0).sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    return (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss, nll_loss


FAIRSEQ_SPELLINGS = {
    # each term summed before the next is made: left unfused, the pointwise fuser refuses the
    # terms ("a value of the region is used before the region ends")
    "summed_in_turn": lambda x, t: label_smoothed_nll_loss_summed_in_turn(
        F.log_softmax(x, dim=-1).view(-1, VOCAB), t.view(-1), 0.1, ignore_index=1
    ),
    # LabelSmoothedCrossEntropyCriterion: lprobs.view(-1, lprobs.size(-1)), target.view(-1)
    "criterion": lambda x, t: label_smoothed_nll_loss(
        F.log_softmax(x, dim=-1).view(-1, VOCAB), t.view(-1), 0.1, ignore_index=1
    ),
    "target_view_rows_by_1": lambda x, t: label_smoothed_nll_loss(
        F.log_softmax(x, dim=-1).view(-1, VOCAB), t.view(-1, 1), 0.1, ignore_index=1
    ),
    # get_normalized_probs: log_softmax(x, dim=-1, dtype=torch.float32)
    "log_softmax_in_float32": lambda x, t: label_smoothed_nll_loss(
        F.log_softmax(x, dim=-1, dtype=torch.float32).flatten(0, 1), t.flatten(), 0.1, 1
    ),
    "sequences_unflattened": lambda x, t: label_smoothed_nll_loss(
        F.log_softmax(x, dim=-1), t, 0.1, ignore_index=1
    ),
    # without an ignore index fairseq squeezes each term's trailing 1 instead of masking it
    "no_padding_criterion": lambda x, t: label_smoothed_nll_loss(
        F.log_softmax(x, dim=-1).view(-1, VOCAB), t.view(-1), 0.1
    ),
    "no_padding_target_view_rows_by_1": lambda x, t: label_smoothed_nll_loss(
        F.log_softmax(x, dim=-1).view(-1, VOCAB), t.view(-1, 1), 0.1
    ),
    "no_padding_sequences_unflattened": lambda x, t: label_smoothed_nll_loss(
        F.log_softmax(x, dim=-1), t, 0.1
    ),
    "no_padding_no_smoothing": lambda x, t: label_smoothed_nll_loss(
        F.log_softmax(x, dim=-1).view(-1, VOCAB), t.view(-1), 0.0
    ),
    "no_padding_squeezed_before_negation": lambda x, t: label_smoothed_nll_loss_squeezed_first(
        F.log_softmax(x, dim=-1).view(-1, VOCAB), t.view(-1), 0.1
    ),
    "terms_not_negated": lambda x, t: label_smoothed_log_likelihood(
        F.log_softmax(x, dim=-1).view(-1, VOCAB), t.view(-1), 0.1
    ),
}


def label_smoothed_nll_loss_squeezed_first(lprobs, target, epsilon):
    """The unpadded loss with each term squeezed before it is negated."""
    target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target).squeeze(-1)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True).squeeze(-1)
    nll_loss, smooth_loss = nll_loss.sum(), smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    return (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss, nll_loss


def label_smoothed_log_likelihood(lprobs, target, epsilon):
    """Minus the loss, with the log-likelihoods summed unnegated (the logged sum is one too)."""
    likelihood = lprobs.gather(dim=-1, index=target.unsqueeze(-1)).sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    return (1.0 - epsilon - eps_i) * likelihood + eps_i * lprobs.sum(-1).sum(), likelihood


@pytest.mark.parametrize("spelling", sorted(FAIRSEQ_SPELLINGS))
@pytest.mark.rotating(2)  # a sweep of spellings: half per run, in turn
def test_fairseq_label_smoothed_loss_through_views_of_the_rows(spelling):
    check_fusion(
        FAIRSEQ_SPELLINGS[spelling], sequence_logits(pad=1), counts={"loss": 2, "pointwise": 0}
    )


def unpadded_loss_of(lprobs, target, epsilon=0.1, smooth_dim=-1, nll_fill=None):
    """fairseq's unpadded loss with the near misses the refusal tests need: the smoothing sum over
    `smooth_dim`, and the nll term alone masked with `nll_fill` (a pad index)."""
    target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    if nll_fill is not None:
        nll_loss = nll_loss.masked_fill(target.eq(nll_fill), 0.0)
    nll_loss = nll_loss.squeeze(-1).sum()
    smooth_loss = -lprobs.sum(dim=smooth_dim, keepdim=True).squeeze(-1).sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    return (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss, nll_loss


def per_token_nll_returned(x, t):
    lprobs = F.log_softmax(x, dim=-1)
    nll = -lprobs.gather(dim=-1, index=t.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(dim=-1, keepdim=True).squeeze(-1)
    return 0.9 * nll.sum() + 0.1 / (VOCAB - 1) * smooth.sum(), nll


SMOOTHED_REFUSALS = {
    "log_probs_returned": (
        lambda x, t: (*unpadded_loss_of(lp := F.log_softmax(x, -1), t), lp),
        "log-probabilities log_softmax are read elsewhere too",
    ),
    "per_token_nll_returned": (per_token_nll_returned, "is read elsewhere too"),
    "log_of_softmax": (
        lambda x, t: unpadded_loss_of(torch.log(torch.softmax(x, -1)), t),
        "not a log_softmax",
    ),
    "smoothing_over_rows": (
        lambda x, t: unpadded_loss_of(F.log_softmax(x, -1), t, smooth_dim=0),
        "not over the classes",
    ),
    "index_for_half_the_rows": (
        lambda x, t: unpadded_loss_of(F.log_softmax(x, -1), t[: ROWS // 2]),
        "the gathered index has shape [6, 1], not one per row of [12]",
    ),
    "only_the_nll_masked": (
        lambda x, t: unpadded_loss_of(F.log_softmax(x, -1), t, nll_fill=1),
        "the nll term masks padding 1 times and the smoothing term 0 times",
    ),
    "negative_smoothing": (
        lambda x, t: unpadded_loss_of(F.log_softmax(x, -1), t, epsilon=-0.5),
        "are no label smoothing in [0, 1]",
    ),
}


@pytest.mark.parametrize("spelling", sorted(SMOOTHED_REFUSALS))
def test_a_label_smoothed_loss_that_is_no_cross_entropy_is_reported(spelling):
    fn, reason = SMOOTHED_REFUSALS[spelling]
    check_fusion(fn, logits_and_targets(pad=1), counts={"loss": 0}, missed=[reason])


INT32_TARGETS = {
    "cross_entropy": lambda x, t: F.cross_entropy(x, t),
    "nll_of_log_softmax": lambda x, t: F.nll_loss(F.log_softmax(x, -1), t, reduction="sum"),
    "linear": lambda x, t: F.cross_entropy(F.linear(x, torch.ones(VOCAB, VOCAB)), t),
}


@pytest.mark.parametrize("spelling", sorted(INT32_TARGETS))
def test_int32_targets_are_left_to_eager_which_refuses_them(spelling):
    logits, target = logits_and_targets()
    message = "expected target dtype to be Long or Byte, but got Int"
    with pytest.raises(RuntimeError, match=message):
        INT32_TARGETS[spelling](logits, target.int())
    with collecting() as report, pytest.raises(RuntimeError, match=message):
        torch.compile(INT32_TARGETS[spelling], backend="seqfast")(logits, target.int())
    assert report.counts["loss"] == 0
    assert any("torch.int32" in m.reason for m in report.missed), report.missed


def test_int32_targets_of_a_written_out_smoothed_loss_fuse_as_gather_takes_them():
    """Eager's gather takes int32 indices, so the loss read from it gets them as int64."""

    def loss(x, t):
        return label_smoothed_nll_loss(F.log_softmax(x, dim=-1), t, 0.1, ignore_index=1)

    logits, target = logits_and_targets(pad=1)
    check_fusion(loss, [logits, target.int()], counts={"loss": 2})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("spelling", ["cross_entropy", "nll_loss"])
@pytest.mark.kernels("cross_entropy:forward", "cross_entropy:backward")
@KERNELS_IN_SLOW_TIER
def test_class_weights_scale_each_row_and_the_mean_divides_by_their_sum(impl, reduction, spelling):
    """Each row's loss times its target's weight; the mean over the weights of the counted
    targets (ignored rows count none), as torch defines it."""
    weights = torch.rand(VOCAB, generator=torch.Generator().manual_seed(3)) + 0.5

    def loss(x, t):
        if spelling == "nll_loss":
            return F.nll_loss(F.log_softmax(x, -1), t, weight=weights, reduction=reduction)
        return F.cross_entropy(x, t, weight=weights, ignore_index=1, reduction=reduction)

    check_fusion(loss, logits_and_targets(pad=1), counts={"loss": 1})


WEIGHT_LAYOUTS = {
    "every_other": lambda w: torch.stack([w, w + 1], -1).flatten()[::2],
    "expanded": lambda w: w[:1].expand(VOCAB),
}
"""Class weights as a strided view and expanded from one value. (Weights that require grad are
refused by eager and by Dynamo alike.)"""


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(WEIGHT_LAYOUTS))
@pytest.mark.parametrize("rows", [0, ROWS])
def test_class_weights_in_any_layout_and_over_no_rows(layout, rows):
    """Weights passed in are read through their strides; a mean over no row is eager's NaN."""
    weights = WEIGHT_LAYOUTS[layout](torch.rand(VOCAB, generator=torch.Generator().manual_seed(3)))
    logits, target = logits_and_targets(pad=1)
    logits = logits[:rows].detach().requires_grad_()

    def loss(x, t, w):
        return F.cross_entropy(x, t, weight=w, ignore_index=1, reduction="sum" if rows else "mean")

    check_fusion(loss, [logits, target[:rows], weights], counts={"loss": 1}, grad=rows > 0)


def test_class_weights_with_smoothing_or_probability_targets_are_refused_with_the_reason():
    weights = torch.rand(VOCAB) + 0.5

    def loss(x, t, p):
        smoothed = F.cross_entropy(x, t, weight=weights, label_smoothing=0.1)
        return smoothed + F.cross_entropy(x, p, weight=weights)

    x, t = logits_and_targets()
    p = torch.softmax(torch.randn(x.shape), -1)
    check_fusion(
        loss, [x, t, p], counts={"loss": 0},
        missed=["class weights with label smoothing", "class weights with probability targets"],
    )  # fmt: skip


def test_a_linear_before_a_weighted_loss_joins_it_in_chunks():
    head = torch.nn.Linear(WIDTH, VOCAB)
    weights = torch.rand(VOCAB) + 0.5

    def loss(hidden, t):
        return F.cross_entropy(head(hidden), t, weight=weights)

    hidden = torch.randn(ROWS, WIDTH, requires_grad=True)
    report = check_fusion(loss, [hidden, logits_and_targets()[1]], counts={"loss": 1})
    assert any("linear_row_loss" in site for site in report.sites), report.sites


TARGET_VIEWS = {
    "every_other": lambda t: t.flatten()[1::2],
    "column_of_pairs": lambda t: t[:, 1],
}
"""Strided views of (ROWS, 2) pairs that select the same ROWS targets."""


def target_pairs():
    g = torch.Generator().manual_seed(3)
    pairs = torch.randint(VOCAB, (ROWS, 2), generator=g)
    pairs[1, 1] = -100
    return pairs


@pytest.mark.parametrize("spelling", sorted(TARGET_VIEWS))
@pytest.mark.kernels("cross_entropy:forward", "cross_entropy:backward")
def test_a_strided_view_of_the_targets(impl, spelling):
    def loss(x, pairs):
        return F.cross_entropy(x, TARGET_VIEWS[spelling](pairs), label_smoothing=0.1)

    logits, _ = logits_and_targets()
    check_fusion(loss, [logits, target_pairs()], counts={"loss": 1})


@pytest.mark.kernels("cross_entropy:forward", "cross_entropy:backward")
def test_strided_targets_passed_in(impl):
    logits, _ = logits_and_targets()
    targets = target_pairs()[:, 1]
    check_fusion(lambda x, t: F.cross_entropy(x, t), [logits, targets], counts={"loss": 1})


class TargetViewHead(nn.Module):
    """An output projection and its loss over a strided view of the targets."""

    def __init__(self, spelling):
        super().__init__()
        self.proj, self.spelling = nn.Linear(WIDTH, VOCAB), spelling

    def forward(self, hidden, pairs):
        return F.cross_entropy(self.proj(hidden), TARGET_VIEWS[self.spelling](pairs))


@pytest.mark.parametrize("chunk", [1, 5, 0])
@pytest.mark.parametrize("spelling", sorted(TARGET_VIEWS))
@pytest.mark.kernels("cross_entropy:forward_grad")
@pytest.mark.rotating(2)  # a sweep of spellings: half per run, in turn
def test_a_linear_and_loss_over_a_strided_view_of_the_targets(impl, spelling, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(ROWS, WIDTH).requires_grad_()
    report = check_fusion(
        TargetViewHead(spelling),
        [hidden, target_pairs()],
        counts={"loss": 1},
        options={"loss_chunk": chunk},
    )
    assert modes(report) == ["forward_grad"]


class Projection(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB)

    def forward(self, hidden, target):
        return F.cross_entropy(self.proj(hidden), target, reduction="sum")


@pytest.mark.kernels("cross_entropy:forward_grad")
def test_a_linear_and_loss_over_strided_targets_passed_in(impl):
    torch.manual_seed(0)
    hidden = torch.randn(ROWS, WIDTH).requires_grad_()
    report = check_fusion(
        Projection(), [hidden, target_pairs()[:, 1]], counts={"loss": 1}, options={"loss_chunk": 5}
    )
    assert modes(report) == ["forward_grad"]


def masked_classes(seed=4):
    """Logits where about a third of the classes are masked with -inf (invalid actions), never
    a row's target; row 1's target is ignored."""
    logits, target = logits_and_targets(pad=-100, seed=seed)
    masked = torch.rand(ROWS, VOCAB, generator=torch.Generator().manual_seed(seed)) < 0.3
    masked[torch.arange(ROWS), target.clamp(min=0)] = False
    return masked, target


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.kernels("cross_entropy:forward", "cross_entropy:backward")
def test_masked_classes_give_eager_loss_and_gradients(impl, smoothing):
    """A -inf logit costs nothing without smoothing and inf with it, as in eager; the gradients
    stay finite."""
    masked, target = masked_classes()
    logits = (2 * torch.randn(ROWS, VOCAB)).masked_fill(masked, float("-inf")).requires_grad_()

    def loss(x, t):
        return F.cross_entropy(x, t, label_smoothing=smoothing)

    check_fusion(loss, [logits, target], counts={"loss": 1})
    assert loss(logits, target).isfinite() == (smoothing == 0)


class MaskedHead(nn.Module):
    """An output projection whose bias masks every third class with -inf."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB)
        with torch.no_grad():
            self.proj.bias[1::3] = float("-inf")

    def forward(self, hidden, target):
        return F.cross_entropy(self.proj(hidden), target)


@pytest.mark.kernels("cross_entropy:forward_grad")
def test_a_linear_and_loss_over_classes_a_bias_masks(impl):
    torch.manual_seed(0)
    _, target = logits_and_targets(pad=-100)
    target = torch.where(target % 3 == 1, target - 1, target)  # no target is masked
    hidden = torch.randn(ROWS, WIDTH).requires_grad_()
    report = check_fusion(
        MaskedHead(), [hidden, target], counts={"loss": 1}, options={"loss_chunk": 5}
    )
    assert modes(report) == ["forward_grad"]


class PointwiseHead(nn.Module):
    """A pointwise region, then an output projection and its loss: the region's backward takes
    the hidden states' gradient from linear + cross-entropy."""

    def __init__(self, reduction):
        super().__init__()
        self.proj, self.reduction = nn.Linear(WIDTH, VOCAB), reduction

    def forward(self, hidden, target):
        logits = self.proj(F.gelu(hidden * 2)).flatten(0, 1)
        return F.cross_entropy(logits, target.flatten(), reduction=self.reduction)


@pytest.mark.parametrize("shape", [(0, 6), (2, 0)], ids=["batch_0", "length_0"])
@pytest.mark.kernels()  # no token, nothing to launch
def test_a_training_step_over_no_tokens(impl, shape):
    """Eager's answer: a sum of 0 and a mean of NaN, an empty gradient for the hidden states
    and zeros for the parameters."""
    torch.manual_seed(0)
    hidden = torch.randn(*shape, WIDTH).requires_grad_()
    target = torch.randint(VOCAB, shape)
    check_fusion(PointwiseHead("sum"), [hidden, target], counts={"loss": 1, "pointwise": 1})
    head = PointwiseHead("mean")
    loss = torch.compile(head, backend="seqfast")(hidden, target)
    loss.backward()
    assert loss.isnan() and hidden.grad.shape == hidden.shape
    assert not head.proj.weight.grad.any()


@pytest.mark.kernels()  # no row, nothing to launch
def test_cross_entropy_over_no_rows(impl):
    logits, target = torch.randn(0, VOCAB).requires_grad_(), torch.zeros(0, dtype=torch.long)
    check_fusion(
        lambda x, t: F.cross_entropy(x, t, reduction="sum"), [logits, target], counts={"loss": 1}
    )
    loss = torch.compile(lambda x, t: F.cross_entropy(x, t), backend="seqfast")(logits, target)
    loss.backward()
    assert loss.isnan() and logits.grad.shape == (0, VOCAB)


BATCH, LENGTH = 2, 6


def sequence_logits(classes_on_dim_1=False, pad=None, seed=0):
    """(B, T, V) logits, or a contiguous (B, V, T) tensor, and (B, T) targets."""
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, VOCAB, LENGTH) if classes_on_dim_1 else (BATCH, LENGTH, VOCAB)
    logits = (2 * torch.randn(shape, generator=g)).requires_grad_()
    target = torch.randint(VOCAB, (BATCH, LENGTH), generator=g)
    if pad is not None:
        target[0, 0] = target[1, -1] = pad
    return [logits, target]


ROW_VIEWS = {
    "view": lambda lp, t: (lp.view(-1, VOCAB), t.view(-1)),
    "reshape": lambda lp, t: (lp.reshape(-1, VOCAB), t.reshape(-1)),
    "flatten": lambda lp, t: (lp.flatten(0, 1), t.flatten()),
    "view_size": lambda lp, t: (lp.view(-1, lp.size(-1)), t.reshape(-1)),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("spelling", sorted(ROW_VIEWS))
@pytest.mark.rotating(2)  # a sweep of spellings: half per run, in turn
def test_log_softmax_then_a_reshape_of_the_rows_then_nll_loss(spelling, reduction):
    def loss(x, t):
        lprobs, target = ROW_VIEWS[spelling](F.log_softmax(x, -1), t)
        return F.nll_loss(lprobs, target, ignore_index=5, reduction=reduction)

    report = check_fusion(loss, sequence_logits(pad=5), counts={"loss": 1, "pointwise": 0})
    assert modes(report) == ["backward", "forward"]


def test_reshapes_that_split_and_merge_rows_around_log_softmax():
    def loss(x, t):
        lprobs = F.log_softmax(x.view(BATCH, LENGTH, VOCAB), dim=2).view(BATCH * LENGTH, VOCAB)
        return F.nll_loss(lprobs, t, reduction="sum")

    check_fusion(loss, logits_and_targets(), counts={"loss": 1})


def test_cross_entropy_of_a_reshape_of_the_rows():
    def loss(x, t):
        return F.cross_entropy(x.view(-1, VOCAB), t.view(-1), ignore_index=5)

    check_fusion(loss, sequence_logits(pad=5), counts={"loss": 1})


CLASSES_ON_DIM_1 = {
    "cross_entropy_of_transpose": lambda x, t, **kw: F.cross_entropy(x.transpose(1, 2), t, **kw),
    "cross_entropy_of_permute": lambda x, t, **kw: F.cross_entropy(x.permute(0, 2, 1), t, **kw),
    "nll_of_log_softmax_on_dim_1": lambda x, t, **kw: F.nll_loss(
        F.log_softmax(x.transpose(1, 2), 1), t, **kw
    ),
    "nll_of_transposed_log_softmax": lambda x, t, **kw: F.nll_loss(
        F.log_softmax(x, -1).transpose(1, 2), t, **kw
    ),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("spelling", sorted(CLASSES_ON_DIM_1))
@pytest.mark.rotating(2)  # a sweep of spellings: half per run, in turn
def test_classes_on_dim_1_as_a_transposed_view_fuse(spelling, reduction):
    """(B, V, T) logits that are a transpose of (B, T, V) ones: the rows are a view."""

    def loss(x, t):
        return CLASSES_ON_DIM_1[spelling](x, t, ignore_index=5, reduction=reduction)

    check_fusion(loss, sequence_logits(pad=5), counts={"loss": 1, "pointwise": 0})


def test_classes_on_dim_1_of_four_dims_fuse():
    """A per-pixel loss: (B, H, W, V) scores permuted to (B, V, H, W), targets (B, H, W)."""

    def loss(x, t):
        pixels = x.view(BATCH, 2, 3, VOCAB).permute(0, 3, 1, 2)
        return F.cross_entropy(pixels, t.view(BATCH, 2, 3), label_smoothing=0.1)

    check_fusion(loss, sequence_logits(), counts={"loss": 1})


@pytest.mark.parametrize("spelling", ["cross_entropy", "nll_of_log_softmax"])
def test_classes_strided_on_dim_1_are_refused_with_the_reason(spelling):
    """Contiguous (B, V, T) logits: rows of contiguous classes would need a copy."""

    def loss(x, t):
        if spelling == "cross_entropy":
            return F.cross_entropy(x, t)
        return F.nll_loss(F.log_softmax(x, 1), t)

    check_fusion(
        loss,
        sequence_logits(classes_on_dim_1=True),
        counts={"loss": 0},
        missed=["rows of contiguous classes"],
    )


def test_a_linear_feeding_a_transposed_loss_joins_it():
    torch.manual_seed(0)
    proj = nn.Linear(WIDTH, VOCAB)

    class TransposedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = proj

        def forward(self, hidden, target):
            return F.cross_entropy(self.proj(hidden).transpose(1, 2), target, ignore_index=-100)

    report = check_fusion(TransposedHead(), head_inputs(), counts={"loss": 1})
    assert modes(report) == ["forward_grad"]


def nll_and_its_log_probs(x, t):
    lprobs = F.log_softmax(x, -1)
    return F.nll_loss(lprobs.view(-1, VOCAB), t), lprobs


NLL_REFUSALS = {
    "log_softmax_returned": (nll_and_its_log_probs, "read elsewhere too"),
    "log_softmax_over_rows": (lambda x, t: F.nll_loss(F.log_softmax(x, 0), t), "over dim 0"),
    "log_of_softmax": (
        lambda x, t: F.nll_loss(torch.log(torch.softmax(x, -1)), t),
        "not a log_softmax",
    ),
}


@pytest.mark.parametrize("spelling", sorted(NLL_REFUSALS))
def test_an_nll_loss_that_is_no_cross_entropy_is_reported(spelling):
    fn, reason = NLL_REFUSALS[spelling]
    check_fusion(fn, logits_and_targets(), counts={"loss": 0}, missed=[reason])


class Head(nn.Module):
    """An LM head and its loss, optionally returning the logits too."""

    def __init__(self, bias=False, return_logits=False, transposed=False):
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB, bias=bias)
        self.return_logits, self.transposed = return_logits, transposed

    def forward(self, hidden, target):
        if self.transposed:
            logits = hidden @ self.proj.weight.t()
        else:
            logits = self.proj(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        return (loss, logits) if self.return_logits else loss


def head_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 6, WIDTH, generator=g).requires_grad_()
    target = torch.randint(VOCAB, (2, 6), generator=g)
    target[0, 0] = -100
    return [hidden, target]


@pytest.mark.parametrize(("bias", "transposed"), [(False, False), (True, False), (False, True)])
def test_a_linear_feeding_the_loss_joins_it(bias, transposed):
    torch.manual_seed(0)
    head = Head(bias=bias, transposed=transposed)
    report = check_fusion(head, head_inputs(), counts={"loss": 1}, options={"loss_chunk": 5})
    assert modes(report) == ["forward_grad"]


def test_a_summed_loss_divided_by_a_given_count_joins_the_linear_with_its_kernel():
    """Hugging Face's loss under the Trainer: the sum over this micro-batch's tokens divided by
    `num_items_in_batch`, a tensor passed in. The scaling after the loss does not hand the head
    to the row-wise loss, which runs without a kernel."""
    torch.manual_seed(0)
    proj = nn.Linear(WIDTH, VOCAB)

    def loss(hidden, target, count):
        logits = proj(hidden).flatten(0, 1)
        return F.cross_entropy(logits, target.flatten(), reduction="sum") / count

    report = check_fusion(loss, [*head_inputs(), torch.tensor(40)], counts={"loss": 1})
    assert modes(report) == ["forward_grad"], str(report)


def test_an_upcast_before_the_reshape_is_absorbed_too():
    """Hugging Face's order on a bf16 model: `logits.float()`, then `view(-1, vocab)`."""
    torch.manual_seed(0)
    proj = nn.Linear(WIDTH, VOCAB).to(torch.bfloat16)

    def loss(hidden, target):
        return F.cross_entropy(proj(hidden).float().view(-1, VOCAB), target.view(-1))

    hidden, target = head_inputs()
    hidden = hidden.detach().to(torch.bfloat16).requires_grad_()
    with collecting() as report:
        got = torch.compile(loss, backend="seqfast")(hidden, target)
    assert modes(report) == ["forward_grad"], str(report)
    torch.testing.assert_close(got, loss(hidden, target))


def test_logits_read_elsewhere_are_built_and_the_report_says_why():
    torch.manual_seed(0)
    report = check_fusion(
        Head(return_logits=True), head_inputs(), counts={"loss": 1}, missed=["read elsewhere"]
    )
    assert modes(report) == ["backward", "forward"]


class AutocastHead(Head):
    """The head computed in an autocast region inside the compiled code, the loss outside it."""

    def __init__(self, dtype, return_logits=False):
        super().__init__(bias=True, return_logits=return_logits)
        self.dtype = dtype

    def forward(self, hidden, target):
        with torch.autocast("cpu", dtype=self.dtype):
            logits = self.proj(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_linear_joins_under_autocast_in_its_dtype(dtype, tmp_path):
    torch.manual_seed(0)
    report = check_fusion(
        AutocastHead(dtype),
        head_inputs(),
        counts={"loss": 1},
        options={"dump_dir": str(tmp_path)},
        dtype=dtype,
    )
    assert modes(report) == ["forward_grad"]
    forward = next(tmp_path.glob("*/*_lower_forward.py")).read_text()
    (call,) = [line for line in forward.splitlines() if "seqfast.linear_cross_entropy" in line]
    assert str(dtype) in call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_logits_from_autocast_that_are_returned_fuse_the_loss_alone(dtype):
    report = check_fusion(
        AutocastHead(dtype, return_logits=True),
        head_inputs(),
        counts={"loss": 1},
        missed=["read elsewhere"],
        dtype=dtype,
    )
    assert modes(report) == ["backward", "forward"]


def test_a_grad_mode_switch_between_the_linear_and_the_loss_keeps_them_apart():
    head = Head()

    def loss(hidden, target):
        logits = head.proj(hidden)
        with torch.no_grad():
            weight = hidden.detach().norm()
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100) * weight

    report = check_fusion(loss, head_inputs(), counts={"loss": 1}, missed=["grad mode"])
    assert modes(report) == ["backward", "forward"]


def test_a_bad_chunk_option_is_a_clear_error():
    with pytest.raises(OptionError, match="loss_chunk"):
        torch.compile(Head(), backend="seqfast", options={"loss_chunk": -1})(*head_inputs())


CONFIG = GPTConfig(vocab=256, max_len=16, d_model=32, n_heads=2, n_layers=1, dropout=0.0)


class Trunk(GPT):
    """The same model with a loss that keeps nothing: what the rest of the model keeps."""

    def forward(self, idx, targets):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return (self.ln_f(x) * self.fixed).sum()


def test_gpt_with_a_tied_head_fuses_its_loss_and_keeps_no_logits():
    torch.manual_seed(0)
    batch = toy_batch(CONFIG, 2, 16, "cpu", torch.Generator().manual_seed(0))
    model = GPT(CONFIG).train()
    check_fusion(model, batch, counts={"loss": 1}, grad=True)

    tokens, width = batch[0].numel(), CONFIG.d_model
    trunk = Trunk(CONFIG).train()
    trunk.register_buffer("fixed", torch.randn(width))
    compiled, compiled_trunk = (
        torch.compile(model, backend="seqfast"),
        torch.compile(trunk, backend="seqfast"),
    )
    compiled(*batch).backward()  # compile outside the hooks: tracing saves too
    compiled_trunk(*batch).backward()
    by_loss = kept_for_backward(compiled, *batch) - kept_for_backward(compiled_trunk, *batch)
    # the loss keeps its finished gradients: the head input's (in place of the head input itself,
    # which an unfused head keeps for its weight gradient) and the tied weight's
    assert by_loss == 4 * (tokens * width + CONFIG.vocab * width)
    eager = kept_for_backward(model, *batch) - kept_for_backward(trunk, *batch)
    assert eager >= 4 * tokens * (CONFIG.vocab + width)  # the log-probabilities and the head input


def probabilities(shape=(ROWS, VOCAB), seed=1, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(shape, generator=g), -1).requires_grad_(requires_grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.kernels("soft_cross_entropy:forward", "soft_cross_entropy:backward")
def test_probability_targets_fuse_with_their_gradient(impl, reduction, smoothing):
    def loss(x, p):
        return F.cross_entropy(x, p, label_smoothing=smoothing, reduction=reduction)

    logits, _ = logits_and_targets()
    check_fusion(loss, [logits, probabilities(requires_grad=True)], counts={"loss": 1})


class Distilled(nn.Module):
    """A student's loss against a teacher's softened probabilities, both learning."""

    def __init__(self):
        super().__init__()
        self.student, self.teacher = nn.Linear(WIDTH, VOCAB), nn.Linear(WIDTH, VOCAB)

    def forward(self, hidden):
        target = torch.softmax(self.teacher(hidden) / 2.0, dim=-1)
        return F.cross_entropy(self.student(hidden).float() * 0.5, target)


@pytest.mark.kernels("soft_cross_entropy:forward", "soft_cross_entropy:backward")
def test_a_distillation_loss_fuses_and_trains_both_models(impl):
    """Each head's loss reads the other head's logits, which need a gradient: neither is
    chunked, each says so, and the loss fuses over the built logits."""
    torch.manual_seed(0)
    check_fusion(
        Distilled(), [torch.randn(ROWS, WIDTH)], counts={"loss": 1},
        missed=["the loss reads mul, which needs a gradient",
                "the loss reads softmax, which needs a gradient"],
    )  # fmt: skip


def test_probability_targets_the_fused_loss_cannot_take_are_reported():
    logits = torch.randn(2, VOCAB, 5, requires_grad=True)
    check_fusion(
        F.cross_entropy, [logits, probabilities((2, VOCAB, 5))], counts={"loss": 0},
        missed=["rank 3"],
    )  # fmt: skip


def test_a_linear_before_probability_targets_joins_it_in_chunks():
    head = nn.Linear(WIDTH, VOCAB)

    def loss(hidden, p):
        return F.cross_entropy(head(hidden), p)

    report = check_fusion(
        loss, [torch.randn(ROWS, WIDTH, requires_grad=True), probabilities()], counts={"loss": 1}
    )
    assert any("linear_row_loss" in site for site in report.sites), report.sites


def test_logits_with_no_tensor_recorded_are_refused_not_crashed_on():
    """The reading asks for the logits' rank: a node whose value is not a tensor is refused (it
    read the rank of None)."""
    gm = trace_function(lambda x, t: F.cross_entropy(x, t), logits_and_targets(), "the loss")
    (loss,) = gm.graph.find_nodes(
        op="call_function", target=torch.ops.aten.cross_entropy_loss.default
    )
    del loss.args[0].meta["val"]
    found = LossPattern().find(loss, ctx=None)  # (a refusal is answered before the context is read)
    assert isinstance(found, Reject) and found.reason.startswith("logits not a tensor")
