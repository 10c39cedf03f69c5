"""The generated kernels of `seqfast::add_norm` and its backward: which kernels a call launches,
their launch configurations, and the launchers, taking the op's arguments by name."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from seqcompile.codegen import KernelSpec, kernel_function, tuning
from seqcompile.codegen.tuning import Config
from seqcompile.ops.add_norm import reference
from seqcompile.run import copies, runtime

Tensor = torch.Tensor


def forward_spec(
    *, residual: bool, branch_bias: bool, dropout: bool, rms: bool, weight: bool, bias: bool
) -> KernelSpec:
    return KernelSpec.of(
        "add_norm_fwd",
        residual=residual,
        branch_bias=branch_bias,
        dropout=dropout,
        rms=rms,
        weight=weight,
        bias=bias,
        write_sum=residual or branch_bias or dropout,
    )


def backward_specs(
    *,
    sum_grad: bool,
    residual_grad: bool,
    dropout: bool,
    rms: bool,
    weight: bool,
    bias: bool,
    branch_bias: bool,
) -> list[KernelSpec]:
    partials = [
        name
        for name, present in (("weight", weight), ("bias", bias), ("branch_bias", branch_bias))
        if present
    ]
    specs = [
        KernelSpec.of(
            "add_norm_bwd",
            sum_grad=sum_grad,
            residual_grad=residual_grad,
            dropout=dropout,
            rms=rms,
            weight=weight,
            partials=tuple(partials),
        )
    ]
    if partials:
        specs.append(COLUMN_SUM)
    return specs


COLUMN_SUM = KernelSpec.of("column_sum")


def forward_kernels_of(call: Mapping[str, Any]) -> list[KernelSpec]:
    """The kernel an `add_norm` call launches (`call`: its arguments by name, as a graph node's
    `Call` or the launcher's own), its flags read from the arguments."""
    optional = ("residual", "branch_bias", "weight", "bias")
    present = {name: call[name] is not None for name in optional}
    return [forward_spec(dropout=call["p"] > 0, rms=call["rms"], **present)]


def backward_kernels_of(call: Mapping[str, Any]) -> list[KernelSpec]:
    """The kernels an `add_norm_backward` call launches (the column sum only when the norm has a
    weight, bias or branch bias)."""
    residual_dtype = call["residual_dtype"]
    return backward_specs(
        sum_grad=call["grad_sum"] is not None,
        residual_grad=residual_dtype is not None
        and reference.needs_residual_grad(call["p"], call["x_dtype"], residual_dtype),
        dropout=call["p"] > 0,
        rms=call["rms"],
        weight=call["weight"] is not None,
        bias=call["bias_dtype"] is not None,
        branch_bias=call["branch_bias_dtype"] is not None,
    )


def _rows(t: Tensor, argument: str) -> Tensor:
    """`t` as contiguous (rows, width), a copy counted where it takes one; the rows counted, as
    -1 is ambiguous at width 0."""
    return copies.for_kernel(t, "add_norm", argument, _as_rows)


def _as_rows(t: Tensor) -> Tensor:
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]).contiguous()


def _vector(t: Tensor | None, argument: str) -> Tensor | None:
    return None if t is None else copies.for_kernel(t, "add_norm", argument)


