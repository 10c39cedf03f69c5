"""`seqfast::pointwise` and `seqfast::pointwise_backward` declared once: their schema, fake
implementations and autograd; the kernels are in `kernels.py`, the reference in `reference.py`."""

from __future__ import annotations

import torch

from seqcompile.ops.fused_op import Call, define, gradients, named, needs_grad, schema
from seqcompile.ops.pointwise import kernels, reference
from seqcompile.ops.pointwise import region as regions
from seqcompile.run import runtime

Tensor = torch.Tensor
ARGUMENTS = "Tensor[] inputs, Tensor? seed, int stream, str region"
BACKWARD_ARGUMENTS = """Tensor[] saved, Tensor[] grads, Tensor? seed, int stream, str region,
    bool[] needs_grad, int[] grad_terms, bool[] written, int[] dtypes"""


def _unfolded(outputs: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Gradient terms and written sums as autograd calls the backward: one term per output."""
    return (1,) * outputs, (False,) * outputs


# --------------------------------------------------------------------------------------------
# forward


def _forward(call: Call) -> list[Tensor]:
    inputs, seed, region = call["inputs"], call["seed"], call["region"]
    program = regions.lookup(region)
    if len(inputs) != program.num_inputs:
        raise ValueError(
            f"seqfast::pointwise: region {region} takes {program.num_inputs} inputs;"
            f" got {len(inputs)}"
        )
    if program.dropout_p and seed is None:
        raise ValueError("seqfast::pointwise: a region with dropout needs a seed tensor")
    impl = kernels.forward if runtime.use_kernels(inputs[0]) else reference.forward
    return impl(**call)


pointwise = define("seqfast::pointwise", schema(ARGUMENTS, returns="Tensor[]"), _forward)
FORWARD = torch.ops.seqfast.pointwise.default


@pointwise.register_fake
@named(FORWARD)
def _(call: Call):
    tensors = call["inputs"]
    shape = reference.broadcast_shape(tensors)
    dtypes = regions.output_dtypes(regions.lookup(call["region"]), [t.dtype for t in tensors])
    return [tensors[0].new_empty(shape, dtype=d) for d in dtypes]


# --------------------------------------------------------------------------------------------
# backward


def _backward(call: Call) -> list[Tensor]:
    """The gradients the derived backward computes (`BackwardPlan.computed`), each with the
    region's shape; `saved` holds the inputs the plan reads, `grads` the terms of the output
    gradients (`grad_terms[j]` of them for output j, summed in the kernel), `written` the outputs
    whose summed gradient is written too, and `dtypes` the dtype code of each computed value
    (`reference.DTYPE_CODES`)."""
    impl = kernels.backward if runtime.use_kernels(call["grads"][0]) else reference.backward
    return impl(**call)


pointwise_backward = define(
    "seqfast::pointwise_backward", schema(BACKWARD_ARGUMENTS, returns="Tensor[]"), _backward
)
BACKWARD = torch.ops.seqfast.pointwise_backward.default


@pointwise_backward.register_fake
@named(BACKWARD)
def _(call: Call):
    first = call["grads"][0]
    return [first.new_empty(first.shape, dtype=reference.DTYPE_CODES[c]) for c in call["dtypes"]]


# --------------------------------------------------------------------------------------------
# autograd


def _setup_context(ctx, inputs, output):
    call = Call(FORWARD, inputs, {})
    tensors, region = call["inputs"], call["region"]
    flags = needs_grad(ctx, FORWARD, "inputs", inputs)
    wanted = tuple(
        bool(need) and t.dtype.is_floating_point for need, t in zip(flags, tensors, strict=True)
    )
    ctx.config = (region, call["stream"], wanted, [(t.shape, t.dtype) for t in tensors])
    plan = regions.backward_plan(region, wanted, *_unfolded(len(output)))
    kept = (t for t, keep in zip(tensors, plan.saved, strict=True) if keep)
    ctx.save_for_backward(call["seed"], *kept)
    ctx.set_materialize_grads(False)


def _backward(ctx, grads):
    region, stream, needs_grad, metas = ctx.config
    seed, *saved_all = ctx.saved_tensors
    grad_terms = tuple(int(g is not None) for g in grads)
    if not any(grad_terms) or not any(needs_grad):
        # autograd checks the structure: the tensor list takes a list of (absent) gradients
        return gradients(FORWARD, inputs=[None] * len(metas))
    full_plan = regions.backward_plan(region, needs_grad, *_unfolded(len(grads)))
    plan = regions.backward_plan(region, needs_grad, grad_terms, (False,) * len(grads))
    kept = iter(saved_all)
    by_input = [next(kept) if keep else None for keep in full_plan.saved]
    saved = [t for t, keep in zip(by_input, plan.saved, strict=True) if keep]
    present = [g for g in grads if g is not None]
    shape = present[0].shape
    computed_dtypes = _computed_dtypes(plan, metas, shape)
    computed = BACKWARD(
        saved=saved, grads=present, seed=seed, stream=stream, region=region,
        needs_grad=list(needs_grad), grad_terms=list(grad_terms), written=[False] * len(grads),
        dtypes=[reference.DTYPE_CODES.index(d) for d in computed_dtypes],
    )  # fmt: skip
    result = []
    for (in_shape, dtype), how in zip(metas, plan.input_grads, strict=True):
        if how.kind == "none":
            result.append(None)
            continue
        grad = present[how.index] if how.kind == "passthrough" else computed[how.index]
        if tuple(in_shape) != tuple(shape):
            grad = grad.sum_to_size(in_shape)
        result.append(grad.to(dtype))
    return gradients(FORWARD, inputs=result)


def _computed_dtypes(plan, metas, shape) -> list[torch.dtype]:
    """Each computed gradient is stored in the dtype of the first full-size input it belongs to,
    else in float32 (it is then summed down to a broadcast input's shape)."""
    dtypes: list[torch.dtype | None] = [None] * len(plan.computed)
    for (in_shape, dtype), how in zip(metas, plan.input_grads, strict=True):
        if how.kind == "computed" and dtypes[how.index] is None and tuple(in_shape) == tuple(shape):
            dtypes[how.index] = dtype
    return [d or torch.float32 for d in dtypes]


pointwise.register_autograd(_backward, setup_context=_setup_context)
