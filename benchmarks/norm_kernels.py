"""Fused residual + norm kernels against eager PyTorch and Inductor: time, achieved GB/s and the
fraction of the copy bandwidth measured in the same run, forward and forward + backward.

    python -m benchmarks.norm_kernels [--quick | --short] [--output FILE]

The byte count is the least the math must move, the same for every executor: forward reads x and
the residual and writes the output and the sum (pre-LN keeps it); the backward reads the output
gradient and the sum and writes the input gradient.

Before an executor is timed, its outputs (and for forward + backward, the gradients of x, the
residual, the weight and the bias) are checked against eager's; a failing executor is listed and not
timed, and the run exits non-zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import seqcompile.ops.add_norm  # noqa: F401  (registers torch.ops.seqfast.add_norm)
from benchmarks.common import (
    BANDWIDTH_COLUMNS,
    bandwidth_rows,
    brief,
    copy_bandwidth_gbs,
    emit,
    header,
    progress,
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
    """({executor: ms}, bytes moved, {executor: why it was not timed})."""
    # Dynamo compiles a function at most `recompile_limit` (8) times, then runs it eagerly without
    # an error: each case's shapes and flags start from an empty cache instead.
    torch._dynamo.reset()
    g = torch.Generator(device=device).manual_seed(0)
    x, residual = (
        torch.randn(rows, width, device=device, dtype=dtype, generator=g) for _ in range(2)
    )
    weight, bias = (torch.randn(width, device=device, dtype=dtype, generator=g) for _ in range(2))
    grads = [torch.randn_like(x), torch.randn_like(x)]
    inputs = (x, residual, weight, bias)
    if backward:
        for t in inputs:
            t.requires_grad_(True)
    results, failed = {}, {}
    reference = None
    for name, fn in executors.items():
        try:
            got = check_outputs(fn, inputs, grads, rms, backward)
            if reference is None:
                reference = got
            else:  # correct first: every executor must agree before it is timed
                for o, r in zip(got, reference, strict=True):
                    assert (o is None) == (r is None), "a gradient is missing"
                    if r is not None:  # relative to the largest: weight gradients sum over rows
                        scale = r.abs().max().clamp_min(1.0)
                        torch.testing.assert_close(o / scale, r / scale, atol=5e-2, rtol=5e-2)
        except (RuntimeError, AssertionError) as error:  # recorded, counted, not timed
            failed[name] = brief(error)
            continue

        def step(fn=fn):
            outs = fn(x, residual, weight, bias, rms)
            if backward:
                torch.autograd.backward(outs, grads)

        results[name] = timed_ms(step, device)
        if backward:
            for t in inputs:
                t.grad = None
    elements = rows * width * dtype.itemsize
    moved = 4 * elements + (3 * elements if backward else 0)
    return results, moved, failed


def check_outputs(fn, inputs, grads, rms, backward):
    """The outputs (and with `backward`, the gradients of every input) in float32."""
    outputs = fn(*inputs, rms)
    got = [o.detach().float() for o in outputs]
    if backward:
        grad_in = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
        got += [None if t is None else t.float() for t in grad_in]
    return got


def main() -> None:
    args, device, dtype = standard_setup(__doc__)
    rows = 256 if args.quick else 32768
    widths = (64, 96) if args.quick else (4096,) if args.short else (768, 1024, 4096, 8192)
    ceiling = copy_bandwidth_gbs(device, 8 if args.quick else 1024)

    executors = {"eager": eager_add_norm, "seqfast": seqfast_add_norm}
    if not args.no_inductor:
        executors["inductor"] = torch.compile(eager_add_norm, dynamic=False)
    lines = header("Fused residual + norm kernels", device, "benchmarks.norm_kernels")
    lines += [f"Measured copy bandwidth (read + write): {ceiling:.0f} GB/s. dtype {dtype}.", ""]
    rows_out, failures = [], []
    for rms in (False, True):
        for width in widths:
            for backward in (False, True):
                times, moved, failed = bench_case(
                    executors, rows, width, dtype, rms, device, backward
                )
                case = [
                    "rms" if rms else "layer",
                    f"{rows}x{width}",
                    "fwd+bwd" if backward else "fwd",
                ]
                if "eager" not in times:
                    times = {}  # every ratio is to eager
                rows_out += bandwidth_rows(case, times, moved, ceiling)
                for row in rows_out[len(rows_out) - len(times) :]:
                    progress(row)
                failures += [f"{' '.join(case)} {who}: {why}" for who, why in failed.items()]
                for failure in failures[len(failures) - len(failed) :]:
                    print("FAILED:", failure, flush=True)
    lines += table(["norm", "rows x width", "pass", *BANDWIDTH_COLUMNS], rows_out)
    if failures:
        lines += ["", "Failed, not timed (the output or a gradient disagrees with eager's, or the"
                  " run raised):", *(f"- {failure}" for failure in failures)]  # fmt: skip
    emit(lines, args.output)
    if failures:
        raise SystemExit(f"benchmarks.norm_kernels: {len(failures)} executor runs failed")


if __name__ == "__main__":
    main()
