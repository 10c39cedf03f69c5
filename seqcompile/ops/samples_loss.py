"""Sample inputs of `seqfast::cross_entropy`, `seqfast::linear_cross_entropy` and
`seqfast::soft_cross_entropy`, with eager's `F.cross_entropy` (after `F.linear`; with probability
targets) as their answer: rows and classes 0, 1, odd and past one block, label smoothing, ignored
and all-ignored targets, NaN and +-inf logits. (int32 targets, which eager refuses, never reach the
ops: the loss pattern leaves them to eager.)"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from seqcompile.ops.samples import Sample, generator, randn

Tensor = torch.Tensor
IGNORE = -100
ROWS, CLASSES, FEATURES = 7, 37, 9


def _targets(g, rows: int, classes: int, *, ignored: int = 2) -> Tensor:
    """Random classes, the first `ignored` rows (every other row from the second) ignored."""
    target = torch.randint(0, max(classes, 1), (rows,), generator=g)
    target[1 : 2 * ignored : 2] = IGNORE
    return target


def cross_entropy_eager(logits, target, ignore_index, smoothing, **_) -> tuple[Tensor]:
    """Each row's loss, 0 where the target is ignored."""
    return (
        F.cross_entropy(
            logits, target, ignore_index=ignore_index, reduction="none", label_smoothing=smoothing
        ),
    )


def _cross_entropy(name, g, rows=ROWS, classes=CLASSES, smoothing=0.0, **edits) -> Sample:
    logits = randn(g, rows, classes, scale=2.0)
    args = dict(logits=logits, target=_targets(g, rows, classes), ignore_index=IGNORE,
                smoothing=smoothing)  # fmt: skip
    args.update(edits)
    return Sample(name, args, cross_entropy_eager, grads=("logits",))


def cross_entropy_samples() -> Iterator[Sample]:
    """The base samples of `seqfast::cross_entropy`, every tensor contiguous."""
    g = generator(3)
    yield _cross_entropy("plain", g)
    yield _cross_entropy("smoothing", g, smoothing=0.1)
    yield _cross_entropy("rows0", g, rows=0)
    yield _cross_entropy("rows1", g, rows=1)
    yield _cross_entropy("classes1", g, classes=1)
    yield _cross_entropy("classes0-all-ignored", g, classes=0, target=torch.full((ROWS,), IGNORE))
    yield _cross_entropy("over-a-block", g, rows=3, classes=4099, smoothing=0.1)
    yield _cross_entropy("all-ignored", g, target=torch.full((ROWS,), IGNORE), smoothing=0.1)
    for smoothing in (0.0, 0.1):
        sample = _cross_entropy(f"neg-inf-logits-smoothing{smoothing}", g, smoothing=smoothing)
        target = int(sample.args["target"][2])  # (row 2 is not ignored)
        sample.args["logits"][2, [(target + 1) % CLASSES, (target + 5) % CLASSES]] = -math.inf
        yield sample
    for name, value in (("nan", math.nan), ("inf", math.inf)):
        sample = _cross_entropy(f"{name}-logit", g)
        sample.args["logits"][4, 3] = value
        yield sample


def linear_cross_entropy_eager(
    hidden, weight, bias, target, ignore_index, smoothing, mean, **_
) -> tuple[Tensor]:
    """The loss over the rows: their mean over the targets not ignored, or their sum."""
    return (
        F.cross_entropy(
            F.linear(hidden, weight, bias), target, ignore_index=ignore_index,
            reduction="mean" if mean else "sum", label_smoothing=smoothing,
        ),
    )  # fmt: skip


def _linear(name, g, rows=ROWS, classes=CLASSES, features=FEATURES, *, bias=True, mean=True,
            chunk=3, smoothing=0.0, **edits) -> Sample:  # fmt: skip
    args = dict(
        hidden=randn(g, rows, features), weight=randn(g, classes, features, scale=0.5),
        bias=randn(g, classes) if bias else None, target=_targets(g, rows, classes),
        ignore_index=IGNORE, smoothing=smoothing, mean=mean, chunk=chunk,
        compute_dtype=torch.float32, needs_grad=[True, True, bias],
    )  # fmt: skip
    args.update(edits)
    grads = ("hidden", "weight") + (("bias",) if bias else ())
    return Sample(name, args, linear_cross_entropy_eager, grads=grads)


def linear_cross_entropy_samples() -> Iterator[Sample]:
    """The base samples of `seqfast::linear_cross_entropy`, every tensor contiguous."""
    g = generator(4)
    yield _linear("mean", g)
    yield _linear("sum-without-bias", g, bias=False, mean=False, chunk=0, smoothing=0.1)
    yield _linear("rows0", g, rows=0)
    yield _linear("rows1", g, rows=1)
    yield _linear("classes1", g, classes=1)
    yield _linear("features1", g, features=1)
    yield _linear("all-ignored", g, target=torch.full((ROWS,), IGNORE))
    sample = _linear("neg-inf-bias", g)
    untargeted = sorted(set(range(CLASSES)) - set(sample.args["target"].tolist()))
    sample.args["bias"][untargeted[:2]] = -math.inf  # classes no row targets: a finite loss
    yield sample
    sample = _linear("nan-hidden-row", g)
    sample.args["hidden"][3] = math.nan
    yield sample


def soft_cross_entropy_eager(logits, target, smoothing, **_) -> tuple[Tensor]:
    """Each row's loss against its probability targets."""
    return (F.cross_entropy(logits, target, reduction="none", label_smoothing=smoothing),)


def _soft(name, g, rows=ROWS, classes=CLASSES, *, smoothing=0.0, target_grad=False) -> Sample:
    logits = randn(g, rows, classes, scale=2.0)
    target = torch.softmax(randn(g, rows, classes), dim=-1)
    args = dict(logits=logits, target=target, smoothing=smoothing)
    grads = ("logits", "target") if target_grad else ("logits",)
    return Sample(name, args, soft_cross_entropy_eager, grads=grads)


def soft_cross_entropy_samples() -> Iterator[Sample]:
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
