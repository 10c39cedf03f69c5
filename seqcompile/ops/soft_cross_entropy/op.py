"""`seqfast::soft_cross_entropy` and its backward declared once: their schema, fake implementations
and autograd; the kernel is in `kernels.py`, the reference and the lowerings in `reference.py`."""

from __future__ import annotations

import torch

from seqcompile.ops.fused_op import Call, define, gradients, named, needs_grad, schema
from seqcompile.ops.soft_cross_entropy import kernels, reference
from seqcompile.run import runtime

Tensor = torch.Tensor
ARGUMENTS = "Tensor logits, Tensor target, float smoothing"
"""The forward's arguments; the backward takes the incoming per-row gradients `grad` first, then
these with the rows' statistics (log-sum-exp and target mass) and whether the targets want a
gradient."""
BACKWARD_ARGUMENTS = "Tensor lse, Tensor mass, bool target_grad"


def _forward(call: Call) -> tuple[Tensor, Tensor, Tensor]:
    logits, target = call["logits"], call["target"]
    if logits.dim() != 2 or target.shape != logits.shape:
        raise ValueError(
            "seqfast::soft_cross_entropy: logits and target must both be (rows, classes); got"
            f" {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if logits.numel() == 0 or not runtime.use_kernels(logits):
        return reference.forward(**call)
    return kernels.forward(**call)


soft_cross_entropy = define(
    "seqfast::soft_cross_entropy", schema(ARGUMENTS, returns="(Tensor, Tensor, Tensor)"), _forward
)
FORWARD = torch.ops.seqfast.soft_cross_entropy.default


@soft_cross_entropy.register_fake
@named(FORWARD)
def _(call: Call):
    m = call["logits"].shape[0]
    return tuple(call["logits"].new_empty((m,), dtype=torch.float32) for _ in range(3))


def _backward(call: Call) -> tuple[Tensor, Tensor]:
    """The gradients of the logits and (when `target_grad`; else an empty tensor) of the
    targets, each in its input's dtype, for incoming per-row gradients `grad`."""
    if call["logits"].numel() == 0 or not runtime.use_kernels(call["logits"]):
        return reference.lower_backward(**call)
    return kernels.backward(**call)


soft_cross_entropy_backward = define(
    "seqfast::soft_cross_entropy_backward",
    schema("Tensor grad", ARGUMENTS, BACKWARD_ARGUMENTS, returns="(Tensor, Tensor)"),
    _backward,
)
BACKWARD = torch.ops.seqfast.soft_cross_entropy_backward.default


@soft_cross_entropy_backward.register_fake
@named(BACKWARD)
def _(call: Call):
    dlogits = torch.empty_like(call["logits"], memory_format=torch.contiguous_format)
    target = call["target"]
    if not call["target_grad"]:
        return dlogits, target.new_empty(0)
    return dlogits, torch.empty_like(target, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    call = Call(FORWARD, inputs, {})
    _loss, lse, mass = output
    ctx.mark_non_differentiable(lse, mass)
    ctx.save_for_backward(call["logits"], call["target"], lse, mass)
    ctx.smoothing = call["smoothing"]
    ctx.set_materialize_grads(False)


def _backward_of(ctx, grad_loss, _grad_lse, _grad_mass):
    wanted = {name: needs_grad(ctx, FORWARD, name) for name in ("logits", "target")}
    if grad_loss is None or not any(wanted.values()):
        return gradients(FORWARD)
    logits, target, lse, mass = ctx.saved_tensors
    dlogits, dtarget = BACKWARD(
        grad=grad_loss, logits=logits, target=target, lse=lse, mass=mass,
        smoothing=ctx.smoothing, target_grad=bool(wanted["target"]),
    )  # fmt: skip
    return gradients(
        FORWARD,
        logits=dlogits if wanted["logits"] else None,
        target=dtarget if wanted["target"] else None,
    )


soft_cross_entropy.register_autograd(_backward_of, setup_context=_setup_context)
