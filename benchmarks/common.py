"""Shared benchmark machinery: timing, the measured copy-bandwidth ceiling, device and version
facts, and markdown tables that carry the command that produced them."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from seqcompile.demo import GPT2_SMALL, GPTConfig


def standard_setup(
    doc: str, extra: Callable[[argparse.ArgumentParser], object] | None = None
) -> tuple[argparse.Namespace, torch.device, torch.dtype]:
    """The options every kernel benchmark takes (`--quick`, `--short`, `--no-inductor`,
    `--output`, and what `extra` adds to the parser), the device (CUDA when present) and the dtype
    measured there (bf16 on CUDA, float32 on CPU)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_size_options(parser)
    parser.add_argument("--no-inductor", action="store_true", help="leave Inductor out")
    parser.add_argument("--output", help="append the markdown table to this file")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return args, device, torch.bfloat16 if device.type == "cuda" else torch.float32


def add_size_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run on CPU")
    parser.add_argument(
        "--short",
        action="store_true",
        help="fewer sizes and cases at full scale (each still several times the L2), to fit a"
        " time-boxed GPU session (benchmarks/gpu_session.sh)",
    )


class ModelSetup(NamedTuple):
    args: argparse.Namespace
    device: torch.device
    config: GPTConfig
    batch: int
    length: int


def model_setup(doc: str, extra: Sequence[tuple[str, int | str]] = ()) -> ModelSetup:
    """The options every whole-model benchmark takes (`--quick`, `--short`, `--no-inductor`,
    `--batch`, `--length`, `--output`, and `extra` options with their defaults, each of its
    default's type), the
    device, and the model: GPT-2-small-shaped, or a tiny GPT on 2 x 16 tokens with `--quick`
    (`--short` keeps the model and runs fewer steps or cases)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_size_options(parser)
    parser.add_argument("--no-inductor", action="store_true", help="leave plain Inductor out")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    for name, default in extra:
        parser.add_argument(name, type=type(default), default=default)
    parser.add_argument("--output", help="append the markdown table to this file")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        config = GPTConfig(vocab=128, max_len=32, d_model=32, n_heads=2, n_layers=2)
        return ModelSetup(args, device, config, batch=2, length=16)
    config = dataclasses.replace(GPT2_SMALL, max_len=args.length)
    return ModelSetup(args, device, config, batch=args.batch, length=args.length)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "meta":
        return "none: compiled on the meta device on a CPU host, nothing ran"
    return "cpu"


def timed_ms(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 3, reps: int = 20
) -> float:
    """Median milliseconds per call: `triton.testing.do_bench` on CUDA, a wall-clock loop on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25 * warmup, rep=100, return_mode="median"))
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbs(device: torch.device, megabytes: int) -> float:
    """Achieved GB/s of `dst.copy_(src)` (read + write) on a buffer of `megabytes`."""
    n = megabytes * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


BANDWIDTH_COLUMNS = ("executor", "ms", "GB/s", "of copy bw", "x eager", "x inductor")
"""Columns `bandwidth_rows` fills after a case's own columns."""


def bandwidth_rows(
    case: Sequence[object], times: dict[str, float], moved: int, ceiling_gbs: float
) -> list[list[object]]:
    """One row per executor of a memory-bound case: its time, achieved GB/s, the fraction of the
    measured copy bandwidth, and its speed-up over eager and (when timed) Inductor."""
    rows = []
    for executor, ms in times.items():
        gbs = moved / (ms * 1e-3) / 1e9
        versus_inductor = times["inductor"] / ms if "inductor" in times else ""
        rows.append(
            [*case, executor, ms, gbs, gbs / ceiling_gbs, times["eager"] / ms, versus_inductor]
        )
    return rows


def header(title: str, device: torch.device, module: str) -> list[str]:
    import triton

    return [
        f"## {title}",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- device: {device_name(device)}",
        f"- torch {torch.__version__}, triton {triton.__version__}",
        f"- command: `python -m {module} {' '.join(sys.argv[1:])}`",
        "",
    ]


def brief(error: BaseException, limit: int = 160) -> str:
    """An exception's message on one line, at most `limit` characters (its type when empty)."""
    text = " ".join(str(error).split()).replace("|", "/")
    return (text or type(error).__name__)[:limit]


def cell(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def progress(cells: Sequence[object]) -> None:
    """Print one measured row at once, so that a run stopped at its time limit still leaves the
    rows it finished in the log (the table itself is written at the end)."""
    print("row: | " + " | ".join(cell(v) for v in cells) + " |", flush=True)


def table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return lines


def emit(lines: list[str], output: str | None) -> None:
    """Print the section; with `output`, also append it to that markdown file."""
    text = "\n".join(lines) + "\n"
    print(text)
    if output:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(text + "\n")


def emit_with_failures(
    lines: list[str], failures: Sequence[str], output: str | None, module: str
) -> None:
    """`emit` the section with its failed runs listed last, then exit non-zero where any failed."""
    if failures:
        lines = [*lines, "", "Failed:", *(f"- {failure[:200]}" for failure in failures)]
    emit(lines, output)
    if failures:
        raise SystemExit(f"{module}: {len(failures)} runs failed")


def emit_checked(lines: list[str], rows: Sequence[Sequence[object]], output: str | None,
                 module: str) -> None:  # fmt: skip
    """`emit`, then exit non-zero when a row's last column (its check) says FAILED."""
    emit(lines, output)
    failed = sum(str(row[-1]).startswith("FAILED") for row in rows)
    if failed:
        raise SystemExit(f"{module}: {failed} executor runs failed; see the check column")
