"""The fused cross-entropy operator `seqfast::cross_entropy` and its backward
`seqfast::cross_entropy_backward`: schema, fake implementation, reference, kernel launch, autograd.

    cross_entropy(logits (M, V), target (M,), ignore_index, smoothing) -> (loss (M,), lse (M,))

returns each row's loss and log-sum-exp in float32, reading the logits in their own dtype (an
upcast to float32 before the loss costs nothing). The backward saves the logits, the targets and
the log-sum-exp, never a softmax or log-probability matrix, and writes the gradient of the logits
in one pass, over the saved logits themselves when the backward reads them nowhere else
(`cross_entropy_backward_in_place`, swapped in by `memory/in_place.py`). Reductions stay
outside, in the graph: `sum`, or `sum / count` with the count of non-ignored targets computed on
the device.
"""

from __future__ import annotations

import torch
import triton

from seqcompile.codegen import KernelSpec, copies, kernel_function
from seqcompile.ops import samples_loss, sharding_rules
from seqcompile.ops.fused_op import Call, FusedOp, InPlace, gradients, named, needs_grad
from seqcompile.ops.index_check import check_range, checked_index
from seqcompile.run import runtime

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


TARGETS = "cross-entropy targets"


def check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """A target outside [0, vocab) that is not `ignore_index` is an error, as in eager: an
    IndexError on CPU, a device-side assert on CUDA (no host synchronization)."""
    check_range(target, 0, vocab, ignore_index, TARGETS)


def checked_targets(target: Tensor, vocab: int, ignore_index: int) -> Tensor:
    """`check_targets` as an op in the graph, for the lowering: the targets, which what indexes
    with them reads, once checked on the host (`ops/index_check.py`)."""
    return checked_index(target, 0, vocab, ignore_index, TARGETS)


def over_no_classes(rows: int, smoothing: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """Each row's loss and log-sum-exp when there are no classes (every target is then ignored;
    nothing is launched): 0, or NaN with smoothing, as eager divides each row's smoothing term,
    masked or not, by the number of classes (0 / 0)."""
    fill = float("nan") if smoothing > 0 else 0.0
    loss = torch.full((rows,), fill, dtype=torch.float32, device=device)
    return loss, torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------
# reference


def reference_rows(
    logits: Tensor, target: Tensor, ignore_index: int, smoothing: float
) -> tuple[Tensor, Tensor]:
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    # eager's log_softmax subtracts the row's maximum, so a +inf logit makes the row NaN (inf -
    # inf); logsumexp alone would give an infinite loss
    lse = lse.masked_fill(lse == float("inf"), float("nan"))
    ignored = target == ignore_index
    picked = x.gather(1, torch.where(ignored, 0, target).unsqueeze(1)).squeeze(1)
    loss = (1.0 - smoothing) * (lse - picked)
    if smoothing > 0:  # as eager: without smoothing a -inf logit's 0 * (-inf) would be NaN
        loss = loss + smoothing * (lse - x.sum(-1) / x.shape[-1])
    return loss.masked_fill(ignored, 0.0), lse


def reference_grad(
    logits: Tensor, target: Tensor, lse: Tensor, grad: Tensor, ignore_index: int, smoothing: float
) -> Tensor:
    x = logits.float()
    ignored = target == ignore_index
    d = torch.exp(x - lse.unsqueeze(1)) - smoothing / x.shape[-1]
    # the target's column less 1 - smoothing, as a one-hot select rather than an index_put (the
    # same subtraction where it hits, d - 0 elsewhere): pointwise given lse, no scatter
    hit = torch.arange(x.shape[-1], device=x.device) == torch.where(ignored, 0, target)[:, None]
    d = d - torch.where(hit, torch.where(ignored, 0.0, 1.0 - smoothing)[:, None], 0.0)
    g = torch.where(ignored, 0.0, grad.float())
    return (d * g.unsqueeze(1)).to(logits.dtype)


def lower_forward(
    logits: Tensor, target: Tensor, ignore_index: int, smoothing: float
) -> tuple[Tensor, Tensor]:
    """`cross_entropy` on CPU in plain ATen (the registry's lowering): the reference, the
    targets checked by an op in the graph."""
    target = checked_targets(target, logits.shape[1], ignore_index)
    if logits.shape[1] == 0:
        return over_no_classes(logits.shape[0], smoothing, logits.device)
    return reference_rows(logits, target, ignore_index, smoothing)


def lower_backward(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int, smoothing: float
) -> Tensor:
    """`cross_entropy_backward` on CPU in plain ATen: the reference's gradient, contiguous."""
    if logits.numel() == 0:  # no rows or no classes: no gradient to compute
        return torch.empty_like(logits, memory_format=torch.contiguous_format)
    dlogits = reference_grad(logits, target, lse, grad, ignore_index, smoothing)
    return dlogits.contiguous()


def lower_backward_in_place(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int, smoothing: float
) -> None:
    """`cross_entropy_backward_in_place` on CPU: the gradient copied over the logits."""
    logits.copy_(lower_backward(grad, logits, target, lse, ignore_index, smoothing))


# --------------------------------------------------------------------------------------------
# kernels


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
        return over_no_classes(m, smoothing, logits.device)
    if runtime.use_kernels(logits):
        loss = runtime.empty((m,), torch.float32, logits.device)
        lse = runtime.empty((m,), torch.float32, logits.device)
        _launch(
            "forward_grad", logits, target, loss, lse, scale,
            ignore_index=ignore_index, smoothing=smoothing,
        )  # fmt: skip
        return loss, lse
    loss, lse = reference_rows(logits, target, ignore_index, smoothing)
    grad = scale.expand(m)
    logits.copy_(reference_grad(logits, target, lse, grad, ignore_index, smoothing))
    return loss, lse


# --------------------------------------------------------------------------------------------
# operators


@torch.library.custom_op("seqfast::cross_entropy", mutates_args=())
def cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int, smoothing: float
) -> tuple[Tensor, Tensor]:
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            "seqfast::cross_entropy: logits must be (rows, classes) and target (rows,); got"
            f" {tuple(logits.shape)} and {tuple(target.shape)}"
        )
    check_targets(target, logits.shape[1], ignore_index)
    m = logits.shape[0]
    if logits.shape[1] == 0:
        return over_no_classes(m, smoothing, logits.device)
    if not runtime.use_kernels(logits):
        return reference_rows(logits, target, ignore_index, smoothing)
    loss = runtime.empty((m,), torch.float32, logits.device)
    lse = runtime.empty((m,), torch.float32, logits.device)
    _launch(
        "forward", rows(logits), target, loss, lse, ignore_index=ignore_index, smoothing=smoothing
    )
    return loss, lse


