"""End-to-end training step of a GPT-2-small-shaped model in bf16 autocast: tokens/s and peak
memory for eager, Inductor and seqfast, with ratios to eager, measured in one run.

    python -m benchmarks.train_step [--quick] [--output benchmarks/results/<device>.md]
"""

from __future__ import annotations

import copy
import time

import torch

from benchmarks.common import emit, header, model_setup, table
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
    steps, warmup = (3, 2) if args.quick else (20, 5)
    torch.manual_seed(0)
    base = GPT(config).to(device)
    executors = {"eager": lambda m: m, "seqfast": lambda m: torch.compile(m, backend="seqfast")}
    if not args.no_inductor:
        executors["inductor"] = lambda m: torch.compile(m)
    results = {}
    for name, wrap in executors.items():
        model = copy.deepcopy(base)
        results[name] = measure(
            model, wrap(model), config, batch=batch, length=length, steps=steps,
            warmup=warmup, device=device, dtype=dtype,
        )  # fmt: skip
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    eager_tps, _, eager_peak, _ = results["eager"]
    rows = [
        [
            name, tps, step_s * 1e3, peak / 2**30, tps / eager_tps,
            peak / eager_peak if eager_peak else "", f"{losses[0]:.4f} -> {losses[-1]:.4f}",
        ]
        for name, (tps, step_s, peak, losses) in results.items()
    ]  # fmt: skip
    lines = header(
        "Training step, GPT-2-small shape, bf16 autocast", device, "benchmarks.train_step"
    )
    lines += [
        f"{config.n_layers} layers, d_model {config.d_model}, vocab {config.vocab}; batch {batch} x"
        f" {length} tokens; median of {steps} steps after {warmup} warm-up steps.",
        "",
    ]
    lines += table(
        ["executor", "tokens/s", "step ms", "peak GiB", "x eager tokens/s", "x eager peak", "loss"],
        rows,
    )
    emit(lines, args.output)


if __name__ == "__main__":
    main()
