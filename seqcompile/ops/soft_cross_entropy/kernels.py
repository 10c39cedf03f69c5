"""The generated kernel of `seqfast::soft_cross_entropy` (one template, two modes) and its
launchers, taking the ops' arguments by name."""

from __future__ import annotations

import torch
import triton

from seqcompile.codegen import KernelSpec, kernel_function
from seqcompile.run import copies, runtime

Tensor = torch.Tensor
MAX_BLOCK_V = 4096
"""Classes a program reads per step."""


def spec(mode: str, target_grad: bool = False) -> KernelSpec:
    """`forward` (loss, lse, mass) or `backward` (the gradient of the logits, and of the targets
    when `target_grad`)."""
    if mode == "forward":
        return KernelSpec.of("soft_cross_entropy", mode=mode)
    return KernelSpec.of("soft_cross_entropy", mode=mode, target_grad=target_grad)


def _block(classes: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(max(classes, 1)), MAX_BLOCK_V)
    return block, 8 if block >= 2048 else 4


def _rows(logits: Tensor) -> Tensor:
    """`logits` with contiguous classes (a copy only when they are strided); the targets are read
    through both their strides."""
    if logits.stride(-1) == 1:
        return logits
    return copies.for_kernel(logits, "soft_cross_entropy", "logits")


def _launch(spec_: KernelSpec, logits: Tensor, target: Tensor, tensors: list, strides: list, *,
            smoothing: float) -> None:  # fmt: skip
    """One program per row over (rows, classes) with at least one of each."""
    m, classes = logits.shape
    block, warps = _block(classes)
    kernel_function(spec_)[(m,)](
        logits, target, *tensors, classes, logits.stride(0), target.stride(0), target.stride(1),
        *strides, smoothing, BLOCK_V=block, num_warps=warps,
    )  # fmt: skip


def forward(*, logits: Tensor, target: Tensor, smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's loss, log-sum-exp and target mass (rows and classes at least 1)."""
    m = logits.shape[0]
    loss, lse, mass = (runtime.empty((m,), torch.float32, logits.device) for _ in range(3))
    _launch(spec("forward"), _rows(logits), target, [lse, mass, loss], [], smoothing=smoothing)
    return loss, lse, mass


def backward(
    *, grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, mass: Tensor, **how
) -> tuple[Tensor, Tensor]:
    """The gradients of the logits and (when `target_grad`; else an empty tensor) of the targets
    (rows and classes at least 1), from the backward's arguments by name (`how`: the smoothing
    and whether the targets want a gradient)."""
    smoothing, target_grad = how["smoothing"], how["target_grad"]
    dlogits = runtime.empty(tuple(logits.shape), logits.dtype, logits.device)
    shape = tuple(target.shape) if target_grad else (0,)
    dtarget = runtime.empty(shape, target.dtype, target.device)
    tensors = [lse, mass, grad, dlogits, *([dtarget] if target_grad else [])]
    strides = [lse.stride(0), mass.stride(0), grad.stride(0)]
    _launch(spec("backward", target_grad), _rows(logits), target, tensors, strides,
            smoothing=smoothing)  # fmt: skip
    return dlogits, dtarget
