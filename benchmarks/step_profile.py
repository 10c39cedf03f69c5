"""Where a training step's time goes, for eager, Inductor and seqfast: torch.profiler over two
steps of the demo GPT (GPT-2-small scale, bf16 autocast) after warm-up. Per executor: the device
time per step by kernel group (seqfast's attention forward and backward, norms, pointwise and loss;
SDPA's kernels; matmuls; Inductor's pointwise kernels and reductions; copies and casts; the
optimizer), kernels launched per step, the host's time to enqueue a step (until the optimizer step
returns, before waiting for the device), the fraction of the step the device is busy, and, for
seqfast, what each fused operator runs (its kernels or its lowering, and why).

    python -m benchmarks.step_profile [--quick | --short] [--output benchmarks/results/<device>.md]

On a CPU (a smoke run) the groups are the CPU time of the ATen and seqfast ops by the same names."""

from __future__ import annotations

import copy
import re
import time
from collections import Counter
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import brief, emit_with_failures, header, model_setup, table
from seqcompile import report
from seqcompile.demo import GPT, toy_batch

GROUPS: tuple[tuple[str, str], ...] = (
    ("seqfast attention forward", r"^(attention_fwd|seqfast::attention$)"),
    ("seqfast attention backward", r"^(attention_bwd|seqfast::attention_backward)"),
    ("seqfast norms", r"^(add_norm|column_sum|seqfast::add_norm)"),
    ("seqfast pointwise", r"^(pointwise_|seqfast::pointwise)"),
    (
        "seqfast loss",
        r"^((soft_)?cross_entropy_[0-9a-f]{16}|seqfast::(soft_)?cross_entropy|seqfast::linear_)",
    ),
    ("SDPA kernels", r"flash|fmha|cudnn|efficient_attention|scaled_dot_product"),
    ("matmuls", r"gemm|cutlass|xmma|nvjet|cublas|^aten::(mm|addmm|bmm|matmul|linear)$"),
    ("Inductor pointwise", r"^triton_poi"),
    ("Inductor reductions", r"^triton_(red|per)"),
    ("copies and casts", r"copy|memcpy|memset|^aten::(to|_to_copy|cat)$"),
    ("optimizer", r"adam|multi_tensor|foreach"),
)
"""Each group's kernels (seqfast's are named by their template; on a CPU, its ops and ATen's by
their names), searched for in order, case ignored; a name no group takes counts as "other"."""

PROFILED_STEPS = 2


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, re.IGNORECASE):
            return group
    return "other"


def step_once(model, step_model, optimizer, data, device, dtype) -> float:
    """One training step; the host's seconds until it has enqueued the whole step."""
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=dtype):
        loss = step_model(*data)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def profiled(model, step_model, config, *, batch, length, warmup, device, dtype) -> dict[str, Any]:
    """Warm up, then profile `PROFILED_STEPS` steps: time per group, launches, host and wall
    milliseconds per step, the device's busy fraction."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    data = toy_batch(config, batch, length, device, torch.Generator().manual_seed(0))
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step_once(model, step_model, optimizer, data, device, dtype)
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    host = 0.0
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            host += step_once(model, step_model, optimizer, data, device, dtype)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = [e for e in prof.events() if _on_device(e, cuda)]
    by_group: Counter[str] = Counter()
    for event in events:
        by_group[group_of(event.name)] += _self_us(event, cuda)
    return {
        "groups": {g: us / 1e3 / PROFILED_STEPS for g, us in by_group.items()},
        "launches": len(events) / PROFILED_STEPS if cuda else None,
        "host_ms": host * 1e3 / PROFILED_STEPS,
        "wall_ms": wall * 1e3 / PROFILED_STEPS,
        "busy": _busy_us(events) / (wall * 1e6) if cuda else None,
    }


def _on_device(event: Any, cuda: bool) -> bool:
    """A kernel on CUDA; on a CPU, an op called from Python's level (no parent op), whose self
    time is what it ran itself."""
    if cuda:
        return event.device_type == torch.autograd.DeviceType.CUDA
    return event.device_type == torch.autograd.DeviceType.CPU and "::" in event.name


def _self_us(event: Any, cuda: bool) -> float:
    return event.device_time_total if cuda else event.self_cpu_time_total


def _busy_us(events: list[Any]) -> float:
    """Microseconds during which at least one kernel runs (overlaps counted once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def _runs(use) -> str:
    """What a fused call runs, and for its kernels who launches them."""
    if use.implementation != "kernel":
        return use.implementation
    launched = "launched by the executor" in use.reason
    return "kernel, launched by the executor" if launched else "kernel, called as an op"


def main() -> None:
    args, device, config, batch, length = model_setup(__doc__)
    dtype = torch.bfloat16
    warmup = 2 if args.quick else 3
    torch.manual_seed(0)
    base = GPT(config).to(device)
    executors = {"eager": lambda m: m, "seqfast": lambda m: torch.compile(m, backend="seqfast")}
    if not args.no_inductor:
        executors["inductor"] = torch.compile
    results, failures, runs = {}, [], Counter()
    for name, wrap in executors.items():
        model = copy.deepcopy(base)
        try:
            with report.collecting() as seen:
                results[name] = profiled(
                    model, wrap(model), config, batch=batch, length=length, warmup=warmup,
                    device=device, dtype=dtype,
                )  # fmt: skip
        except (RuntimeError, AssertionError) as error:  # recorded, counted, not hidden
            failures.append(f"{name}: {brief(error)}")
            print("FAILED:", failures[-1], flush=True)
        if name == "seqfast":
            runs = Counter(f"{u.op} {u.direction}: {_runs(u)}" for u in seen.implementations)
        del model
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    unit = "device" if device.type == "cuda" else "CPU"
    lines = header("Where a training step's time goes", device, "benchmarks.step_profile")
    lines += [
        f"- the demo GPT: {config.n_layers} layers, d_model {config.d_model}, vocab {config.vocab};"
        f" batch {batch} x {length} tokens, bf16 autocast; {PROFILED_STEPS} steps profiled after"
        f" {warmup} warm-up steps; {unit} ms per step by group",
        "",
    ]
    names = list(results)
    groups = [g for g, _ in GROUPS] + ["other"]
    rows = [[g, *(results[n]["groups"].get(g, 0.0) for n in names)] for g in groups]
    rows += [
        ["launches per step", *(results[n]["launches"] or "" for n in names)],
        ["host ms to enqueue a step", *(results[n]["host_ms"] for n in names)],
        ["wall ms per step", *(results[n]["wall_ms"] for n in names)],
        ["device busy", *(results[n]["busy"] or "" for n in names)],
    ]
    lines += table(["", *names], rows)
    if runs:
        lines += ["", "What seqfast's fused calls run (calls per compile):", ""]
        lines += [f"- {what}: {n}" for what, n in sorted(runs.items())]
    emit_with_failures(lines, failures, args.output, "benchmarks.step_profile")


if __name__ == "__main__":
    main()
