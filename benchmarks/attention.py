"""Fused attention `seqfast::attention` against torch's SDPA (the backend it picks, and cuDNN where
cuDNN takes the case), FlexAttention given the same mask, and the eager matmul-softmax spelling:
time and TFLOP/s, forward and forward + backward, and the fraction of a bf16 matmul measured in the
same run.

    python -m benchmarks.attention [--quick | --short] [--output benchmarks/results/<device>.md]

FLOP convention, the same for every executor (FlashAttention's): the forward is two matmuls,
4 * B * H * Lq * Lk * D, halved when causal (or the causal triangle is read from a mask); the
backward is five matmuls (the scores recomputed, dV, dP, dQ, dK), 2.5x the forward, so forward +
backward counts 3.5x the forward. Bias, masking, softmax and dropout count nothing.

Cases keep the tokens B * L and the hidden size H * D fixed; `--short` adds GPT-2 small's shape
(B 8, H 12, L 1024, D 64) and a LLaMA shape with grouped-query heads (B 4, H 32 over 8 key/value
heads, L 4096, D 128, causal). SDPA runs its flash backend where flash takes the case and torch's
default choice elsewhere; its rows name the backend used. FlexAttention gets the mask as a
`mask_mod` with its block mask (causal, padding by lengths, the triangle read from the mask
tensor) and a full bias as a `score_mod`; it takes no dropout. It is compiled on CUDA and runs
eager, forward only, on CPU (it has no CPU backward). Before an executor is timed it is checked
against SDPA: with dropout off, the largest max|a - b| / max|b| over the output and dq, dk, dv;
with dropout on, shapes and finiteness only. "x sdpa" is sdpa ms / ms, so above 1 is faster than
SDPA. Compile time is never timed (first calls are warm-up). On CUDA, "seqfast(one launch)" and
"seqfast(two launches)" run the backward each way (dq added by dk and dv's kernel, or from its
own), beside "seqfast", which runs the way its first call measured faster.

The cases and their inputs are in `attention_cases`, the executors in `attention_executors`; this
module checks and times each executor on each case and writes the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable

import torch

from benchmarks.attention_cases import Case, Inputs, cases, make_inputs
from benchmarks.attention_executors import backward_forced, executors_of
from benchmarks.common import add_size_options, brief, emit, header, progress, table, timed_ms

Tensor = torch.Tensor
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # max|a - b| / max|b| against SDPA


@dataclasses.dataclass
class Result:
    note: str  # the check column: relative error, or why the executor was not timed
    fwd_ms: float | None = None
    both_ms: float | None = None
    failed: bool = False


def forward_backward(fn: Callable[[Inputs], Tensor], t: Inputs, backward: bool) -> list[Tensor]:
    if not backward:  # FlexAttention on CPU: inputs that need no gradient, the forward only
        with torch.no_grad():
            return [fn(t)]
    out = fn(t)
    return [out.detach(), *torch.autograd.grad(out, (t.q, t.k, t.v), t.grad_out)]


def check(outputs: list[Tensor], reference: list[Tensor] | None, case: Case) -> Result:
    """The executor's output and dq, dk, dv (those it gives) against the reference (SDPA's, unless
    SDPA ran out of memory): numerics with dropout off, shapes and finiteness always."""
    shape = (case.batch, case.heads, case.length, case.head_dim)
    kv_shape = (case.batch, case.heads // case.groups, case.length, case.head_dim)
    shapes = (shape, shape, kv_shape, kv_shape)
    for got, name, want in zip(outputs, ("out", "dq", "dk", "dv"), shapes, strict=False):
        if got.shape != want or not got.isfinite().all():
            return Result(f"{name}: misshapen or not finite", failed=True)
    if reference is None:
        return Result("the reference")
    if case.p > 0:
        return Result("finite (dropout)")
    worst = max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        for a, b in zip(outputs, reference, strict=False)
    )
    failed = worst > TOLERANCE[outputs[0].dtype]
    return Result(f"{'MISMATCH ' if failed else ''}rel err {worst:.1e}", failed=failed)


def time_passes(
    fn: Callable[[Inputs], Tensor], t: Inputs, device: torch.device, backward: bool
) -> list[float | None]:
    with torch.no_grad():
        fwd = timed_ms(lambda: fn(t), device)
    if not backward:
        return [fwd, None]
    both = timed_ms(lambda: torch.autograd.grad(fn(t), (t.q, t.k, t.v), t.grad_out), device)
    return [fwd, both]


def bench_case(case: Case, dtype: torch.dtype, device: torch.device, cap_gib: float):
    """{executor label: Result}, SDPA first: every executor checked against it, then timed."""
    t = make_inputs(case, dtype, device)
    results, reference = {}, None
    for name, executor in executors_of(t, case).items():
        if isinstance(executor, str):
            results[name] = Result(executor)
            continue
        fn = functools.partial(executor, case=case)
        if name == "eager" and case.scores_gib() > cap_gib:
            results[name] = Result(f"skipped: {case.scores_gib():.0f} GiB of scores")
            continue
        backward = name != "flex" or device.type == "cuda"
        try:
            with backward_forced(name):
                outputs = forward_backward(fn, t, backward)
                result = check(outputs, reference, case)
                reference = reference or outputs
                del outputs
                if not result.failed:
                    result.fwd_ms, result.both_ms = time_passes(fn, t, device, backward)
        except torch.cuda.OutOfMemoryError:
            result = Result("OOM")
        except RuntimeError as error:  # recorded and counted as a failure, not hidden
            result = Result(f"error: {brief(error, 80)}", failed=True)
        results[name] = result
    return results


def table_rows(case: Case, results: dict[str, Result], ceiling: float) -> list[list[object]]:
    sdpa = next(r for name, r in results.items() if name.startswith("sdpa"))
    rows = []
    for name, r in results.items():
        cells: list[object] = []
        for ms, backward in ((r.fwd_ms, False), (r.both_ms, True)):
            tflops = case.flops(backward) / (ms * 1e-3) / 1e12 if ms else None
            cells += [ms, tflops, tflops / ceiling] if ms else ["-"] * 3
        ratios = [
            sdpa_ms / ms if ms and sdpa_ms else "-"
            for ms, sdpa_ms in ((r.fwd_ms, sdpa.fwd_ms), (r.both_ms, sdpa.both_ms))
        ]
        rows.append([*case.cells(), name, *cells, *ratios, r.note])
    return rows


def summary(measured: list[tuple[Case, dict[str, Result]]]) -> list[str]:
    """seqfast's forward + backward speed-up over SDPA, where SDPA runs flash and where not, and
    over FlexAttention."""
    groups: dict[str, list[float]] = {"flash": [], "other": [], "flex": []}
    for _, results in measured:
        name, sdpa = next((n, r) for n, r in results.items() if n.startswith("sdpa"))
        ours = results["seqfast"]
        if sdpa.both_ms and ours.both_ms:
            groups["flash" if name == "sdpa(flash)" else "other"].append(
                sdpa.both_ms / ours.both_ms
            )
        flex = results.get("flex")
        if flex is not None and flex.both_ms and ours.both_ms:
            groups["flex"].append(flex.both_ms / ours.both_ms)
    lines = []
    for group, target, against in (
        ("flash", ">= 0.9x", "sdpa (flash)"),
        ("other", "> 1x", "sdpa (not flash)"),
        ("flex", ">= 1x", "flex, same mask"),
    ):
        ratios = groups[group]
        if ratios:
            geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
            lines.append(
                f"- seqfast fwd+bwd vs {against}, target {target}: min {min(ratios):.2f}x, "
                f"geomean {geomean:.2f}x over {len(ratios)} cases"
            )
    return lines


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (timed_ms(lambda: a @ b, device) * 1e-3) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_size_options(parser)
    parser.add_argument(
        "--no-inductor", action="store_true", help="accepted for a uniform interface (no Inductor)"
    )
    parser.add_argument("--output", help="append the markdown table to this file")
    parser.add_argument(
        "--lengths", type=int, nargs="+", help="default 512 1024 2048 4096 8192; 4096 with --short"
    )
    parser.add_argument("--head-dims", type=int, nargs="+", help="default 64 128; 128 with --short")
    parser.add_argument(
        "--eager-cap-gib", type=float, default=8.0,
        help="skip eager past this many GiB of float32 scores; also caps the (1, H, L, L) bias",
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        lengths, head_dims = [64], [32]
    elif args.short:
        lengths, head_dims = args.lengths or [4096], args.head_dims or [128]
    else:
        lengths, head_dims = (
            args.lengths or [512, 1024, 2048, 4096, 8192],
            args.head_dims or [64, 128],
        )
    selected = cases(
        args.quick, lengths, head_dims, dtype.itemsize, args.eager_cap_gib, short=args.short
    )
    matmul_n = 256 if args.quick else 8192
    ceiling = matmul_tflops(device, dtype, matmul_n)

    measured = []
    for case in selected:
        measured.append((case, bench_case(case, dtype, device, args.eager_cap_gib)))
        for row in table_rows(*measured[-1], ceiling):
            progress(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lines = header("Fused attention", device, "benchmarks.attention")
    lines += [
        f"dtype {dtype}; tokens B*L and hidden H*D fixed; measured {matmul_n}^3 matmul: "
        f"{ceiling:.3g} TFLOP/s (the 'of matmul' columns). FLOPs: forward 4*B*H*L*L*D, halved "
        f"when causal (bias 'tri': the causal triangle read from a boolean mask tensor); fwd+bwd "
        f"3.5x forward. 'x sdpa' = sdpa ms / ms. Eager skipped past "
        f"{args.eager_cap_gib:g} GiB of float32 scores.",
        "",
    ]
    columns = ["L", "D", "B x H", "causal", "p", "bias", "executor"]
    for pass_ in ("fwd", "fwd+bwd"):
        columns += [f"{pass_} ms", f"{pass_} TFLOP/s", f"{pass_} of matmul"]
    columns += ["x sdpa fwd", "x sdpa fwd+bwd", "check"]
    lines += table(columns, [row for c, r in measured for row in table_rows(c, r, ceiling)])
    lines += ["", *summary(measured)]
    emit(lines, args.output)
    failed = sum(r.failed for _, results in measured for r in results.values())
    if failed:
        raise SystemExit(
            f"benchmarks.attention: {failed} executor runs failed; see the check column"
        )


if __name__ == "__main__":
    main()
