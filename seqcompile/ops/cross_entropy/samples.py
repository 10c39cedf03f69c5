"""Sample inputs of `seqfast::cross_entropy`, with eager's `F.cross_entropy` as their answer: rows
and classes 0, 1, odd and past one block, label smoothing, ignored and all-ignored targets, NaN and
+-inf logits. (int32 targets, which eager refuses, never reach the op: the loss pattern leaves them
to eager.)"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from seqcompile.ops.samples import Sample, generator, randn

Tensor = torch.Tensor
IGNORE = -100
ROWS, CLASSES, FEATURES = 7, 37, 9


def targets(g, rows: int, classes: int, *, ignored: int = 2) -> Tensor:
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
    args = dict(logits=logits, target=targets(g, rows, classes), ignore_index=IGNORE,
                smoothing=smoothing)  # fmt: skip
    args.update(edits)
    return Sample(name, args, cross_entropy_eager, grads=("logits",))


def samples() -> Iterator[Sample]:
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