@cross_entropy.register_fake
@named(torch.ops.seqfast.cross_entropy.default)
def _(call: Call):
    logits = call["logits"]
    m = logits.shape[0]
    return logits.new_empty((m,), dtype=torch.float32), logits.new_empty((m,), dtype=torch.float32)


def _logits_grad(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, out: Tensor, ignore_index, smoothing
) -> None:
    """Write the gradient of the logits into `out` (contiguous; it may be `logits` itself: each
    element is read before it is written, by the program that writes it)."""
    if logits.numel() == 0:  # no rows or no classes: no gradient to write
        return
    if not runtime.use_kernels(logits):
        out.copy_(reference_grad(logits, target, lse, grad, ignore_index, smoothing))
        return
    _launch(
        "backward", rows(logits), target, lse, grad, out,
        ignore_index=ignore_index, smoothing=smoothing,
    )  # fmt: skip


@torch.library.custom_op("seqfast::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int, smoothing: float
) -> Tensor:
    """The gradient of the logits, in their dtype, for incoming per-row gradients `grad`."""
    dlogits = runtime.empty(tuple(logits.shape), logits.dtype, logits.device)
    _logits_grad(grad, logits, target, lse, dlogits, ignore_index, smoothing)
    return dlogits


@cross_entropy_backward.register_fake
@named(torch.ops.seqfast.cross_entropy_backward.default)
def _(call: Call):
    return torch.empty_like(call["logits"], memory_format=torch.contiguous_format)


@torch.library.custom_op("seqfast::cross_entropy_backward_in_place", mutates_args=("logits",))
def cross_entropy_backward_in_place(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int, smoothing: float
) -> None:
    """`cross_entropy_backward` written over the logits, for a backward that reads them last.
    Logits whose rows are not contiguous get the gradient through a temporary."""
    if logits.is_contiguous():
        _logits_grad(grad, logits, target, lse, logits, ignore_index, smoothing)
    else:
        logits.copy_(cross_entropy_backward(grad, logits, target, lse, ignore_index, smoothing))


FORWARD = torch.ops.seqfast.cross_entropy.default


def _setup_context(ctx, inputs, output):
    call = Call(FORWARD, inputs, {})
    _loss, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(call["logits"], call["target"], lse)
    ctx.config = dict(ignore_index=call["ignore_index"], smoothing=call["smoothing"])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, _grad_lse):
    if grad_loss is None or not needs_grad(ctx, FORWARD, "logits"):
        return gradients(FORWARD)
    logits, target, lse = ctx.saved_tensors
    dlogits = torch.ops.seqfast.cross_entropy_backward(grad_loss, logits, target, lse, **ctx.config)
    return gradients(FORWARD, logits=dlogits)


cross_entropy.register_autograd(_backward, setup_context=_setup_context)


ENTRY = FusedOp(
    name="cross_entropy",
    family="loss",
    forward=torch.ops.seqfast.cross_entropy.default,
    backward=(torch.ops.seqfast.cross_entropy_backward.default,),
    reference=reference_rows,
    lowering={
        torch.ops.seqfast.cross_entropy.default: lower_forward,
        torch.ops.seqfast.cross_entropy_backward.default: lower_backward,
        torch.ops.seqfast.cross_entropy_backward_in_place.default: lower_backward_in_place,
    },
    kernels={
        torch.ops.seqfast.cross_entropy.default: lambda call: [spec("forward", call["smoothing"])],
        torch.ops.seqfast.cross_entropy_backward.default: lambda call: [
            spec("backward", call["smoothing"])
        ],
        torch.ops.seqfast.cross_entropy_backward_in_place.default: lambda call: [
            spec("backward", call["smoothing"])
        ],
    },
    sharding={
        op: sharding_rules.rows_everywhere("logits")
        for op in (
            torch.ops.seqfast.cross_entropy.default,
            torch.ops.seqfast.cross_entropy_backward.default,
            torch.ops.seqfast.cross_entropy_backward_in_place.default,
        )
    },
    saves="the logits, the targets and each row's log-sum-exp, never the probabilities",
    in_place=InPlace(
        functional=torch.ops.seqfast.cross_entropy_backward.default,
        twin=torch.ops.seqfast.cross_entropy_backward_in_place.default,
        over="logits",
    ),
    samples=samples_loss.cross_entropy_samples,
    benchmark="benchmarks.loss",
)
