"""The fused pointwise region operator `seqfast::pointwise` and its derived backward
`seqfast::pointwise_backward`: schema, fake implementation, reference, kernel launch and autograd.

    pointwise(inputs, seed, stream, region) -> outputs

runs region `region` (see `pointwise_region.py`) over the broadcast shape of `inputs`; every output
has that shape, contiguous. Dropout number k of the region draws random stream `stream + k` of the
graph's seed at the element's flat index, so the backward regenerates the same mask. The backward
saves only the inputs its derived graph reads, never an intermediate and never a mask.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton

from seqcompile.codegen import KernelSpec, kernel_function
from seqcompile.codegen.pointwise import Layout, Load, Mask, index_fits_32_bits, render
from seqcompile.fx_utils import concrete
from seqcompile.ops import pointwise_region as regions
from seqcompile.ops import samples_pointwise, sharding_rules
from seqcompile.ops.fused_op import Call, FusedOp, gradients, named, needs_grad
from seqcompile.ops.random import keep_mask
from seqcompile.ops.wide_evaluation import widened
from seqcompile.run import runtime

Tensor = torch.Tensor
BLOCK = 1024
"""Elements per program (a multiple of 4: one Philox evaluation draws four dropout numbers)."""


def _shape(inputs: Sequence[Tensor]) -> torch.Size:
    return torch.broadcast_shapes(*(t.shape for t in inputs))


def _unfolded(outputs: int) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Gradient terms and written sums as autograd calls the backward: one term per output."""
    return (1,) * outputs, (False,) * outputs


# --------------------------------------------------------------------------------------------
# layouts: collapse the region's shape and describe how each operand walks it


