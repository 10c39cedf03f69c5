"""The fused cross-entropy against probability targets `seqfast::soft_cross_entropy` and its
backward `seqfast::soft_cross_entropy_backward`: schema, fake implementation, reference, kernel
launch, autograd.

    soft_cross_entropy(logits (M, V), target (M, V), smoothing) -> (loss (M,), lse (M,), mass (M,))

returns each row's loss, log-sum-exp and target mass (the sum of its smoothed targets) in float32,
reading the logits and targets in their own dtypes; `F.cross_entropy` with probability targets
(soft labels, mixup, a teacher's probabilities) is this loss plus its reduction. The backward saves
the logits, the targets and the two per-row statistics, never a softmax, and writes the gradient
of the logits, and of the targets when they require one, in one pass.
"""

from __future__ import annotations

import torch
import triton

from seqcompile.codegen import KernelSpec, copies, kernel_function
from seqcompile.ops import samples_loss, sharding_rules
from seqcompile.ops.fused_op import Call, FusedOp, gradients, named, needs_grad
from seqcompile.run import runtime

Tensor = torch.Tensor
MAX_BLOCK_V = 4096
"""Classes a program reads per step."""


def spec(mode: str, target_grad: bool = False) -> KernelSpec:
    """`forward` (loss, lse, mass) or `backward` (the gradient of the logits, and of the targets
    when `target_grad`)."""
    if mode == "forward":
        return KernelSpec.of("soft_cross_entropy", mode=mode)
    return KernelSpec.of("soft_cross_entropy", mode=mode, target_grad=target_grad)


def _smoothed(target: Tensor, smoothing: float) -> Tensor:
    return (1.0 - smoothing) * target.float() + smoothing / max(target.shape[-1], 1)


# --------------------------------------------------------------------------------------------
# reference


def reference_rows(logits: Tensor, target: Tensor, smoothing: float) -> tuple[Tensor, ...]:
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    # eager's log_softmax subtracts the row's maximum, so a +inf logit makes the row NaN
    lse = lse.masked_fill(lse == float("inf"), float("nan"))
    t = _smoothed(target, smoothing)
    loss = (t * (lse.unsqueeze(1) - x)).sum(-1)
    return loss, lse, t.sum(-1)


def reference_grads(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, mass: Tensor, smoothing: float,
    target_grad: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    x, g = logits.float(), grad.float().unsqueeze(1)
    shift = lse.unsqueeze(1)
    dlogits = g * (mass.unsqueeze(1) * torch.exp(x - shift) - _smoothed(target, smoothing))
    dtarget = g * (1.0 - smoothing) * (shift - x) if target_grad else x.new_empty(0)
    return dlogits.to(logits.dtype), dtarget.to(target.dtype)


def lower_backward(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, mass: Tensor, smoothing: float,
    target_grad: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`soft_cross_entropy_backward` on CPU in plain ATen (the registry's lowering, and the op's
    own CPU path): the reference's gradients, contiguous as the fake implementation makes them."""
    grads = reference_grads(grad, logits, target, lse, mass, smoothing, target_grad)
    return grads[0].contiguous(), grads[1].contiguous()


# --------------------------------------------------------------------------------------------
# kernels


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


# --------------------------------------------------------------------------------------------
# operators


@torch.library.custom_op("seqfast::soft_cross_entropy", mutates_args=())
def soft_cross_entropy(
    logits: Tensor, target: Tensor, smoothing: float
) -> tuple[Tensor, Tensor, Tensor]:
    if logits.dim() != 2 or target.shape != logits.shape:
        raise ValueError(
            "seqfast::soft_cross_entropy: logits and target must both be (rows, classes); got"
            f" {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if logits.numel() == 0 or not runtime.use_kernels(logits):
        return reference_rows(logits, target, smoothing)
    m = logits.shape[0]
    loss, lse, mass = (runtime.empty((m,), torch.float32, logits.device) for _ in range(3))
    _launch(spec("forward"), _rows(logits), target, [lse, mass, loss], [], smoothing=smoothing)
    return loss, lse, mass


@soft_cross_entropy.register_fake
@named(torch.ops.seqfast.soft_cross_entropy.default)
def _(call: Call):
    m = call["logits"].shape[0]
    return tuple(call["logits"].new_empty((m,), dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("seqfast::soft_cross_entropy_backward", mutates_args=())
def soft_cross_entropy_backward(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, mass: Tensor, smoothing: float,
    target_grad: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The gradients of the logits and (when `target_grad`; else an empty tensor) of the
    targets, each in its input's dtype, for incoming per-row gradients `grad`."""
    if logits.numel() == 0 or not runtime.use_kernels(logits):
        return lower_backward(grad, logits, target, lse, mass, smoothing, target_grad)
    dlogits = runtime.empty(tuple(logits.shape), logits.dtype, logits.device)
    shape = tuple(target.shape) if target_grad else (0,)
    dtarget = runtime.empty(shape, target.dtype, target.device)
    tensors = [lse, mass, grad, dlogits, *([dtarget] if target_grad else [])]
    strides = [lse.stride(0), mass.stride(0), grad.stride(0)]
    _launch(spec("backward", target_grad), _rows(logits), target, tensors, strides,
            smoothing=smoothing)  # fmt: skip
    return dlogits, dtarget


@soft_cross_entropy_backward.register_fake
@named(torch.ops.seqfast.soft_cross_entropy_backward.default)
def _(call: Call):
    dlogits = torch.empty_like(call["logits"], memory_format=torch.contiguous_format)
    target = call["target"]
    if not call["target_grad"]:
        return dlogits, target.new_empty(0)
    return dlogits, torch.empty_like(target, memory_format=torch.contiguous_format)


OP = torch.ops.seqfast.soft_cross_entropy.default


def _setup_context(ctx, inputs, output):
    call = Call(OP, inputs, {})
    _loss, lse, mass = output
    ctx.mark_non_differentiable(lse, mass)
    ctx.save_for_backward(call["logits"], call["target"], lse, mass)
    ctx.smoothing = call["smoothing"]
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, _grad_lse, _grad_mass):
    wanted = {name: needs_grad(ctx, OP, name) for name in ("logits", "target")}
    if grad_loss is None or not any(wanted.values()):
        return gradients(OP)
    logits, target, lse, mass = ctx.saved_tensors
    dlogits, dtarget = torch.ops.seqfast.soft_cross_entropy_backward(
        grad_loss, logits, target, lse, mass, ctx.smoothing, bool(wanted["target"])
    )
    return gradients(
        OP,
        logits=dlogits if wanted["logits"] else None,
        target=dtarget if wanted["target"] else None,
    )


soft_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


ENTRY = FusedOp(
    name="soft_cross_entropy",
    family="loss",
    forward=OP,
    backward=(torch.ops.seqfast.soft_cross_entropy_backward.default,),
    reference=reference_rows,
    lowering={
        OP: reference_rows,
        torch.ops.seqfast.soft_cross_entropy_backward.default: lower_backward,
    },
    kernels={
        OP: lambda call: [spec("forward")],
        torch.ops.seqfast.soft_cross_entropy_backward.default: lambda call: [
            spec("backward", call["target_grad"])
        ],
    },
    sharding={
        op: sharding_rules.rows_everywhere("logits")
        for op in (OP, torch.ops.seqfast.soft_cross_entropy_backward.default)
    },
    saves="the logits, the targets and each row's log-sum-exp and target mass, never the"
    " probabilities",
    samples=samples_loss.soft_cross_entropy_samples,
    benchmark="benchmarks.loss",
)
