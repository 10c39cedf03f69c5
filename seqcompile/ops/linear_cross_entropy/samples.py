"""Sample inputs of `seqfast::linear_cross_entropy`, with eager's `F.cross_entropy` after
`F.linear` as their answer: rows, classes and features 0, 1 and odd, with and without a bias, mean
and sum, ignored targets, -inf biases and a NaN row."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from seqcompile.ops.cross_entropy.samples import CLASSES, FEATURES, IGNORE, ROWS, targets
from seqcompile.ops.samples import Sample, generator, randn

Tensor = torch.Tensor


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
        bias=randn(g, classes) if bias else None, target=targets(g, rows, classes),
        ignore_index=IGNORE, smoothing=smoothing, mean=mean, chunk=chunk,
        compute_dtype=torch.float32, needs_grad=[True, True, bias],
    )  # fmt: skip
    args.update(edits)
    grads = ("hidden", "weight") + (("bias",) if bias else ())
    return Sample(name, args, linear_cross_entropy_eager, grads=grads)


def samples() -> Iterator[Sample]:
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