def collapse(
    shape: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dimensions and merge neighbours every operand walks contiguously.

    `strides[i]` are operand i's strides over `shape` (0 where it broadcasts)."""
    dims = [d for d, size in enumerate(shape) if size != 1]
    sizes = [shape[d] for d in dims]
    walks = [[s[d] for d in dims] for s in strides]
    d = len(sizes) - 2
    while d >= 0:
        if all(w[d] == w[d + 1] * sizes[d + 1] for w in walks):
            sizes[d : d + 2] = [sizes[d] * sizes[d + 1]]
            for w in walks:
                w[d : d + 2] = [w[d + 1]]
        d -= 1
    return sizes, walks


def broadcast_strides(t: Tensor, shape: Sequence[int]) -> list[int]:
    """`t`'s strides when read as `shape`: 0 along broadcast dimensions."""
    lead = len(shape) - t.dim()
    return [
        0 if d < lead or t.shape[d - lead] == 1 else t.stride(d - lead) for d in range(len(shape))
    ]


def _contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(sizes):
        strides.append(step)
        step *= size
    return strides[::-1]


def _layout(walk: list[int], sizes: list[int]) -> Layout:
    if all(s == 0 for s in walk):
        return "scalar"
    if walk == _contiguous_strides(sizes):
        return "flat"
    return tuple(s != 0 for s in walk)


def _layouts(
    shape: Sequence[int], operands: Sequence[Tensor], outputs: int
) -> tuple[list[int], list[list[int]], tuple[Layout, ...], bool]:
    """The collapsed region shape, every operand's strides over it (the `outputs` contiguous
    outputs last), the layout of each of `operands`, and whether the kernel indexes in 64 bits
    (its elements or an operand's offsets reach 2**31)."""
    contiguous = _contiguous_strides(shape)
    strides = [broadcast_strides(t, shape) for t in operands] + [contiguous] * outputs
    sizes, walks = collapse(shape, strides)
    wide = not index_fits_32_bits(math.prod(shape), BLOCK, sizes, walks)
    return sizes, walks, tuple(_layout(w, sizes) for w in walks[: len(operands)]), wide


def _at_hints(t: Tensor) -> Tensor:
    """A meta tensor with `t`'s sizes and strides at the values they were traced with."""
    return torch.empty_strided(
        [concrete(s) for s in t.shape],
        [concrete(s) for s in t.stride()],
        dtype=t.dtype,
        device="meta",
    )


def compile_time_specs(
    region: regions.Region, inputs: Sequence[Tensor], needs_grad: Sequence[bool] | None
) -> list[KernelSpec]:
    """The kernels a compiled graph will launch, rendered now at the traced sizes and strides (so
    an op the printer lacks fails the compile, not the run): the forward, and the backward when
    `needs_grad` names an input needing a gradient."""
    concrete = [_at_hints(t) for t in inputs]
    shape = list(_shape(concrete))
    dtypes = regions.output_dtypes(region, [t.dtype for t in inputs])
    sizes, _, layouts, wide = _layouts(shape, concrete, len(dtypes))
    specs = [forward_spec(region.key, layouts, len(sizes), len(dtypes), wide)[0]]
    if needs_grad is not None and any(needs_grad):
        # autograd passes no gradient for an output that is not floating point (a mask)
        grad_terms = tuple(int(d.is_floating_point) for d in dtypes)
        plan_key = (tuple(needs_grad), grad_terms, (False,) * len(dtypes))
        plan = regions.backward_plan(region.key, *plan_key)
        saved = [t for t, keep in zip(concrete, plan.saved, strict=True) if keep]
        grads = [torch.empty(shape, device="meta")] * sum(grad_terms)
        specs += backward_specs(region.key, plan_key, saved, grads)
    return specs


def backward_specs(
    key: str, plan_key: tuple, saved: Sequence[Tensor], grads: Sequence[Tensor]
) -> list[KernelSpec]:
    """The backward kernel for the saved inputs and gradient terms a compiled graph passes (at
    their traced sizes and strides); none when the plan computes nothing."""
    plan = regions.backward_plan(key, *plan_key)
    if not plan.computed:
        return []
    operands = [_at_hints(t) for t in (*saved, *grads)]
    shape = list(_shape(operands))
    sizes, _, layouts, wide = _layouts(shape, operands, len(plan.computed))
    return [backward_spec(key, plan_key, layouts, len(sizes), wide)[0]]


def forward_kernels_of(call: Call) -> list[KernelSpec]:
    """The kernel a `pointwise` call launches, at the traced sizes and strides."""
    return compile_time_specs(regions.lookup(call["region"]), call.value("inputs"), None)


def backward_kernels_of(call: Call) -> list[KernelSpec]:
    """The kernel a `pointwise_backward` call launches (none when it computes nothing)."""
    plan_key = (tuple(call["needs_grad"]), tuple(call["grad_terms"]), tuple(call["written"]))
    return backward_specs(call["region"], plan_key, call.value("saved"), call.value("grads"))


def _launch(
    spec_of, tensors: dict[str, Tensor], shape: torch.Size, outputs: dict[str, Tensor], extra: dict
) -> None:
    """Collapse the region, render (or reuse) the kernel for the operands' layouts and launch it.
    `outputs` are contiguous over the region."""
    names = list(tensors) + list(outputs)
    sizes, walks, layouts, wide = _layouts(list(shape), list(tensors.values()), len(outputs))
    spec, params = spec_of(layouts, len(sizes), wide)
    values = {**tensors, **outputs, **extra, "N": math.prod(shape)}
    for name, walk in zip(names, walks, strict=True):
        values.update({f"{name}_stride{d}": s for d, s in enumerate(walk)})
    inner = _contiguous_strides(sizes)
    values.update({f"size{d}": s for d, s in enumerate(sizes)})
    values.update({f"inner{d}": s for d, s in enumerate(inner)})
    grid = (triton.cdiv(values["N"], BLOCK),)
    kernel_function(spec)[grid](*(values[p] for p in params), BLOCK=BLOCK, num_warps=4)


@functools.lru_cache(maxsize=1024)
def forward_spec(
    key: str, layouts: tuple[Layout, ...], rank: int, outputs: int, wide: bool
) -> tuple[KernelSpec, tuple[str, ...]]:
    region = regions.lookup(key)
    operands = [Load(f"IN{i}", layout) for i, layout in enumerate(layouts)] + [
        Mask(k, p) for k, p in enumerate(region.dropout_p)
    ]
    names = [f"OUT{j}" for j in range(outputs)]
    return render(region.forward, operands, names, rank, "forward", key, region.name, wide)


@functools.lru_cache(maxsize=1024)
def backward_spec(
    key: str, plan_key: tuple, layouts: tuple[Layout, ...], rank: int, wide: bool
) -> tuple[KernelSpec, tuple[str, ...]]:
    region = regions.lookup(key)
    plan = regions.backward_plan(key, *plan_key)
    terms = sum(plan_key[1])
    saved = [i for i, s in enumerate(plan.saved) if s]
    layout_of = dict(
        zip(
            [f"IN{i}" for i in saved] + [f"GRAD{j}" for j in range(terms)],
            layouts,
            strict=True,
        )
    )
    operands = [
        Load(f"IN{i}", layout_of[f"IN{i}"]) if s else None for i, s in enumerate(plan.saved)
    ]
    operands += [Mask(k, p) for k, p in enumerate(region.dropout_p)]
    operands += [Load(f"GRAD{j}", layout_of[f"GRAD{j}"]) for j in range(terms)]
    names = [f"DIN{j}" for j in range(len(plan.computed))]
    return render(plan.graph, operands, names, rank, "backward", key, region.name, wide)


# --------------------------------------------------------------------------------------------
# forward


@torch.library.custom_op("seqfast::pointwise", mutates_args=())
def pointwise(inputs: list[Tensor], seed: Tensor | None, stream: int, region: str) -> list[Tensor]:
    program = regions.lookup(region)
    if len(inputs) != program.num_inputs:
        raise ValueError(
            f"seqfast::pointwise: region {region} takes {program.num_inputs} inputs;"
            f" got {len(inputs)}"
        )
    if program.dropout_p and seed is None:
        raise ValueError("seqfast::pointwise: a region with dropout needs a seed tensor")
    shape = _shape(inputs)
    dtypes = regions.output_dtypes(program, [t.dtype for t in inputs])
    if runtime.use_kernels(inputs[0]):
        outputs = {
            f"OUT{j}": runtime.empty(tuple(shape), d, inputs[0].device)
            for j, d in enumerate(dtypes)
        }
        if math.prod(shape) > 0:
            extra = {"SEED": seed, "stream": stream} if program.dropout_p else {}
            _launch(
                lambda layouts, rank, wide: forward_spec(region, layouts, rank, len(dtypes), wide),
                {f"IN{i}": t for i, t in enumerate(inputs)},
                shape,
                outputs,
                extra,
            )
        return list(outputs.values())
    return reference(inputs, seed, stream, region)


def reference(inputs: list[Tensor], seed: Tensor | None, stream: int, region: str) -> list[Tensor]:
    """The region's forward, each op as the program calls it (in float64 where torch's float32
    kernels depend on the machine), masks drawn from the seed as the kernel draws them."""
    program = regions.lookup(region)
    shape = _shape(inputs)
    dtypes = regions.output_dtypes(program, [t.dtype for t in inputs])
    masks = [keep_mask(seed, shape, stream + k, p) for k, p in enumerate(program.dropout_p)]
    results = widened(program.written)(*inputs, *masks)
    return [r.to(d).expand(shape).contiguous() for r, d in zip(results, dtypes, strict=True)]


@pointwise.register_fake
@named(torch.ops.seqfast.pointwise.default)
def _(call: Call):
    tensors = call["inputs"]
    shape = _shape(tensors)
    dtypes = regions.output_dtypes(regions.lookup(call["region"]), [t.dtype for t in tensors])
    return [tensors[0].new_empty(shape, dtype=d) for d in dtypes]


# --------------------------------------------------------------------------------------------
# backward


@torch.library.custom_op("seqfast::pointwise_backward", mutates_args=())
def pointwise_backward(
    saved: list[Tensor],
    grads: list[Tensor],
    seed: Tensor | None,
    stream: int,
    region: str,
    needs_grad: list[bool],
    grad_terms: list[int],
    written: list[bool],
    dtypes: list[int],
) -> list[Tensor]:
    """The gradients the derived backward computes (`BackwardPlan.computed`), each with the
    region's shape; `saved` holds the inputs the plan reads, `grads` the terms of the output
    gradients (`grad_terms[j]` of them for output j, summed in the kernel), `written` the outputs
    whose summed gradient is written too, and `dtypes` the dtype code of each computed value."""
    if not runtime.use_kernels(grads[0]):
        return backward_reference(
            saved, grads, seed, stream, region, needs_grad, grad_terms, written, dtypes
        )
    plan_key = (tuple(needs_grad), tuple(grad_terms), tuple(written))
    plan = regions.backward_plan(region, *plan_key)
    program = regions.lookup(region)
    shape = grads[0].shape
    out_dtypes = [DTYPE_CODES[c] for c in dtypes]
    device = grads[0].device
    outputs = {f"DIN{j}": runtime.empty(tuple(shape), d, device) for j, d in enumerate(out_dtypes)}
    if math.prod(shape) > 0 and outputs:
        saved_index = [i for i, s in enumerate(plan.saved) if s]
        tensors = {f"IN{i}": t for i, t in zip(saved_index, saved, strict=True)}
        tensors.update({f"GRAD{j}": g for j, g in enumerate(grads)})
        extra = {"SEED": seed, "stream": stream} if program.dropout_p else {}
        _launch(
            lambda layouts, rank, wide: backward_spec(region, plan_key, layouts, rank, wide),
            tensors,
            shape,
            outputs,
            extra,
        )
    return list(outputs.values())


def backward_reference(
    saved, grads, seed, stream, region, needs_grad, grad_terms, written, dtypes
) -> list[Tensor]:
    """`pointwise_backward` on CPU: the derived graph run with the captured dtypes on inputs
    expanded to the region's shape, masks drawn from the seed as the kernel draws them."""
    plan = regions.backward_plan(region, tuple(needs_grad), tuple(grad_terms), tuple(written))
    program = regions.lookup(region)
    shape = grads[0].shape
    out_dtypes = [DTYPE_CODES[c] for c in dtypes]
    saved_iter = iter(saved)
    inputs = [
        next(saved_iter).to(dtype).expand(shape) if keep else None
        for keep, dtype in zip(plan.saved, program.input_dtypes, strict=True)
    ]
    masks = [keep_mask(seed, shape, stream + k, p) for k, p in enumerate(program.dropout_p)]
    grad_dtypes = [p.meta["val"].dtype for p in plan.graph.graph.nodes if p.op == "placeholder"][
        program.num_inputs + len(masks) :
    ]
    grads = [g.to(d) for g, d in zip(grads, grad_dtypes, strict=True)]
    results = widened(plan.graph)(*inputs, *masks, *grads)
    return [r.to(d).expand(shape).contiguous() for r, d in zip(results, out_dtypes, strict=True)]


@pointwise_backward.register_fake
@named(torch.ops.seqfast.pointwise_backward.default)
def _(call: Call):
    first = call["grads"][0]
    return [first.new_empty(first.shape, dtype=DTYPE_CODES[c]) for c in call["dtypes"]]


DTYPE_CODES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
)  # fmt: skip
"""Dtype codes of `pointwise_backward`'s `dtypes` argument (custom ops take no dtype lists)."""


