"""`seqfast::add_norm` and `seqfast::add_norm_backward` declared once: their schema, fake
implementations and autograd; the kernels are in `kernels.py`, the reference in `reference.py`."""

from __future__ import annotations

import torch

from seqcompile.ops.add_norm import kernels, reference
from seqcompile.ops.fused_op import Call, define, gradients, named, schema
from seqcompile.run import runtime

Tensor = torch.Tensor
MAX_WIDTH = 16384
"""Widest normalized dimension the kernels take: a whole row lives in registers."""
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

ARGUMENTS = """Tensor x, Tensor? residual, Tensor? branch_bias, Tensor? weight, Tensor? bias,
    Tensor? seed, int stream, float p, float eps, bool rms, ScalarType out_dtype,
    ScalarType sum_dtype"""
BACKWARD_ARGUMENTS = """Tensor grad_out, Tensor? grad_sum, Tensor saved, Tensor mean, Tensor rstd,
    Tensor? weight, Tensor? seed, int stream, float p, bool rms, ScalarType x_dtype,
    ScalarType? residual_dtype, ScalarType? bias_dtype, ScalarType? branch_bias_dtype"""
"""The backward takes the sum (or x) and the row statistics the forward saved, and of the
forward's other tensors only the weight: the dtypes of the rest."""


# --------------------------------------------------------------------------------------------
# forward


def _forward(call: Call) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if not 0 <= call["p"] <= 1:
        raise ValueError(f"seqfast::add_norm: dropout p must be in [0, 1], got {call['p']}")
    if call["p"] > 0 and call["seed"] is None:
        raise ValueError("seqfast::add_norm: dropout p > 0 needs a seed tensor")
    impl = kernels.forward if runtime.use_kernels(call["x"]) else reference.forward
    return impl(**call)


add_norm = define(
    "seqfast::add_norm", schema(ARGUMENTS, returns="(Tensor, Tensor, Tensor, Tensor)"), _forward
)
FORWARD = torch.ops.seqfast.add_norm.default


@add_norm.register_fake
@named(FORWARD)
def _(call: Call):
    x, sum_dtype = call["x"], call["sum_dtype"]
    out = x.new_empty(x.shape, dtype=call["out_dtype"])
    if reference.has_prologue(call["residual"], call["branch_bias"], call["p"]):
        total = x.new_empty(x.shape, dtype=sum_dtype)
    else:
        total = x.new_empty((0,), dtype=sum_dtype)
    rows = x.shape[:-1]
    mean = x.new_empty((0,) if call["rms"] else rows, dtype=torch.float32)
    return out, total, mean, x.new_empty(rows, dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# backward


def _backward(call: Call) -> tuple[Tensor, ...]:
    """(dx, dresidual, dweight, dbias, dbranch_bias); absent ones are empty. `dresidual` is empty
    also when it would equal `dx` (no dropout, same dtype)."""
    impl = kernels.backward if runtime.use_kernels(call["saved"]) else reference.backward
    return impl(**call)


add_norm_backward = define(
    "seqfast::add_norm_backward",
    schema(BACKWARD_ARGUMENTS, returns="(Tensor, Tensor, Tensor, Tensor, Tensor)"),
    _backward,
)
BACKWARD = torch.ops.seqfast.add_norm_backward.default


@add_norm_backward.register_fake
@named(BACKWARD)
def _(call: Call):
    saved = call["saved"]
    return tuple(
        saved.new_empty(shape, dtype=dtype) for shape, dtype in reference.grad_shapes(**call)
    )


# --------------------------------------------------------------------------------------------
# autograd


def _setup_context(ctx, inputs, output):
    call = Call(FORWARD, inputs, {})
    _out, total, mean, rstd = output
    prologue = reference.has_prologue(call["residual"], call["branch_bias"], call["p"])
    ctx.mark_non_differentiable(mean, rstd)
    if not prologue:
        ctx.mark_non_differentiable(total)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(
        total if prologue else call["x"], mean, rstd, call["weight"], call["seed"]
    )
    ctx.config = dict(
        stream=call["stream"],
        p=call["p"],
        rms=call["rms"],
        x_dtype=call["x"].dtype,
        **{f"{name}_dtype": _dtype(call[name]) for name in ("residual", "bias", "branch_bias")},
    )


def _dtype(t: Tensor | None) -> torch.dtype | None:
    return t.dtype if t is not None else None


def _backward(ctx, grad_out, grad_sum, _grad_mean, _grad_rstd):
    saved, mean, rstd, weight, seed = ctx.saved_tensors
    config = ctx.config
    if grad_out is None and grad_sum is None:
        return gradients(FORWARD)
    if grad_out is None:
        grad_out = torch.zeros_like(saved)
    dx, dres, dweight, dbias, dbranch_bias = BACKWARD(
        grad_out, grad_sum, saved, mean, rstd, weight, seed, **config
    )
    p, x_dtype, residual_dtype = config["p"], config["x_dtype"], config["residual_dtype"]
    if residual_dtype is None:
        dresidual = None
    else:
        dresidual = dres if reference.needs_residual_grad(p, x_dtype, residual_dtype) else dx
    return gradients(
        FORWARD,
        x=dx,
        residual=dresidual,
        branch_bias=dbranch_bias if config["branch_bias_dtype"] is not None else None,
        weight=dweight if weight is not None else None,
        bias=dbias if config["bias_dtype"] is not None else None,
    )


add_norm.register_autograd(_backward, setup_context=_setup_context)
