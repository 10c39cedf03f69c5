"""End-to-end training step of GPT-2-small-scale models in bf16 autocast: tokens/s and peak
memory for eager, Inductor and seqfast, each compiled also with `mode="reduce-overhead"`, with
ratios to eager and to Inductor in the same mode, measured in one run.

    python -m benchmarks.train_step [--quick | --short] [--models demo,gpt2-sdpa,llama]
        [--modes default,reduce-overhead] [--output benchmarks/results/<device>.md]

The models (`benchmarks/step_models.py`): the demo GPT as written (attention written out, the mask
in a buffer), a GPT-2 through `F.scaled_dot_product_attention(is_causal=True)`, and a LLaMA-style
model (RMSNorm, SwiGLU, rotary, grouped-query attention, no dropout). `--short` keeps the models
and batch and times 10 steps after 3 warm-up steps instead of 20 after 5.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from benchmarks.common import brief, emit_with_failures, header, model_setup, progress, table
from benchmarks.step_models import MODELS, build
from seqcompile.demo import toy_batch

MODES = ("default", "reduce-overhead")


def measure(model, step_model, config, *, batch, length, steps, warmup, device, dtype, graphs):
    """Tokens/s, the median step's seconds, peak bytes and the losses of `steps` timed steps
    after `warmup`; `graphs`: the step runs under CUDA graphs (each step is marked as a new one)."""
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
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
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


def executors(no_inductor: bool, modes: list[str]) -> dict[str, tuple[Any, bool]]:
    """Each executor's name, how it wraps a model, and whether it runs under CUDA graphs."""
    wraps: dict[str, tuple[Any, bool]] = {"eager": (lambda m: m, False)}
    for mode in modes:
        chosen = None if mode == "default" else mode
        suffix = "" if chosen is None else f" {mode}"
        graphs = chosen == "reduce-overhead"
        if not no_inductor:
            wraps[f"inductor{suffix}"] = (lambda m, c=chosen: torch.compile(m, mode=c), graphs)
        wraps[f"seqfast{suffix}"] = (
            lambda m, c=chosen: torch.compile(m, backend="seqfast", mode=c),
            graphs,
        )
    return wraps


def _listed(text: str, valid: tuple[str, ...], what: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; the {what} are {', '.join(valid)}")
    return names


def main() -> None:
    args, device, config, batch, length = model_setup(
        __doc__, extra=[("--models", ",".join(MODELS)), ("--modes", ",".join(MODES))]
    )
    models = _listed(args.models, MODELS, "models")
    modes = _listed(args.modes, MODES, "modes")
    dtype = torch.bfloat16
    steps, warmup = (3, 2) if args.quick else (10, 3) if args.short else (20, 5)
    lines = header(
        "Training step, GPT-2-small scale, bf16 autocast", device, "benchmarks.train_step"
    )
    lines += [
        f"{config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, vocab"
        f" {config.vocab}; batch {batch} x {length} tokens; median of {steps} steps after"
        f" {warmup} warm-up steps. Check: the first loss within 2% of eager's (same weights and"
        " batch; dropout masks differ). x inductor: against Inductor in the same mode.",
    ]
    failures, rows = [], []
    for model_name in models:
        torch.manual_seed(0)
        base = build(model_name, config).to(device)
        results = {}
        for name, (wrap, graphs) in executors(args.no_inductor, modes).items():
            model = copy.deepcopy(base)
            try:
                results[name] = measure(
                    model, wrap(model), config, batch=batch, length=length, steps=steps,
                    warmup=warmup, device=device, dtype=dtype, graphs=graphs,
                )  # fmt: skip
            except (RuntimeError, AssertionError) as error:  # recorded, counted, not hidden
                failures.append(f"{model_name} {name}: {brief(error)}")
                print("FAILED:", failures[-1], flush=True)
            else:
                tps, step_s, peak, losses = results[name]
                progress([model_name, name, tps, step_s * 1e3, peak / 2**30])
            del model
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows += _rows(results, failures, model_name)
    columns = ["model", "executor", "tokens/s", "step ms", "peak GiB", "x eager tokens/s"]
    columns += ["x eager peak", "x inductor tokens/s", "x inductor peak", "loss", "check"]
    lines += ["", *table(columns, rows)]
    emit_with_failures(lines, failures, args.output, "benchmarks.train_step")


def _rows(results: dict[str, Any], failures: list[str], model_name: str) -> list[list[Any]]:
    """One model's rows: each executor against eager, and against Inductor in its mode."""
    eager_tps, _, eager_peak, eager_losses = results.get("eager", (0.0, 0.0, 0, None))
    rows = []
    for name, (tps, step_s, peak, losses) in results.items():
        # the same weights and batches: the first loss must agree with eager's (dropout differs)
        check = "the reference" if name == "eager" else "no reference"
        if eager_losses is not None and name != "eager":
            check = "ok"
            if abs(losses[0] - eager_losses[0]) > 2e-2 * abs(eager_losses[0]):
                check = "MISMATCH"
                first = f"first loss {losses[0]:.4f}, eager's {eager_losses[0]:.4f}"
                failures.append(f"{model_name} {name}: {first}")
        inductor = results.get(name.replace("seqfast", "inductor")) if "seqfast" in name else None
        rows.append(
            [
                model_name, name, tps, step_s * 1e3, peak / 2**30,
                tps / eager_tps if eager_tps else "", peak / eager_peak if eager_peak else "",
                tps / inductor[0] if inductor else "",
                peak / inductor[2] if inductor and inductor[2] else "",
                f"{losses[0]:.4f} -> {losses[-1]:.4f}", check,
            ]
        )  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
