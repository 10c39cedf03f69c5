"""Fused pointwise regions against eager PyTorch and Inductor: bias + GELU + dropout and
SwiGLU + dropout, forward and forward + backward, in time, achieved GB/s and the fraction of the
copy bandwidth measured in the same run.

    python -m benchmarks.pointwise_kernels [--quick | --short] [--output FILE]

The byte count is the least the math must move, the same for every executor. bias + GELU + dropout:
the forward reads x and writes y (2 tensors); the backward reads the output gradient and x and
writes dx (3). SwiGLU + dropout: the forward reads a and b and writes y (3); the backward reads the
output gradient, a and b and writes da and db (5). The bias and the seed are negligible.

Before an executor is timed, its output is checked (kept elements equal the undropped value over
1 - p, about 1 - p of them kept) and, for forward + backward, the gradients shaped like the output
against eager autograd through the executor's own dropout mask; a failing executor is listed and
not timed, and the run exits non-zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
from seqcompile.patterns.pointwise_cut import region_of_function

P = 0.1


def bias_gelu_dropout(x, b):
    return F.dropout(F.gelu(x + b, approximate="tanh"), P)


def swiglu_dropout(a, b):
    return F.dropout(F.silu(a) * b, P)


CASES = {
    "bias+GELU+dropout": (bias_gelu_dropout, lambda x, b: F.gelu(x + b, approximate="tanh"), 2, 3),
    "SwiGLU+dropout": (swiglu_dropout, lambda a, b: F.silu(a) * b, 3, 5),
}


def seqfast_executor(fn, inputs):
    region = region_of_function(fn, inputs)
    seed = torch.tensor(1234, dtype=torch.int64, device=inputs[0].device)

    def run(*args):
        return torch.ops.seqfast.pointwise(list(args), seed, 1, region.key)[0]

    return run


def check(out, undropped):
    """Correct first: kept elements are the undropped value scaled by 1 / (1 - p), and about
    1 - p of them are kept."""
    kept = out != 0
    ratio = kept.float().mean().item()
    assert abs(ratio - (1 - P)) < 0.01, f"keep ratio {ratio:.3f}"
    expected = (undropped / (1 - P))[kept].float()
    torch.testing.assert_close(out[kept].float(), expected, atol=5e-2, rtol=2e-2)


def check_gradients(got, out, undropped, undropped_fn, inputs, grad):
    """The gradients of the inputs shaped like the output, against eager autograd of the undropped
    function with the cotangent through the executor's own dropout mask (read off its output),
    where that mask is unambiguous (the undropped value is not 0). A broadcast input's gradient
    sums over rows, ambiguous elements included: the GPU tests check it against the reference."""
    kept = out != 0
    expected = torch.autograd.grad(undropped_fn(*inputs), inputs, grad * kept / (1 - P))
    clear = undropped != 0
    for name, have, want in zip("ab", got, expected, strict=True):
        if want.shape == out.shape:
            torch.testing.assert_close(
                have[clear].float(), want[clear].float(), atol=5e-2, rtol=2e-2,
                msg=lambda m, name=name: f"gradient of input {name}: {m}",
            )  # fmt: skip


def bench(name, rows, width, dtype, device, backward, inductor):
    """({executor: ms}, bytes moved, {executor: why it was not timed})."""
    fn, undropped_fn, fwd_tensors, bwd_tensors = CASES[name]
    torch._dynamo.reset()  # past `recompile_limit` compiles of `fn`, Dynamo would run it eagerly
    g = torch.Generator(device=device).manual_seed(0)
    first = torch.randn(rows, width, device=device, dtype=dtype, generator=g)
    second_shape = (width,) if name.startswith("bias") else (rows, width)
    second = torch.randn(second_shape, device=device, dtype=dtype, generator=g)
    inputs = [first.requires_grad_(backward), second.requires_grad_(backward)]
    executors = {"eager": fn, "seqfast": seqfast_executor(fn, inputs)}
    if inductor:
        executors["inductor"] = torch.compile(fn, dynamic=False)
    undropped = undropped_fn(*inputs).detach()
    grad = torch.randn_like(undropped)
    times, failed = {}, {}
    for executor, run in executors.items():
        try:
            out = run(*inputs)
            check(out.detach(), undropped)
            if backward:
                got = torch.autograd.grad(out, inputs, grad)
                check_gradients(got, out.detach(), undropped, undropped_fn, inputs, grad)
            del out
        except (RuntimeError, AssertionError) as error:  # recorded, counted, not timed
            failed[executor] = brief(error)
            continue

        def step(run=run):
            out = run(*inputs)
            if backward:
                torch.autograd.grad(out, inputs, grad)

        times[executor] = timed_ms(step, device)
    moved = (fwd_tensors + (bwd_tensors if backward else 0)) * rows * width * dtype.itemsize
    return times, moved, failed


def main() -> None:
    args, device, dtype = standard_setup(__doc__)
    shapes = [(16384, 3072), (32768, 4096), (8192, 11008)]
    if args.quick or args.short:
        shapes = [(256, 64)] if args.quick else [(16384, 4096)]
    ceiling = copy_bandwidth_gbs(device, 8 if args.quick else 1024)
    lines = header("Fused pointwise regions", device, "benchmarks.pointwise_kernels")
    lines += [f"Measured copy bandwidth (read + write): {ceiling:.0f} GB/s. dtype {dtype}.", ""]
    rows_out, failures = [], []
    for name in CASES:
        for rows, width in shapes:
            for backward in (False, True):
                times, moved, failed = bench(
                    name, rows, width, dtype, device, backward, not args.no_inductor
                )
                case = [name, f"{rows}x{width}", "fwd+bwd" if backward else "fwd"]
                if "eager" not in times:
                    times = {}  # every ratio is to eager
                rows_out += bandwidth_rows(case, times, moved, ceiling)
                for row in rows_out[len(rows_out) - len(times) :]:
                    progress(row)
                failures += [f"{' '.join(case)} {who}: {why}" for who, why in failed.items()]
                for failure in failures[len(failures) - len(failed) :]:
                    print("FAILED:", failure, flush=True)
    lines += table(["region", "rows x width", "pass", *BANDWIDTH_COLUMNS], rows_out)
    if failures:
        lines += ["", "Failed, not timed (the output or a gradient disagrees with eager's, or the"
                  " run raised):", *(f"- {failure}" for failure in failures)]  # fmt: skip
    emit(lines, args.output)
    if failures:
        raise SystemExit(f"benchmarks.pointwise_kernels: {len(failures)} executor runs failed")


if __name__ == "__main__":
    main()
