"""A loss the family does not fuse says so: every ATen loss op other than cross-entropy, and
every sum over log-probabilities that reaches the loss without being a cross-entropy, has one
line in the report, and the step matches eager. Log-probabilities that feed more of the model,
and a loss the row-wise loss chunks, add none."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion
from torch import nn

ROWS, CLASSES = 6, 7


def rand(*shape, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).requires_grad_(grad)


def probabilities(seed=1):
    return F.softmax(rand(ROWS, CLASSES, seed=seed, grad=False), -1)


def labels(seed=2):
    return torch.randint(2, (ROWS, CLASSES), generator=torch.Generator().manual_seed(seed))


def classes(seed=3):
    return torch.randint(CLASSES, (ROWS,), generator=torch.Generator().manual_seed(seed))


LOSS_OPS = {
    "kl_div": (
        lambda x, p: F.kl_div(F.log_softmax(x, -1), p, reduction="batchmean"),
        probabilities,
    ),
    "mse_loss": (F.mse_loss, probabilities),
    "l1_loss": (F.l1_loss, probabilities),
    "smooth_l1_loss": (F.smooth_l1_loss, probabilities),
    "huber_loss": (lambda x, y: F.huber_loss(x, y, delta=0.5), probabilities),
    "binary_cross_entropy_with_logits": (
        lambda x, y: F.binary_cross_entropy_with_logits(x, y.float()),
        labels,
    ),
    "binary_cross_entropy": (lambda x, y: F.binary_cross_entropy(x.sigmoid(), y.float()), labels),
    "soft_margin_loss": (lambda x, y: F.soft_margin_loss(x, 2.0 * y - 1), labels),
    "multi_margin_loss": (F.multi_margin_loss, classes),
}
"""Each loss op, and the name the report gives it."""

DEFAULT_TIER = {"kl_div", "binary_cross_entropy_with_logits"}


@pytest.mark.parametrize(
    "name",
    [n if n in DEFAULT_TIER else pytest.param(n, marks=pytest.mark.slow) for n in sorted(LOSS_OPS)],
)
def test_a_loss_op_the_kernels_do_not_compute_has_its_line(name):
    loss, other = LOSS_OPS[name]
    check_fusion(
        loss, [rand(ROWS, CLASSES), other()], counts={"loss": 0},
        missed=[f"{name} is not read as a loss"],
    )  # fmt: skip


def z_loss(x, t):
    return torch.logsumexp(x, -1).pow(2).mean()


def entropy(x, t):
    """The entropy of the predictions (a confidence penalty), through a `log` of the softmax."""
    p = F.softmax(x, -1)
    return (p * p.clamp(min=1e-9).log()).sum(-1).mean()


def kl_written_out(x, t):
    return (t * (t.log() - F.log_softmax(x, -1))).sum(-1).mean()


LOG_PROBABILITY_SUMS = {
    "z-loss": (z_loss, "log-probabilities of logsumexp"),
    "entropy": (entropy, "log-probabilities of log "),
    "kl-written-out": (kl_written_out, "log-probabilities of log_softmax"),
}


@pytest.mark.parametrize(
    "name",
    [n if n == "z-loss" else pytest.param(n, marks=pytest.mark.slow) for n in LOG_PROBABILITY_SUMS],
)
def test_a_sum_over_log_probabilities_that_is_no_cross_entropy_has_its_line(name):
    loss, said = LOG_PROBABILITY_SUMS[name]
    report = check_fusion(
        loss, [rand(ROWS, CLASSES), probabilities()], counts={"loss": 0}, missed=[said]
    )
    assert "reaches the loss but is no cross-entropy" in report.missed[0].reason


def test_a_cross_entropy_beside_it_fuses_and_the_rest_has_its_line():
    def loss(x, t):
        return F.cross_entropy(x, t) + 1e-4 * z_loss(x, t)

    check_fusion(loss, [rand(ROWS, CLASSES), classes()], counts={"loss": 1}, missed=["logsumexp"])


def test_log_probabilities_that_feed_more_of_the_model_have_no_line():
    """A matmul after them: not a loss over rows (the check fails on any refusal)."""
    w = rand(CLASSES, 3, seed=4)

    def fn(x):
        return (F.log_softmax(x, -1) @ w).tanh().sum()

    check_fusion(fn, [rand(ROWS, CLASSES)], counts={"loss": 0})


@pytest.mark.slow
def test_a_divergence_after_a_linear_is_chunked_without_a_line():
    head = nn.Linear(5, CLASSES)

    def fn(h, p):
        return F.kl_div(F.log_softmax(head(h), -1), p, reduction="batchmean")

    report = check_fusion(fn, [rand(ROWS, 5), probabilities()], counts={"loss": 1})
    assert any("linear_row_loss" in site for site in report.sites), report.sites
