"""Fused residual + norm kernels against eager PyTorch and Inductor: time, achieved GB/s and the
fraction of the copy bandwidth measured in the same run, forward and forward + backward.

    python -m benchmarks.norm_kernels [--quick] [--output benchmarks/results/<device>.md]

The byte count is the least the math must move, the same for every executor: forward reads x and
the residual and writes the output and the sum (pre-LN keeps it); the backward reads the output
gradient and the sum and writes the input gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import seqcompile.ops.norm  # noqa: F401  (registers torch.ops.seqfast.add_norm)
from benchmarks.common import (
    BANDWIDTH_COLUMNS,
    bandwidth_rows,
    copy_bandwidth_gbs,
    emit,
    header,
    standard_setup,
    table,
    timed_ms,
)


def eager_add_norm(x, residual, weight, bias, rms):
    total = x + residual
    if rms:
        return F.rms_norm(total, total.shape[-1:], weight, 1e-5), total
    return F.layer_norm(total, total.shape[-1:], weight, bias, 1e-5), total


def seqfast_add_norm(x, residual, weight, bias, rms):
    out, total, _, _ = torch.ops.seqfast.add_norm(
        x, residual, None, weight, None if rms else bias, None, 0, 0.0, 1e-5, rms, x.dtype, x.dtype
    )
    return out, total


def bench_case(executors, rows, width, dtype, rms, device, backward):
    g = torch.Generator(device=device).manual_seed(0)
    x, residual = (
        torch.randn(rows, width, device=device, dtype=dtype, generator=g) for _ in range(2)
    )
    weight, bias = (torch.randn(width, device=device, dtype=dtype, generator=g) for _ in range(2))
    grads = [torch.randn_like(x), torch.randn_like(x)]
    if backward:
        for t in (x, residual, weight, bias):
            t.requires_grad_(True)
    results = {}
    reference = None
    for name, fn in executors.items():
        outputs = fn(x, residual, weight, bias, rms)
        if reference is None:
            reference = [o.detach().float() for o in outputs]
        else:  # correct first: every executor must agree before it is timed
            for o, r in zip(outputs, reference, strict=True):
                torch.testing.assert_close(o.detach().float(), r, atol=5e-2, rtol=5e-2)

        def step(fn=fn):
            outs = fn(x, residual, weight, bias, rms)
            if backward:
                torch.autograd.backward(outs, grads)

        results[name] = timed_ms(step, device)
        if backward:
            for t in (x, residual, weight, bias):
                t.grad = None
    elements = rows * width * dtype.itemsize
    moved = 4 * elements + (3 * elements if backward else 0)
    return results, moved


def main() -> None:
    args, device, dtype = standard_setup(__doc__)
    rows = 256 if args.quick else 32768
    widths = (64, 96) if args.quick else (768, 1024, 4096, 8192)
    ceiling = copy_bandwidth_gbs(device, 8 if args.quick else 1024)

    executors = {"eager": eager_add_norm, "seqfast": seqfast_add_norm}
    if not args.no_inductor:
        executors["inductor"] = torch.compile(eager_add_norm, dynamic=False)
    lines = header("Fused residual + norm kernels", device, "benchmarks.norm_kernels")
    lines += [f"Measured copy bandwidth (read + write): {ceiling:.0f} GB/s. dtype {dtype}.", ""]
    rows_out = []
    for rms in (False, True):
        for width in widths:
            for backward in (False, True):
                times, moved = bench_case(executors, rows, width, dtype, rms, device, backward)
                case = [
                    "rms" if rms else "layer",
                    f"{rows}x{width}",
                    "fwd+bwd" if backward else "fwd",
                ]
                rows_out += bandwidth_rows(case, times, moved, ceiling)
    lines += table(["norm", "rows x width", "pass", *BANDWIDTH_COLUMNS], rows_out)
    emit(lines, args.output)


if __name__ == "__main__":
    main()
