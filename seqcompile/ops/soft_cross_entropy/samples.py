"""Sample inputs of `seqfast::soft_cross_entropy`, with eager's `F.cross_entropy` on probability
targets as their answer."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from seqcompile.ops.cross_entropy.samples import CLASSES, ROWS
from seqcompile.ops.samples import Sample, generator, randn

Tensor = torch.Tensor


def soft_cross_entropy_eager(logits, target, smoothing, **_) -> tuple[Tensor]:
    """Each row's loss against its probability targets."""
    return (F.cross_entropy(logits, target, reduction="none", label_smoothing=smoothing),)


def _soft(name, g, rows=ROWS, classes=CLASSES, *, smoothing=0.0, target_grad=False) -> Sample:
    logits = randn(g, rows, classes, scale=2.0)
    target = torch.softmax(randn(g, rows, classes), dim=-1)
    args = dict(logits=logits, target=target, smoothing=smoothing)
    grads = ("logits", "target") if target_grad else ("logits",)
    return Sample(name, args, soft_cross_entropy_eager, grads=grads)


def samples() -> Iterator[Sample]:
    """The base samples of `seqfast::soft_cross_entropy`, every tensor contiguous: targets that
    sum to 1 and that do not, a differentiable target (a student's loss against a teacher that
    learns), NaN and +-inf logits."""
    g = generator(5)
    yield _soft("plain", g)
    yield _soft("smoothing-target-grad", g, smoothing=0.1, target_grad=True)
    yield _soft("rows0", g, rows=0, target_grad=True)
    yield _soft("rows1", g, rows=1)
    yield _soft("classes1", g, classes=1)
    yield _soft("classes0", g, classes=0, smoothing=0.1)
    yield _soft("over-a-block", g, rows=3, classes=4099, smoothing=0.1, target_grad=True)
    sample = _soft("unnormalized-targets", g, target_grad=True)
    sample.args["target"].mul_(torch.arange(ROWS).unsqueeze(1))  # row 0: all zero
    yield sample
    sample = _soft("one-hot-neg-inf-logits", g, target_grad=True)
    sample.args["target"].zero_()[:, 4] = 1.0
    sample.args["logits"][2, [0, 9]] = -math.inf  # under a zero target: NaN, as in eager
    yield sample
    for name, value in (("nan", math.nan), ("inf", math.inf)):
        sample = _soft(f"{name}-logit", g)
        sample.args["logits"][4, 3] = value
        yield sample
