"""The generated kernels of `seqfast::pointwise` and its backward: each rendered from the region's
graphs for the layouts of its operands (the region's shape collapsed, each operand's walk over it),
and the launchers, taking the ops' arguments by name."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import triton

from seqcompile.codegen import KernelSpec, kernel_function
from seqcompile.codegen.pointwise import Layout, Load, Mask, index_fits_32_bits, render
from seqcompile.fx.nodes import concrete
from seqcompile.ops.fused_op import Call
from seqcompile.ops.pointwise import reference
from seqcompile.ops.pointwise import region as regions
from seqcompile.ops.pointwise.reference import DTYPE_CODES, broadcast_shape
from seqcompile.run import runtime

Tensor = torch.Tensor
BLOCK = 1024
"""Elements per program (a multiple of 4: one Philox evaluation draws four dropout numbers)."""


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
    shape = list(broadcast_shape(concrete))
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
    shape = list(broadcast_shape(operands))
    sizes, _, layouts, wide = _layouts(shape, operands, len(plan.computed))
    return [backward_spec(key, plan_key, layouts, len(sizes), wide)[0]]


def forward_kernels_of(call: Call) -> list[KernelSpec]:
    """The kernel a `pointwise` call launches, at the traced sizes and strides."""
    return compile_time_specs(regions.lookup(call["region"]), call.value("inputs"), None)


def backward_kernels_of(call: Call) -> list[KernelSpec]:
    """The kernel a `pointwise_backward` call launches (none when it computes nothing)."""
    plan_key = reference.plan_key(call)
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


def forward(*, inputs: list[Tensor], seed, stream: int, region: str) -> list[Tensor]:
    """The forward's kernel launched on the op's arguments by name."""
    program = regions.lookup(region)
    shape = broadcast_shape(inputs)
    dtypes = regions.output_dtypes(program, [t.dtype for t in inputs])
    outputs = {
        f"OUT{j}": runtime.empty(tuple(shape), d, inputs[0].device) for j, d in enumerate(dtypes)
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


def backward(**arguments) -> list[Tensor]:
    """The backward's kernel launched on the op's arguments by name."""
    saved, grads, seed, stream, region = (
        arguments[name] for name in ("saved", "grads", "seed", "stream", "region")
    )
    plan_key = reference.plan_key(arguments)
    plan = regions.backward_plan(region, *plan_key)
    program = regions.lookup(region)
    shape = grads[0].shape
    out_dtypes = [DTYPE_CODES[c] for c in arguments["dtypes"]]
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