# --------------------------------------------------------------------------------------------
# autograd


FORWARD = torch.ops.seqfast.pointwise.default


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
    computed = torch.ops.seqfast.pointwise_backward(
        saved, present, seed, stream, region, list(needs_grad), list(grad_terms),
        [False] * len(grads), [DTYPE_CODES.index(d) for d in computed_dtypes],
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


ENTRY = FusedOp(
    name="pointwise",
    family="pointwise",
    forward=torch.ops.seqfast.pointwise.default,
    backward=(torch.ops.seqfast.pointwise_backward.default,),
    reference=reference,
    lowering={  # the references, which trace as they are (the region's graphs are ATen)
        torch.ops.seqfast.pointwise.default: reference,
        torch.ops.seqfast.pointwise_backward.default: backward_reference,
    },
    kernels={
        torch.ops.seqfast.pointwise.default: forward_kernels_of,
        torch.ops.seqfast.pointwise_backward.default: backward_kernels_of,
    },
    sharding={
        torch.ops.seqfast.pointwise.default: sharding_rules.pointwise_forward,
        torch.ops.seqfast.pointwise_backward.default: sharding_rules.pointwise_backward,
    },
    saves="the inputs its derived backward reads (and the seed), never an intermediate or a mask",
    label=lambda call: regions.lookup(call["region"]).name,
    samples=samples_pointwise.samples,
    benchmark="benchmarks.pointwise_kernels",
)
