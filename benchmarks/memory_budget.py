"""Memory budgets on a GPT-2-small-shaped training step: what the forward keeps for the backward,
what the backward recomputes (FLOPs), the step's peak and time, for seqfast's planner and for
torch's `activation_memory_budget` (`checkpoint="torch"`) on the same fused graph, at budgets 1.0,
0.5 and 0.25, with eager and Inductor alongside, measured in one run.

    python -m benchmarks.memory_budget [--quick | --short] [--batch 8] [--length 1024]
        [--output FILE]

`--short` measures budget 0.5 by both planners, then 1.0 by seqfast's, 3 steps after one.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch

from benchmarks.common import (
    brief,
    device_name,
    emit_with_failures,
    header,
    model_setup,
    progress,
    table,
)
from seqcompile.demo import GPT, toy_batch
from seqcompile.report import collecting

BUDGETS = (1.0, 0.5, 0.25)


@dataclasses.dataclass
class Row:
    executor: str
    planner: str
    budget: str
    kept_mib: object
    recompute_gflop: object
    peak_mib: float
    step_ms: float
    loss: float
    check: str


def run(model, compiled, config, *, batch, length, steps, device) -> tuple[float, float, float]:
    """Median step milliseconds, peak MiB around the steps (CUDA), and the first loss."""
    idx, targets = toy_batch(config, batch, length, device, torch.Generator().manual_seed(0))
    times, first_loss = [], None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = compiled(idx, targets)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        first_loss = loss.item() if first_loss is None else first_loss
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return sorted(times[1:])[len(times[1:]) // 2], peak, first_loss


def main() -> None:
    args, device, config, batch, length = model_setup(__doc__, extra=[("--steps", 5)])
    steps = 1 if args.quick else min(args.steps, 3) if args.short else args.steps
    torch.manual_seed(0)
    base = GPT(config).to(device)
    cases = [("eager", "-", "-", None)]
    if not args.no_inductor:
        cases.append(("inductor", "-", "-", {}))
    # --short: the planners compared at one budget first, so a run cut short still compares them
    pairs = [(planner, budget) for planner in ("auto", "torch") for budget in BUDGETS]
    if args.short:
        pairs = [("auto", 0.5), ("torch", 0.5), ("auto", 1.0)]
    for planner, budget in pairs:
        if planner == "torch" and budget == 1.0:
            continue
        options = {"memory_budget": budget, "checkpoint": planner}
        name = "seqfast" if planner == "auto" else "seqfast, torch's planner"
        cases.append((name, planner, f"{budget:g}", options))
    rows, failures, eager_loss = [], [], None
    for executor, planner, budget, options in cases:
        torch._dynamo.reset()
        model = compiled = copy.deepcopy(base)
        try:
            if executor == "inductor":
                compiled = torch.compile(model)
            elif options is not None:
                compiled = torch.compile(model, backend="seqfast", options=options)
            with collecting() as report:
                ms, peak, loss = run(
                    model, compiled, config, batch=batch, length=length, steps=steps, device=device
                )
        except (RuntimeError, AssertionError) as error:  # recorded, counted, not hidden
            failures.append(f"{executor} {planner} {budget}: {brief(error)}")
            print("FAILED:", failures[-1][:200], flush=True)
            del model, compiled
            continue
        kept = sum(p.step.kept_bytes for p in report.memory) / 2**20 if report.memory else "-"
        flops = sum(p.recompute.flops for p in report.memory) / 1e9 if report.memory else "-"
        # the same weights, batch and seed: the first loss must agree with eager's
        check = "the reference" if executor == "eager" else "no reference"
        if executor == "eager":
            eager_loss = loss
        elif eager_loss is not None:
            check = "ok" if abs(loss - eager_loss) <= 2e-2 * abs(eager_loss) else "MISMATCH"
            if check == "MISMATCH":
                failures.append(
                    f"{executor} {planner} {budget}: loss {loss:.4f} vs {eager_loss:.4f}"
                )
        rows.append(Row(executor, planner, budget, kept, flops, peak, ms, loss, check))
        progress(dataclasses.astuple(rows[-1]))
        del model, compiled
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lines = header(
        "Memory budget, GPT-2-small shape: kept bytes, recompute, peak and step time",
        device,
        "benchmarks.memory_budget",
    )
    precision = "bf16 autocast" if device.type == "cuda" else "float32"
    lines += [
        f"{config.n_layers} layers, d_model {config.d_model}, vocab {config.vocab}; batch {batch}"
        f" x {length} tokens, {precision}, dropout {config.dropout}; forward + backward, median"
        f" of {steps} steps after one; check: the first loss within 2% of eager's. Kept and"
        " recompute GFLOP come from the partitioned graphs"
        " (the memory model); peak is torch.cuda.max_memory_allocated around the steps"
        " (parameters and gradients included; nan on CPU). Both planners run on the same fused"
        f" graph. Device: {device_name(device)}.",
        "",
    ]
    columns = [
        "executor",
        "planner",
        "budget",
        "kept MiB",
        "recompute GFLOP",
        "peak MiB",
        "step ms",
    ]
    lines += table([*columns, "loss", "check"], [dataclasses.astuple(row) for row in rows])
    emit_with_failures(lines, failures, args.output, "benchmarks.memory_budget")


if __name__ == "__main__":
    main()
