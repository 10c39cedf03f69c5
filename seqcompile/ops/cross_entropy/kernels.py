"""The generated kernel of `seqfast::cross_entropy` (one template, three modes) and its
launchers."""

from __future__ import annotations

import torch
import triton

from seqcompile.codegen import KernelSpec, kernel_function
from seqcompile.ops.cross_entropy import reference
from seqcompile.run import copies, runtime

Tensor = torch.Tensor

MAX_BLOCK_V = 4096
"""Vocabulary entries a program reads per step."""


def spec(mode: str, smoothing: float) -> KernelSpec:
    """`forward` (loss, lse), `backward` (gradient of the logits) or `forward_grad` (loss, lse,
    then the gradient written over the logits), with or without label smoothing."""
    return KernelSpec.of("cross_entropy", mode=mode, smoothing=smoothing > 0)


def _block(vocab: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(vocab, 1)), MAX_BLOCK_V)
    return block, 8 if block >= 2048 else 4


def rows(logits: Tensor) -> Tensor:
    """`logits` with a contiguous vocabulary dimension (a copy only when it is strided)."""
    return (
        logits if logits.stride(-1) == 1 else copies.for_kernel(logits, "cross_entropy", "logits")
    )


def _launch(mode: str, logits: Tensor, target: Tensor, *tensors: Tensor, ignore_index, smoothing):
    """Launch one program per row. The kernels read the logits' rows, the targets and, in the
    backward, the log-sum-exp and incoming gradients through their strides (views, a column of
    pairs, an expanded scalar gradient); what they write (loss, lse, gradient) is contiguous, as
    the callers allocate it."""
    m, vocab = logits.shape
    if m == 0:
        return
    block, warps = _block(vocab)
    strides = [logits.stride(0), target.stride(0)]
    if mode == "backward":
        lse, grad = tensors[0], tensors[1]
        strides += [lse.stride(0), grad.stride(0)]
    kernel_function(spec(mode, smoothing))[(m,)](
        logits, target, *tensors, vocab, *strides, ignore_index, smoothing,
        BLOCK_V=block, num_warps=warps,
    )  # fmt: skip


def loss_and_grad_in_place(
    logits: Tensor, target: Tensor, scale: Tensor, ignore_index: int, smoothing: float
) -> tuple[Tensor, Tensor]:
    """Each row's loss and log-sum-exp; then `logits` (contiguous rows) is overwritten with the
    gradient of the rows' losses, each weighted by `scale` (a float32 0-d tensor)."""
    m = logits.shape[0]
    if logits.shape[1] == 0:
        return reference.over_no_classes(m, smoothing, logits.device)
    if runtime.use_kernels(logits):
        loss = runtime.empty((m,), torch.float32, logits.device)
        lse = runtime.empty((m,), torch.float32, logits.device)
        _launch(
            "forward_grad", logits, target, loss, lse, scale,
            ignore_index=ignore_index, smoothing=smoothing,
        )  # fmt: skip
        return loss, lse
    loss, lse = reference.forward(logits, target, ignore_index, smoothing)
    grad = scale.expand(m)
    logits.copy_(reference.logits_grad(logits, target, lse, grad, ignore_index, smoothing))
    return loss, lse


def forward(*, logits: Tensor, target: Tensor, ignore_index: int, smoothing: float, **_):
    """Each row's loss and log-sum-exp through the forward kernel (rows and classes at least 1)."""
    m = logits.shape[0]
    loss = runtime.empty((m,), torch.float32, logits.device)
    lse = runtime.empty((m,), torch.float32, logits.device)
    _launch(
        "forward", rows(logits), target, loss, lse, ignore_index=ignore_index, smoothing=smoothing
    )
    return loss, lse


def write_grad(out: Tensor, *, grad, logits, target, lse, ignore_index, smoothing, **_) -> None:
    """Write the gradient of the logits into `out` (contiguous; it may be `logits` itself: each
    element is read before it is written, by the program that writes it), from the backward's
    arguments by name."""
    if logits.numel() == 0:  # no rows or no classes: no gradient to write
        return
    if not runtime.use_kernels(logits):
        out.copy_(reference.logits_grad(logits, target, lse, grad, ignore_index, smoothing))
        return
    _launch(
        "backward", rows(logits), target, lse, grad, out,
        ignore_index=ignore_index, smoothing=smoothing,
    )  # fmt: skip