def row_configs(width: int, device_type: str) -> list[Config]:
    """Launch configurations of the row kernels (forward and backward) at `width`: the row held
    whole (BLOCK_N, the width padded to a power of two), 256 columns per warp by default, half and
    twice as many warps besides on CUDA."""
    block_n = triton.next_power_of_2(width)
    warps = min(max(block_n // 256, 1), 16)
    others = [w for w in (warps // 2, warps * 2) if 1 <= w <= 16] if device_type == "cuda" else []
    return [Config.of(BLOCK_N=block_n, num_warps=w) for w in (warps, *others)]


def column_configs(width: int, sums: int, device_type: str) -> list[Config]:
    """Launch configurations of the column sum of `sums` partial buffers at `width`: by default
    column blocks narrow enough that about 128 programs share the work (32 to 256 columns)."""
    block_n = min(256, triton.next_power_of_2(max(width, 1)))
    if device_type != "cuda":
        return [Config.of(BLOCK_G=16, BLOCK_N=block_n)]
    wide = max(32, min(256, 1 << (max(width * sums // 128, 1).bit_length() - 1)))
    return [Config.of(BLOCK_G=16, BLOCK_N=n) for n in dict.fromkeys((wide, 32, 64, 128, 256))]


def _launch(spec: KernelSpec, space: list[Config], rows: int, grid_of, launch, data: Tensor):
    """Launch the kernel of `spec` at the configuration chosen for `rows` rows of `data`'s
    dtype and width: `launch(config, grid)`, the grid from `grid_of(config)`."""
    width, device = data.shape[-1], data.device
    sizes = (data.dtype, *(triton.next_power_of_2(max(n, 1)) for n in (width, rows)))
    tuning.launch(spec, sizes, space, lambda c: launch(c, grid_of(c)), device)


def forward(**arguments: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward's kernel launched on the op's arguments by name."""
    x, residual, branch_bias, weight, bias = (
        arguments[name] for name in ("x", "residual", "branch_bias", "weight", "bias")
    )
    seed, stream, p, eps, rms = (arguments[name] for name in ("seed", "stream", "p", "eps", "rms"))
    out_dtype, sum_dtype = arguments["out_dtype"], arguments["sum_dtype"]
    n = x.shape[-1]
    x2 = _rows(x, "x")
    m = x2.shape[0]
    prologue = reference.has_prologue(residual, branch_bias, p)
    out = runtime.empty((m, n), out_dtype, x.device)
    total = runtime.empty((m, n) if prologue else (0,), sum_dtype, x.device)
    mean = runtime.empty((0,) if rms else (m,), torch.float32, x.device)
    rstd = runtime.empty((m,), torch.float32, x.device)
    if n == 0:  # rows of nothing: eager's mean and 1/std of no elements are NaN
        mean.fill_(math.nan)
        rstd.fill_(math.nan)
    elif m > 0:
        (spec,) = forward_kernels_of(arguments)
        optional = (
            _rows(residual, "residual") if residual is not None else None,
            _vector(branch_bias, "branch_bias"),
            _vector(weight, "weight"),
            _vector(bias, "bias"),
            seed if p > 0 else None,
        )
        outputs = (out, total if prologue else None, None if rms else mean, rstd)
        scalars = (n, eps) + ((p, stream) if p > 0 else ())
        _launch(
            spec, row_configs(n, x.device.type), m, lambda c: (m,),
            lambda c, grid: kernel_function(spec)[grid](
                x2, *(t for t in optional if t is not None),
                *(t for t in outputs if t is not None), *scalars, **c.launch_options(),
            ),
            x,
        )  # fmt: skip
    rows = x.shape[:-1]
    return (
        out.view(x.shape),
        total.view(x.shape) if prologue else total,
        mean if rms else mean.view(rows),
        rstd.view(rows),
    )


def backward(**arguments: Any) -> tuple[Tensor, ...]:
    """The backward's kernels launched on the op's arguments by name."""
    grad_out, grad_sum, saved, mean, rstd = (
        arguments[name] for name in ("grad_out", "grad_sum", "saved", "mean", "rstd")
    )
    weight, seed, stream, p, rms = (
        arguments[name] for name in ("weight", "seed", "stream", "p", "rms")
    )
    shapes = reference.grad_shapes(**arguments)
    dx, dres, dweight, dbias, dbranch_bias = (
        runtime.empty(tuple(shape), dtype, saved.device) for shape, dtype in shapes
    )
    params = [t for t in (dweight, dbias, dbranch_bias) if t.numel() > 0]
    n = saved.shape[-1]
    s2 = _rows(saved, "saved")
    m = s2.shape[0]
    if m == 0 or n == 0:
        for t in params:
            t.zero_()
        return dx, dres, dweight, dbias, dbranch_bias
    residual_grad = dres.numel() > 0
    programs = min(m, runtime.program_cap(saved))
    partial = runtime.empty((len(params), programs, n), torch.float32, saved.device)
    specs = backward_kernels_of(arguments)
    optional_inputs = (
        _rows(grad_sum, "grad_sum") if grad_sum is not None else None,
        s2,
        None if rms else mean.reshape(-1),
        rstd.reshape(-1),
        _vector(weight, "weight"),
        seed if p > 0 else None,
    )
    outputs = (
        dx.view(m, n),
        dres.view(m, n) if residual_grad else None,
        partial if params else None,
    )
    _launch(
        specs[0], row_configs(n, saved.device.type), m, lambda c: (programs,),
        lambda c, grid: kernel_function(specs[0])[grid](
            _rows(grad_out, "grad_out"), *(t for t in optional_inputs if t is not None),
            *(t for t in outputs if t is not None), m, n, *((p, stream) if p > 0 else ()),
            **c.launch_options(),
        ),
        saved,
    )  # fmt: skip
    if params:
        outs = [*params, *[None] * (3 - len(params))]
        _launch(
            COLUMN_SUM, column_configs(n, len(params), saved.device.type), programs,
            lambda c: (triton.cdiv(n, c["BLOCK_N"]), len(params)),
            lambda c, grid: kernel_function(COLUMN_SUM)[grid](
                partial, *outs, programs, n, len(params), **c.launch_options()
            ),
            partial,
        )  # fmt: skip
    return dx, dres, dweight, dbias, dbranch_bias
