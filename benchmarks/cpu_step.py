"""A float32 training step on CPU (forward, backward, AdamW) of the demo GPT and of a 4-layer, d-256
GPT on 8 x 128 tokens, dropout 0.1: eager, Inductor, and seqfast handing the rest to Inductor and
to eager, and seqfast under a memory budget of 0.5, timed interleaved in one process (each round
times one step of each, in a rotating order): median step time and its ratios to Inductor and to
eager, and the bytes each keeps for the backward (saved-tensor hooks) and their ratio to eager's.

    python -m benchmarks.cpu_step [--quick] [--no-inductor] [--output FILE]

Each executor's loss with dropout off is checked against eager's before it is timed; one that
disagrees or raises is marked FAILED, not timed, and the run exits non-zero.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import platform
import statistics
import time

import torch

from benchmarks.common import brief, emit_checked, header, progress, standard_setup, table
from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.memory.saved import saved_bytes
from seqcompile.report import collecting

MODELS = {
    "demo GPT": (GPTConfig(), 8, 32),
    "4 layers, d 256": (
        GPTConfig(vocab=2048, max_len=128, d_model=256, n_heads=4, n_layers=4), 8, 128,
    ),
}  # fmt: skip
"""Model, batch and length."""
QUICK = {"tiny GPT": (GPTConfig(vocab=128, max_len=32, d_model=32, n_heads=2, n_layers=2), 2, 16)}
EXECUTORS = {
    "eager": lambda m: m,
    "inductor": torch.compile,
    "seqfast": lambda m: torch.compile(m, backend="seqfast", options={"rest": "inductor"}),
    "seqfast, rest eager": lambda m: torch.compile(m, backend="seqfast", options={"rest": "eager"}),
    "seqfast, budget 0.5": lambda m: torch.compile(
        m, backend="seqfast", options={"rest": "inductor", "memory_budget": 0.5}
    ),
}


@dataclasses.dataclass
class Runner:
    """One executor's copy of the model, its optimizer and its step times."""

    model: torch.nn.Module
    step_model: object
    optimizer: torch.optim.Optimizer
    seconds: list[float] = dataclasses.field(default_factory=list)
    kept_bytes: int = 0

    def step(self, idx: torch.Tensor, targets: torch.Tensor) -> float:
        start = time.perf_counter()
        loss = self.step_model(idx, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def measure_kept(self, idx: torch.Tensor, targets: torch.Tensor) -> None:
        """What one step keeps for the backward, seen through saved-tensor hooks."""
        lasting = [*self.model.parameters(), *self.model.buffers(), idx, targets]
        self.kept_bytes = saved_bytes(lambda: self.step_model(idx, targets), lasting)
        self.optimizer.zero_grad(set_to_none=True)


def eval_loss(step_model, model, idx, targets) -> float:
    """The loss with dropout off (the executors' dropout masks differ by design)."""
    model.eval()
    try:
        with torch.no_grad():
            return float(step_model(idx, targets))
    finally:
        model.train()


def bench(name, config, batch, length, executors, *, warmup, rounds):
    torch.manual_seed(0)
    base = GPT(config)
    data = toy_batch(config, batch, length, torch.device("cpu"), torch.Generator().manual_seed(0))
    runners, notes = {}, {}
    reference = None
    torch._dynamo.reset()  # each model's compiles start from none: four compiled executors, each
    # in training and in eval mode, reach Dynamo's recompile limit (8), past which it runs eagerly
    for executor, wrap in executors.items():
        model = copy.deepcopy(base)
        try:
            step_model = wrap(model)
            with collecting() as report:
                loss = eval_loss(step_model, model, *data)
                runner = Runner(model, step_model, torch.optim.AdamW(model.parameters(), lr=1e-4))
                for _ in range(warmup):
                    runner.step(*data)
            if executor.startswith("seqfast") and not report.memory:
                raise AssertionError("seqfast planned no training graph: the step ran eagerly")
            if reference is None:
                reference, notes[executor] = loss, "the reference"
            elif abs(loss - reference) > 1e-4 * abs(reference):
                raise AssertionError(f"loss {loss} with dropout off, eager {reference}")
            else:
                notes[executor] = "checked"
            runner.measure_kept(*data)
            runners[executor] = runner
        except (RuntimeError, AssertionError) as error:
            notes[executor] = f"FAILED: {brief(error, 100)}"
    order = list(runners)
    for r in range(rounds):
        for executor in order[r % len(order) :] + order[: r % len(order)]:
            runners[executor].seconds.append(runners[executor].step(*data))
    ms = {e: 1e3 * statistics.median(runner.seconds) for e, runner in runners.items()}
    rows = []
    for executor in executors:
        took = ms.get(executor, "-")
        bases = ("inductor", "eager")
        ratios = [took / ms[b] if executor in ms and b in ms else "" for b in bases]
        kept = [runners[e].kept_bytes if e in runners else None for e in (executor, "eager")]
        kept_mib = kept[0] / 2**20 if kept[0] is not None else "-"
        kept_ratio = kept[0] / kept[1] if None not in kept and kept[1] else ""
        rows.append(
            [name, f"{batch} x {length}", executor, took, *ratios, kept_mib, kept_ratio]
            + [notes[executor]]
        )
        progress(rows[-1])
    return rows


def main() -> None:
    args, _, _ = standard_setup(__doc__)  # its device and dtype aside: this runs float32 on CPU
    executors = dict(EXECUTORS)
    if args.no_inductor:  # nothing compiles with Inductor: seqfast hands the rest to eager
        executors = {"eager": EXECUTORS["eager"], "seqfast": EXECUTORS["seqfast, rest eager"]}
    models = QUICK if args.quick else MODELS
    warmup, rounds = (1, 2) if args.quick else (3, 7)
    lines = header("Training step on CPU", torch.device("cpu"), "benchmarks.cpu_step")
    lines += [
        f"float32; {torch.get_num_threads()} threads on {os.cpu_count()} cores"
        f" ({platform.processor() or platform.machine()}); median of {rounds} interleaved steps"
        f" after {warmup} warm-up steps each; dropout 0.1. Kept: the distinct storages one step"
        " saves for the backward (saved-tensor hooks), parameters and batch aside."
        + (" Without Inductor: seqfast hands the rest to eager." if args.no_inductor else ""),
        "",
    ]
    rows = []
    with torch._dynamo.config.patch(recompile_limit=64):
        for name, (config, batch, length) in models.items():
            rows += bench(name, config, batch, length, executors, warmup=warmup, rounds=rounds)
    columns = ["model", "tokens", "executor", "step ms", "/ inductor", "/ eager", "kept MiB"]
    columns += ["kept / eager", "check"]
    lines += table(columns, rows)
    emit_checked(lines, rows, args.output, "benchmarks.cpu_step")


if __name__ == "__main__":
    main()
