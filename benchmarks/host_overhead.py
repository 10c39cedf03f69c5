"""The host's cost of seqfast's fused calls, measured on CPU with every kernel launch stubbed out
and the kernel path otherwise as on CUDA (argument checks, specs, configuration spaces, the tuning
lookup, allocations): one training step of a 2-layer GPT-2-small-shaped model is compiled with its
fused calls called as ops (the route where a call's launches do not trace), each call it makes is
recorded, and each is then replayed alone and timed, as an op call and as the planned launches the
eager executor on CUDA runs (`lower/planned_launches.py`). Printed: microseconds per call by op
beside an empty custom op's, and per step the fused calls, the launches and the host milliseconds
those calls take. Then
the same step compiled as it is by default, its kernels' launches traced into the graphs
(`lower/traced_launches.py`): the fused calls left that run the op's Python per step; and once
more compiled at symbolic sizes (`dynamic=True`), stepping at a second length.

    python -m benchmarks.host_overhead [--quick] [--reps N] [--output FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch._library.custom_ops import OPDEFS
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from benchmarks.common import emit, header, table, timed_ms
from seqcompile import lower
from seqcompile.codegen import counting_launches, tuning
from seqcompile.codegen.launches import CountedKernel, launches_traced
from seqcompile.demo import GPT, GPT2_SMALL, GPTConfig, toy_batch
from seqcompile.lower.planned_launches import plan_launches
from seqcompile.lower.traced_launches import launch_trace
from seqcompile.run import runtime

INTERPRETED = {"SEQFAST_INTERPRET": "1", "TRITON_INTERPRET": "1"}
"""The kernel path runs on CPU only under the interpreter's switch, which Triton reads when it is
imported; no kernel runs here."""


class _NoLaunch:
    """Stands for a `@triton.jit` function: `kernel[grid](...)` returns at once."""

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stubbed_launches(folder: Path) -> Iterator[None]:
    """Every generated kernel's launch returns at once (still counted), and tuning behaves as on
    CUDA, where each launch looks its configuration up: the first lookup at a key takes the
    default, later ones read it from memory."""
    getitem = CountedKernel.__getitem__

    def no_launch(self: CountedKernel, grid: Any) -> Callable[..., Any]:
        if launches_traced():  # a trace of the launch, which runs it later, stubbed then
            return getitem(self, grid)
        real, self.jit = self.jit, _NoLaunch()
        try:
            return getitem(self, grid)
        finally:
            self.jit = real

    patches = {
        (CountedKernel, "__getitem__"): no_launch,
        (tuning, "autotuning"): lambda device: True,
        (tuning, "tuning_file"): lambda device: folder / "tuning.json",
        (tuning, "_fastest"): lambda entry, space, run: space[0],
    }
    saved = {key: getattr(*key) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


@dataclasses.dataclass
class FusedCall:
    op: torch._ops.OpOverload
    implementation: Callable[..., Any]
    """The Python function behind the op, for this call's device."""
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def recording_fused_calls() -> Iterator[list[FusedCall]]:
    """Each `seqfast::` op called in this block, with its arguments, in order. (A dispatch mode
    would see them, but Dynamo runs a frame eagerly under one.)"""
    calls: list[FusedCall] = []
    opdefs = [d for name, d in OPDEFS.items() if name.startswith("seqfast::")]
    saved = {d: dict(d._backend_fns) for d in opdefs}

    def recorded(op, fn, *args, **kwargs):
        calls.append(FusedCall(op, fn, args, kwargs))
        return fn(*args, **kwargs)

    for d in opdefs:
        for device, fn in saved[d].items():
            d._backend_fns[device] = functools.partial(recorded, d._opoverload, fn)
    try:
        yield calls
    finally:
        for d, fns in saved.items():
            d._backend_fns.update(fns)


HOST_ONLY = frozenset(
    "empty empty_strided new_empty view _unsafe_view reshape as_strided t transpose permute expand"
    " unsqueeze squeeze slice select detach alias contiguous".split()
)
"""ATen ops that allocate or view without computing: host work on any device."""


