"""Sample inputs of `seqfast::add_norm` and the eager composition that defines its answer:
LayerNorm and RMSNorm with and without what they add first, rows and widths 0, 1 and odd, and
non-finite values in one row of each operand."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from seqcompile.ops.samples import Sample, generator, randn

Tensor = torch.Tensor
BASE = dict(batch=3, length=5, width=33)
"""Odd rows in two dimensions and an odd width between two powers of two."""


def eager(x, residual, branch_bias, weight, bias, eps, rms, **_) -> tuple[Tensor, ...]:
    """The normalized sum and, where something is added to `x`, the sum itself."""
    total = x if branch_bias is None else x + branch_bias
    total = total if residual is None else residual + total
    width = (x.shape[-1],)
    if rms:
        out = F.rms_norm(total, width, weight, eps)
    else:
        out = F.layer_norm(total, width, weight, bias, eps)
    return (out, total) if total is not x else (out,)


def _sample(name: str, g, batch, length, width, *, rms=False, adds=True, affine=True) -> Sample:
    shape = (batch, length, width)
    args = dict(
        x=randn(g, *shape, scale=2.0) + 0.5,
        residual=randn(g, *shape) if adds else None,
        branch_bias=randn(g, width) if adds else None,
        weight=randn(g, width) + 1.0 if affine else None,
        bias=randn(g, width) if affine and not rms else None,
        seed=None, stream=0, p=0.0, eps=1e-5, rms=rms, out_dtype=torch.float32,
        sum_dtype=torch.float32,
    )  # fmt: skip
    operands = ("x", "residual", "branch_bias", "weight", "bias")
    grads = tuple(name for name in operands if args[name] is not None)
    return Sample(name, args, eager, grads=grads, outputs=(0, 1) if adds else (0,))


def samples() -> Iterator[Sample]:
    """The base samples, every tensor contiguous."""
    g = generator(1)
    yield _sample("layer-norm", g, **BASE)
    yield _sample("rms-norm", g, **BASE, rms=True)
    yield _sample("layer-norm-of-x", g, **BASE, adds=False, affine=False)
    yield _sample("rms-norm-of-x", g, **BASE, rms=True, adds=False)
    for dim in BASE:
        for size in (0, 1):
            yield _sample(f"layer-norm-{dim}{size}", g, **{**BASE, dim: size})
    yield _sample("rms-norm-width1", g, **{**BASE, "width": 1}, rms=True)
    yield _sample("wide", g, batch=1, length=3, width=1025)
    for name, operand, value in (
        ("nan-x-row", "x", math.nan), ("inf-residual-row", "residual", math.inf),
        ("neg-inf-x-row", "x", -math.inf),
    ):  # fmt: skip
        sample = _sample(name, g, **BASE)
        sample.args[operand][1, 2] = value
        yield sample
