"""Compile time: the first training step (forward, backward, optimizer; compilation included) of the
demo GPT with Inductor and with seqfast, each in a fresh process with empty caches (cold) and again
in a second fresh process that finds the first one's caches (warm: Inductor's FX-graph and
AOTAutograd caches, seqfast's kernel, tuning and implementation caches). Printed: seconds per
first step, seqfast's over Inductor's, and warm over cold.

    python -m benchmarks.compile_time [--quick] [--device cpu|cuda] [--output FILE]

Each step runs in its own process (`python -m benchmarks.compile_time --child ...`), so nothing a
compile leaves in memory helps the next; the caches are folders of one temporary directory per
executor.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common import emit, header, table

EXECUTORS = ("inductor", "seqfast")


def child(executor: str, device: str, quick: bool) -> float:
    """Seconds of the first training step of the demo GPT compiled by `executor`."""
    from seqcompile.demo import GPT, GPTConfig, toy_batch

    config = GPTConfig(n_layers=2, d_model=32, max_len=32) if quick else GPTConfig()
    batch, length = (2, 16) if quick else (8, 64)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    data = toy_batch(config, batch, length, torch.device(device), torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = (
        torch.compile(model) if executor == "inductor" else torch.compile(model, backend="seqfast")
    )
    start = time.perf_counter()
    compiled(*data).backward()
    optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _first_step(executor: str, device: str, quick: bool, caches: str) -> float:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
        "SEQFAST_CACHE_DIR": os.path.join(caches, "seqfast"),
        "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
    }
    command = [sys.executable, "-m", __spec__.name, "--child", executor, "--device", device]
    result = subprocess.run(
        command + (["--quick"] if quick else []), env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{executor}: the first step failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, for a smoke run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", help="append the markdown table to this file")
    parser.add_argument("--child", choices=EXECUTORS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps({"seconds": child(args.child, args.device, args.quick)}))
        return
    seconds = {}
    for executor in EXECUTORS:
        with tempfile.TemporaryDirectory() as caches:
            cold = _first_step(executor, args.device, args.quick, caches)
            warm = _first_step(executor, args.device, args.quick, caches)
        seconds[executor] = (cold, warm)
    inductor_cold, inductor_warm = seconds["inductor"]
    rows = [
        [name, f"{cold:.1f}", f"{warm:.1f}", f"{warm / cold:.2f}",
         f"{cold / inductor_cold:.2f}", f"{warm / inductor_warm:.2f}"]
        for name, (cold, warm) in seconds.items()
    ]  # fmt: skip
    device = torch.device(args.device)
    lines = header("Compile time: the first training step", device, __spec__.name)
    lines += [
        "- the demo GPT" + (" (tiny)" if args.quick else "") + ", forward, backward and AdamW;"
        " each step in a fresh process, cold with empty caches, warm with the cold run's",
        "",
        *table(
            [
                "executor",
                "cold (s)",
                "warm (s)",
                "warm / cold",
                "cold / Inductor's",
                "warm / Inductor's",
            ],
            rows,
        ),  # fmt: skip
    ]
    emit(lines, args.output)


if __name__ == "__main__":
    main()
