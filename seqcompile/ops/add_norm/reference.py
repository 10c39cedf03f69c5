"""Reference implementation of the fused residual + normalization (`seqfast::add_norm` and its
backward) in plain ATen: the test oracle and what runs on CPU tensors. Computes in float32 and
draws dropout masks from the same Philox numbers as the kernels (numbered by rows).

    sum = residual + dropout(x + branch_bias, p)        rounded to `sum_dtype`
    out = norm(sum) * weight + bias                      LayerNorm or RMSNorm over the last dim
"""

from __future__ import annotations

import math

import torch

from seqcompile.ops.random import keep_mask_by_rows

Tensor = torch.Tensor


def has_prologue(residual: Tensor | None, branch_bias: Tensor | None, p: float) -> bool:
    return residual is not None or branch_bias is not None or p > 0


def needs_residual_grad(p: float, x_dtype: torch.dtype, residual_dtype: torch.dtype) -> bool:
    """Whether the residual's gradient differs from the branch's (otherwise one tensor serves)."""
    return p > 0 or x_dtype != residual_dtype


def grad_shapes(
    *, saved, weight, x_dtype, residual_dtype, bias_dtype, branch_bias_dtype, p, **_
) -> tuple:
    """(shape, dtype) of each output of the backward, from its arguments by name; shape (0,) marks
    an absent one."""
    n = saved.shape[-1]
    residual_grad = residual_dtype is not None and needs_residual_grad(p, x_dtype, residual_dtype)
    return (
        (saved.shape, x_dtype),
        (saved.shape if residual_grad else (0,), residual_dtype or x_dtype),
        ((n,), weight.dtype) if weight is not None else ((0,), x_dtype),
        ((n,), bias_dtype) if bias_dtype is not None else ((0,), x_dtype),
        ((n,), branch_bias_dtype) if branch_bias_dtype is not None else ((0,), x_dtype),
    )


def _sum(x: Tensor, *, residual, branch_bias, seed, stream, p, sum_dtype, **_) -> Tensor:
    """`residual + dropout(x + branch_bias)` rounded to `sum_dtype`."""
    s = x.float()
    if branch_bias is not None:
        s = s + branch_bias.float()
    if p > 0:
        s = torch.where(keep_mask_by_rows(seed, x.shape, stream, p), s / (1.0 - p), 0.0)
    if residual is not None:
        s = s + residual.float()
    return s.to(sum_dtype)


def _normalize(s: Tensor, eps: float, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (xhat, mean, rstd) of the float32 rows of `s`; `mean` is empty for RMSNorm."""
    if rms:
        rstd = torch.rsqrt(s.square().mean(-1) + eps)
        return s * rstd.unsqueeze(-1), s.new_empty((0,)), rstd
    mean = s.mean(-1)
    centered = s - mean.unsqueeze(-1)
    rstd = torch.rsqrt(centered.square().mean(-1) + eps)
    return centered * rstd.unsqueeze(-1), mean, rstd


def forward(*, x, weight, bias, eps, rms, out_dtype, **summed) -> tuple[Tensor, ...]:
    """The forward on the op's arguments by name (`summed`: those the sum reads)."""
    # contiguous inputs give contiguous outputs, as the fake implementation promises
    x = x.contiguous()
    residual = summed["residual"]
    summed["residual"] = residual.contiguous() if residual is not None else None
    if has_prologue(summed["residual"], summed["branch_bias"], summed["p"]):
        total = _sum(x, **summed)
        normalized = total
    else:
        total, normalized = x.new_empty((0,), dtype=summed["sum_dtype"]), x
    y, mean, rstd = _normalize(normalized.float(), eps, rms)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype), total, mean, rstd


def backward(
    *, grad_out, grad_sum, saved, mean, rstd, weight, seed, stream, p, rms, **dtypes
) -> tuple[Tensor, ...]:
    """The backward on the op's arguments by name (`dtypes`: those of the forward's tensors)."""
    n = saved.shape[-1]
    rows = math.prod(saved.shape[:-1])  # (-1 is ambiguous at width 0)
    s = saved.reshape(rows, n).float()
    mean = mean.reshape(rows, 1) if not rms else None
    rstd = rstd.reshape(rows, 1)
    xhat = s * rstd if rms else (s - mean) * rstd
    dy = grad_out.reshape(rows, n).float()
    g = dy * weight.float() if weight is not None else dy
    ds = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not rms:
        ds = ds - g.mean(-1, keepdim=True)
    ds = ds * rstd
    if grad_sum is not None:
        ds = ds + grad_sum.reshape(rows, n).float()
    dx = ds
    if p > 0:
        dx = torch.where(keep_mask_by_rows(seed, s.shape, stream, p), ds / (1.0 - p), 0.0)
    shapes = grad_shapes(saved=saved, weight=weight, p=p, **dtypes)
    values = (dx, ds, (dy * xhat).sum(0), dy.sum(0), dx.sum(0))
    return tuple(
        v.reshape(shape).to(dtype) if shape != (0,) else saved.new_empty((0,), dtype=dtype)
        for v, (shape, dtype) in zip(values, shapes, strict=True)
    )
