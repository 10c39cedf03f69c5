"""`seqfast::cross_entropy`, its backward and the backward's in-place twin declared once: their
schema, fake implementations and autograd; the kernel is in `kernels.py`, the reference and the
lowerings in `reference.py`."""

from __future__ import annotations

import torch

from seqcompile.ops.cross_entropy import kernels, reference
from seqcompile.ops.fused_op import Call, define, gradients, named, needs_grad, schema
from seqcompile.run import runtime

Tensor = torch.Tensor
ARGUMENTS = "Tensor logits, Tensor target, int ignore_index, float smoothing"
"""The forward's arguments; the backward takes them between the incoming per-row gradients `grad`
and the rows' log-sum-exp `lse`."""


def _forward(call: Call) -> tuple[Tensor, Tensor]:
    logits, target = call["logits"], call["target"]
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            "seqfast::cross_entropy: logits must be (rows, classes) and target (rows,); got"
            f" {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    reference.check_targets(target, logits.shape[1], call["ignore_index"])
    if logits.shape[1] == 0:
        return reference.over_no_classes(logits.shape[0], call["smoothing"], logits.device)
    impl = kernels.forward if runtime.use_kernels(logits) else reference.forward
    return impl(**call)


cross_entropy = define(
    "seqfast::cross_entropy", schema(ARGUMENTS, returns="(Tensor, Tensor)"), _forward
)
FORWARD = torch.ops.seqfast.cross_entropy.default


@cross_entropy.register_fake
@named(FORWARD)
def _(call: Call):
    logits = call["logits"]
    m = logits.shape[0]
    return logits.new_empty((m,), dtype=torch.float32), logits.new_empty((m,), dtype=torch.float32)


def _backward(call: Call) -> Tensor:
    """The gradient of the logits, in their dtype, for incoming per-row gradients `grad`."""
    logits = call["logits"]
    dlogits = runtime.empty(tuple(logits.shape), logits.dtype, logits.device)
    kernels.write_grad(dlogits, **call)
    return dlogits


cross_entropy_backward = define(
    "seqfast::cross_entropy_backward",
    schema("Tensor grad", ARGUMENTS, "Tensor lse", returns="Tensor"),
    _backward,
)
BACKWARD = torch.ops.seqfast.cross_entropy_backward.default


@cross_entropy_backward.register_fake
@named(BACKWARD)
def _(call: Call):
    return torch.empty_like(call["logits"], memory_format=torch.contiguous_format)


def _backward_in_place(call: Call) -> None:
    """The backward written over the logits, for a backward that reads them last. Logits whose
    rows are not contiguous get the gradient through a temporary."""
    logits = call["logits"]
    if logits.is_contiguous():
        kernels.write_grad(logits, **call)
    else:
        logits.copy_(BACKWARD(*call.arguments_of(BACKWARD)))


cross_entropy_backward_in_place = define(
    "seqfast::cross_entropy_backward_in_place",
    schema(
        "Tensor grad",
        ARGUMENTS.replace("Tensor logits", "Tensor(a!) logits"),
        "Tensor lse",
        returns="()",
    ),
    _backward_in_place,
    mutates=("logits",),
)
BACKWARD_IN_PLACE = torch.ops.seqfast.cross_entropy_backward_in_place.default


def _setup_context(ctx, inputs, output):
    call = Call(FORWARD, inputs, {})
    _loss, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(call["logits"], call["target"], lse)
    ctx.config = dict(ignore_index=call["ignore_index"], smoothing=call["smoothing"])
    ctx.set_materialize_grads(False)


def _backward_of(ctx, grad_loss, _grad_lse):
    if grad_loss is None or not needs_grad(ctx, FORWARD, "logits"):
        return gradients(FORWARD)
    logits, target, lse = ctx.saved_tensors
    dlogits = BACKWARD(grad=grad_loss, logits=logits, target=target, lse=lse, **ctx.config)
    return gradients(FORWARD, logits=dlogits)


cross_entropy.register_autograd(_backward_of, setup_context=_setup_context)
