"""The definition of `seqfast::pointwise` and its backward in plain ATen: the region's graphs run on
the operands (in float64 where torch's float32 kernels depend on the machine), dropout masks drawn
from the seed as the kernels draw them. The test oracle, what runs on CPU, and the lowerings (the
region's graphs are ATen, so they trace as they are)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from seqcompile.ops.pointwise import region as regions
from seqcompile.ops.random import keep_mask
from seqcompile.ops.wide_evaluation import widened

Tensor = torch.Tensor

DTYPE_CODES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.bool, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
)  # fmt: skip
"""Dtype codes of `pointwise_backward`'s `dtypes` argument (custom ops take no dtype lists)."""


def broadcast_shape(inputs: Sequence[Tensor]) -> torch.Size:
    """The region's shape: its inputs broadcast together."""
    return torch.broadcast_shapes(*(t.shape for t in inputs))


def forward(*, inputs: list[Tensor], seed, stream: int, region: str) -> list[Tensor]:
    """The region's forward, each op as the program calls it (in float64 where torch's float32
    kernels depend on the machine), masks drawn from the seed as the kernel draws them."""
    program = regions.lookup(region)
    shape = broadcast_shape(inputs)
    dtypes = regions.output_dtypes(program, [t.dtype for t in inputs])
    masks = [keep_mask(seed, shape, stream + k, p) for k, p in enumerate(program.dropout_p)]
    results = widened(program.written)(*inputs, *masks)
    return [r.to(d).expand(shape).contiguous() for r, d in zip(results, dtypes, strict=True)]


def plan_key(arguments: Mapping[str, Any]) -> tuple[tuple, tuple, tuple]:
    """The key of the derived backward a `pointwise_backward` call runs (`regions.backward_plan`),
    from its arguments by name."""
    needs_grad, grad_terms, written = (
        tuple(arguments[name]) for name in ("needs_grad", "grad_terms", "written")
    )
    return needs_grad, grad_terms, written


def backward(*, saved, grads, seed, stream, region, dtypes, **plan) -> list[Tensor]:
    """`pointwise_backward` on CPU: the derived graph run with the captured dtypes on inputs
    expanded to the region's shape, masks drawn from the seed as the kernel draws them (`plan`:
    the arguments that key the derived backward)."""
    plan = regions.backward_plan(region, *plan_key(plan))
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
