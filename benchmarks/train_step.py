"""End-to-end training step of a GPT-2-small-shaped model in bf16 autocast: tokens/s and peak
memory for eager, Inductor and seqfast, with ratios to eager, measured in one run.

    python -m benchmarks.train_step [--quick | --short] [--output benchmarks/results/<device>.md]

`--short` keeps the model and batch and times 10 steps after 3 warm-up steps instead of 20 after 5.
"""

from __future__ import annotations

import copy
import time

import torch

from benchmarks.common import brief, emit, header, model_setup, progress, table
from seqcompile.demo import GPT, toy_batch


def measure(model, step_model, config, *, batch, length, steps, warmup, device, dtype):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(0)
    data = [toy_batch(config, batch, length, device, generator) for _ in range(4)]
    losses, seconds = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        idx, targets = data[i % len(data)]
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype):
            loss = step_model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    step_s = sorted(seconds)[len(seconds) // 2]
    return batch * length / step_s, step_s, peak, losses


def main() -> None:
    args, device, config, batch, length = model_setup(__doc__)
    dtype = torch.bfloat16
    steps, warmup = (3, 2) if args.quick else (10, 3) if args.short else (20, 5)
    torch.manual_seed(0)
    base = GPT(config).to(device)
    executors = {"eager": lambda m: m, "seqfast": lambda m: torch.compile(m, backend="seqfast")}
    if not args.no_inductor:
        executors["inductor"] = lambda m: torch.compile(m)
    results, failures = {}, []
    for name, wrap in executors.items():
        model = copy.deepcopy(base)
        try:
            results[name] = measure(
                model, wrap(model), config, batch=batch, length=length, steps=steps,
                warmup=warmup, device=device, dtype=dtype,
            )  # fmt: skip
        except (RuntimeError, AssertionError) as error:  # recorded, counted, not hidden
            failures.append(f"{name}: {brief(error)}")
            print("FAILED:", failures[-1], flush=True)
        else:
            tps, step_s, peak, losses = results[name]
            progress(
                [name, tps, step_s * 1e3, peak / 2**30, f"{losses[0]:.4f} -> {losses[-1]:.4f}"]
            )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    eager_tps, _, eager_peak, eager_losses = results.get("eager", (0.0, 0.0, 0, None))
    rows = []
    for name, (tps, step_s, peak, losses) in results.items():
        # the same weights and batches: the first loss must agree with eager's (dropout differs)
        check = "the reference" if name == "eager" else "no reference"
        if eager_losses is not None and name != "eager":
            check = "ok"
            if abs(losses[0] - eager_losses[0]) > 2e-2 * abs(eager_losses[0]):
                check = "MISMATCH"
                failures.append(
                    f"{name}: first loss {losses[0]:.4f}, eager's {eager_losses[0]:.4f}"
                )
        rows.append(
            [
                name, tps, step_s * 1e3, peak / 2**30, tps / eager_tps if eager_tps else "",
                peak / eager_peak if eager_peak else "", f"{losses[0]:.4f} -> {losses[-1]:.4f}",
                check,
            ]
        )  # fmt: skip
    lines = header(
        "Training step, GPT-2-small shape, bf16 autocast", device, "benchmarks.train_step"
    )
    lines += [
        f"{config.n_layers} layers, d_model {config.d_model}, vocab {config.vocab}; batch {batch} x"
        f" {length} tokens; median of {steps} steps after {warmup} warm-up steps. Check: the"
        " first loss within 2% of eager's (same weights and batch; dropout masks differ).",
        "",
    ]
    columns = ["executor", "tokens/s", "step ms", "peak GiB", "x eager tokens/s", "x eager peak"]
    lines += table([*columns, "loss", "check"], rows)
    if failures:
        lines += ["", "Failed:", *(f"- {failure}" for failure in failures)]
    emit(lines, args.output)
    if failures:
        raise SystemExit(f"benchmarks.train_step: {len(failures)} executors failed")


if __name__ == "__main__":
    main()