class CountingATenCalls(TorchDispatchMode):
    """Counts the ATen ops called beneath it, and those that compute (around a fused op's
    implementation: the mode does not see beneath the op it handles, nor into Dynamo's frames,
    which run eagerly under it)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.computing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten":
            self.count += 1
            self.computing += func._opname not in HOST_ONLY
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def calls_as_ops() -> Iterator[None]:
    """Compiles in this block call their fused ops (their kernels' launches are not traced)."""
    traced = lower.launches_inlined
    lower.launches_inlined = lambda device, executor: False
    try:
        yield
    finally:
        lower.launches_inlined = traced


def planned(call: FusedCall) -> Callable[[], object] | None:
    """The call's launches traced at fake copies of its arguments and planned as the eager
    executor on CUDA runs them (`lower/planned_launches.py`), bound to its arguments; None where
    they do not trace."""
    fake_mode = FakeTensorMode()
    leaves, spec = tree_flatten((call.args, call.kwargs))
    graph = torch.fx.Graph()
    filled = list(leaves)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            filled[i] = graph.placeholder(f"arg{i}")
            filled[i].meta["val"] = fake_mode.from_tensor(leaf)
    args, kwargs = tree_unflatten(filled, spec)
    node = graph.call_function(call.op, tuple(args), kwargs)
    traced = launch_trace(node, fake_mode)
    if isinstance(traced, str):
        return None
    gm = plan_launches(traced.gm)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    return lambda: gm(*tensors)


def microseconds(fn: Callable[[], object], reps: int) -> float:
    """Median microseconds per call of `fn` on the host, over `reps` timed calls."""
    return 1e3 * timed_ms(fn, torch.device("cpu"), reps=reps)


@torch.library.custom_op("seqfast_benchmark::empty", mutates_args=())
def _empty_op(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(())


@_empty_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(())


def main() -> None:
    if not runtime.interpreting():  # Triton is imported already: start again with the switch on
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *sys.argv[1:]],
                  {**os.environ, **INTERPRETED})  # fmt: skip
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, for a smoke run")
    parser.add_argument("--reps", type=int, default=200, help="timed replays of each call")
    parser.add_argument("--output", help="append the markdown tables to this file")
    args = parser.parse_args()
    config = (  # (positions for twice the length: a length equal to it would be specialized)
        GPTConfig(vocab=128, max_len=32, d_model=32, n_heads=2, n_layers=2)
        if args.quick
        else GPTConfig(**{**dataclasses.asdict(GPT2_SMALL), "n_layers": 2, "max_len": 256})
    )
    batch, length = (2, 16) if args.quick else (1, 128)
    torch.manual_seed(0)
    model = GPT(config)
    data = toy_batch(config, batch, length, torch.device("cpu"), torch.Generator().manual_seed(0))
    step_model = torch.compile(model, backend="seqfast", options={"rest": "eager"})

    def step() -> None:
        step_model(*data).backward()

    with tempfile.TemporaryDirectory() as folder, stubbed_launches(Path(folder)):
        with calls_as_ops():
            step()  # compiles
        with recording_fused_calls() as calls, counting_launches() as launches:
            step()
        torch._dynamo.reset()
        step()  # compiles as by default
        with recording_fused_calls() as still_called, counting_launches() as traced_launches:
            step()
        torch._dynamo.reset()
        dynamic_model = torch.compile(
            model, backend="seqfast", dynamic=True, options={"rest": "eager"}
        )
        dynamic_model(*data).backward()  # compiles at symbolic sizes
        graphs = counters["stats"]["unique_graphs"]
        shorter = toy_batch(config, batch, length - 3, torch.device("cpu"), torch.Generator())
        dynamic_model(*shorter).backward()  # (what a recompile would tune is not recorded)
        recompiled = counters["stats"]["unique_graphs"] - graphs
        with recording_fused_calls() as dynamic_called:
            dynamic_model(*shorter).backward()
        by_op: dict[str, list[tuple[float, int, float | None]]] = {}
        for call in calls:  # as the compiled graphs call them: beneath autograd
            with torch.no_grad():
                us = microseconds(lambda call=call: call.op(*call.args, **call.kwargs), args.reps)
                with CountingATenCalls() as aten_calls:
                    call.implementation(*call.args, **call.kwargs)
                plan = planned(call)
                planned_us = microseconds(plan, args.reps) if plan is not None else None
            by_op.setdefault(str(call.op), []).append((us, aten_calls, planned_us))
    empty_us = microseconds(lambda: _empty_op(data[0]), args.reps)
    rows, host_us, computing = [], 0.0, 0
    total_us = sum(t for measured in by_op.values() for t, _, _ in measured)
    for op, measured in sorted(by_op.items()):
        us = statistics.median(t for t, _, _ in measured)
        made = measured[0][1]
        plans = [p for _, _, p in measured if p is not None]
        planned_us = statistics.median(plans) if len(plans) == len(measured) else "not traced"
        row = [op, len(measured), us, us - empty_us, planned_us, f"{made.count} ({made.computing})"]
        rows.append(row)
        if made.computing:
            computing += len(measured)
        else:
            host_us += sum(t for t, _, _ in measured)
    lines = header("Host cost of fused calls, launches stubbed", torch.device("cpu"), __spec__.name)
    lines += [
        f"- model: {config.n_layers} layers, d {config.d_model}, {config.n_heads} heads, vocab "
        f"{config.vocab}, {batch} x {length} tokens, rest eager; median of {args.reps} replays",
        f"- an empty custom op: {empty_us:.1f} us per call",
        f"- per step: {len(calls)} fused calls, {sum(launches.names().values())} launches;"
        f" {total_us / 1e3:.2f} ms in all fused calls, {host_us / 1e3:.2f} ms in the"
        f" {len(calls) - computing} whose ATen ops only allocate and view",
        f"- the {computing} calls whose ATen ops compute (the count in brackets) ran that compute"
        " on the CPU here, inside their time; on CUDA it would be launches",
        f"- launches traced into the graphs (the default where the executor launches them):"
        f" {len(still_called)} fused calls per step run the op's Python"
        f" ({', '.join(sorted({str(c.op) for c in still_called})) or 'none'}),"
        f" {sum(traced_launches.names().values())} launches",
        f"- compiled at symbolic sizes, a step at another length ({recompiled} graphs compiled"
        f" again): {len(dynamic_called)} fused"
        f" calls run the op's Python"
        f" ({', '.join(sorted({str(c.op) for c in dynamic_called})) or 'none'})",
        "",
        *table(
            [
                "op",
                "calls per step",
                "us per call",
                "us beyond an empty custom op",
                "us per planned call",
                "ATen ops",
            ],  # fmt: skip
            rows,
        ),
    ]
    emit(lines, args.output)


if __name__ == "__main__":
    main()
