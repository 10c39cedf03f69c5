"""The memory plans of a GPT-2-small-shaped training step under budgets 1, 0.5, 0.25 and 0.1, by
seqfast's planner and by torch's `activation_memory_budget` (`checkpoint="torch"`) on the same
fused graph: kept bytes (and their ratio to what eager keeps), the bytes recomputed instead, the
recompute FLOPs, the planned peak and the step's roofline time; with the plan that recomputes
nothing (`checkpoint="none"`) and eager beside them. The model is compiled on the meta device, so
the table needs no GPU and holds no timing: every number is a property of the plan, and eager's
kept bytes are what its saved-tensor hooks see on meta tensors.

    python -m benchmarks.memory_plans [--quick] [--batch 8] [--length 1024] [--output FILE]
"""

from __future__ import annotations

import torch

from benchmarks.common import emit, header, model_setup, table
from seqcompile.demo import GPT, toy_batch
from seqcompile.memory import dry_run
from seqcompile.memory.saved import saved_bytes

BUDGETS = (1.0, 0.5, 0.25, 0.1)


def main() -> None:
    args, _, config, batch, length = model_setup(__doc__)
    torch.manual_seed(0)
    model = dry_run.meta_copy(GPT(config).to(torch.bfloat16))
    tokens = toy_batch(config, batch, length, torch.device("cpu"), torch.Generator())
    example = dry_run.at_batch_size(tokens, batch)
    eager = saved_bytes(lambda: model(*example), [*model.parameters(), *example])
    rows = [("eager", "-", eager / 2**20, 1.0, "-", "-", "-", "-")]
    names = {"none": "seqfast, nothing recomputed", "auto": "seqfast", "torch": "torch's min-cut"}
    for budget in BUDGETS:
        for planner in ("none", "auto", "torch") if budget == 1.0 else ("auto", "torch"):
            if planner == "torch" and budget == 1.0:
                continue
            options = {"memory_budget": budget, "checkpoint": planner}
            (plan,) = dry_run.memory_plans(model, example, options)
            step = plan.step
            rows.append(
                (
                    names[planner],
                    f"{budget:g}",
                    step.kept_bytes / 2**20,
                    step.kept_bytes / eager,
                    step.recomputed_bytes / 2**20,
                    plan.recompute.flops / 1e9 if plan.recompute else 0.0,
                    step.peak_bytes / 2**20,
                    plan.step_seconds * 1e3,
                )
            )
    lines = header(
        "Memory plans, GPT-2-small shape: what each planner keeps and recomputes",
        torch.device("meta"),
        "benchmarks.memory_plans",
    )
    lines += [
        f"{config.n_layers} layers, d_model {config.d_model}, vocab {config.vocab}; batch {batch}"
        f" x {length} tokens, bfloat16 weights and activations, dropout {config.dropout}."
        " Compiled on the meta device with the eager executor: nothing ran, so there are no"
        " timings; the roofline time prices each node on H100 figures (peak bf16 FLOP/s, HBM"
        " bandwidth, a launch) and is an estimate for comparing plans. Peak is the memory"
        " model's (activations and gradients made so far; parameters apart).",
        "",
    ]
    columns = ["planner", "budget", "kept MiB", "kept / eager", "recomputed MiB", "recompute GFLOP"]
    lines += table([*columns, "peak MiB", "roofline ms"], rows)
    emit(lines, args.output)


if __name__ == "__main__":
    main()
