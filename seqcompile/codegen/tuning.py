"""Launch configurations chosen per call. A kernel declares a small space of tile sizes, warps and
stages per (dtype, size), its shipped default first. On CUDA the first launch at a key times every
candidate and keeps the fastest, in memory and on disk (`<kernel cache>/tuning/`, one JSON file per
device name and Triton version). Elsewhere (the interpreter), with `SEQFAST_AUTOTUNE=0`, and for a
launch that cannot be repeated (one that adds into its outputs), the default runs. A file's entry
is used only where it names a candidate of the space declared now: an edited or stale file never
launches a configuration the code does not declare. A traced launch (`tracing_launches`) times
nothing: it takes the configuration this process or the file chose at its key, else the
default."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import triton
from triton.errors import TritonError

from seqcompile.codegen.cache import CACHE_ENV, add_entry, cache_dir, read_entries, text_digest
from seqcompile.codegen.launches import launches_traced
from seqcompile.codegen.spec import KernelSpec
from seqcompile.fx.nodes import concrete

log = logging.getLogger("seqcompile")

AUTOTUNE_ENV = "SEQFAST_AUTOTUNE"


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch configuration: the kernel's block-size constants, warps and pipeline stages
    (None: Triton's default)."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int | None = None
    num_stages: int | None = None

    @classmethod
    def of(cls, num_warps: int | None = None, num_stages: int | None = None, **blocks: int):
        return cls(tuple(sorted(blocks.items())), num_warps, num_stages)

    def __getitem__(self, name: str) -> int:
        return dict(self.blocks)[name]

    def launch_options(self) -> dict[str, int]:
        """The keyword arguments of a Triton launch."""
        options = dict(self.blocks)
        if self.num_warps is not None:
            options["num_warps"] = self.num_warps
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        return options

    def describe(self) -> str:
        tiles = " ".join(f"{k}={v}" for k, v in self.blocks)
        return f"{tiles} warps={self.num_warps} stages={self.num_stages}"


def autotuning(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get(AUTOTUNE_ENV, "1").strip() != "0"


def launch(
    spec: KernelSpec,
    key: Sequence[Any],
    space: Sequence[Config],
    run: Callable[[Config], None],
    device: torch.device,
    *,
    repeatable: bool = True,
) -> Config:
    """Run `run` once with the configuration chosen for the kernel of `spec` at `key` (its
    dtypes and sizes; tuned on the first launch where tuning applies), and return it. `run` must
    launch the kernel with the configuration's options and nothing else that changes with it. A
    trace at symbolic sizes takes the configuration chosen at the sizes it was traced at."""
    chosen = space[0]
    if len(space) > 1 and repeatable and autotuning(device):
        key = tuple(_hint(k) for k in key)
        remembered = (spec, tuple(key), device, os.environ.get(CACHE_ENV, ""))
        chosen = _MEMORY.get(remembered)
        if chosen is None and launches_traced():
            chosen = _recorded(spec, key, space, device) or space[0]
        elif chosen is None:  # the tuning file's choice, or the fastest, timed now and added
            chosen = _recorded(spec, key, space, device)
            if chosen is None:
                chosen = _fastest(_entry(spec, key), space, run)
                add_entry(tuning_file(device), _entry(spec, key), _as_json(chosen))
            _MEMORY[remembered] = chosen
    run(chosen)
    return chosen


def _hint(value: Any) -> Any:
    """A symbolic size at the value it had when traced (read without a guard)."""
    return concrete(value) if isinstance(value, torch.SymInt) else value


_MEMORY: dict[tuple[KernelSpec, tuple[Any, ...], torch.device, str], Config] = {}
"""The configuration chosen at each (kernel, key, device, cache folder setting) in this process:
every launch after the first looks it up here before anything is hashed, named or read."""


def _recorded(
    spec: KernelSpec, key, space: Sequence[Config], device: torch.device
) -> Config | None:
    """The candidate of `space` the tuning file holds for the kernel of `spec` at `key`."""
    found = read_entries(tuning_file(device), "tuning").get(_entry(spec, key))
    return next((c for c in space if _as_json(c) == found), None)


def _entry(spec: KernelSpec, key) -> str:
    return "|".join([spec.name, text_digest(repr(spec.key)), *map(str, key)])


def _fastest(entry: str, space: Sequence[Config], run) -> Config:
    """The candidate with the least median time; one that fails to compile or launch (out of
    shared memory or registers) is left out, the default never."""
    import triton.testing

    times = {}
    for config in space:
        try:
            times[config] = triton.testing.do_bench(
                lambda config=config: run(config), warmup=5, rep=25, return_mode="median"
            )
        except (TritonError, RuntimeError) as error:  # a candidate the device cannot run
            if config is space[0]:
                raise
            log.info("seqfast: %s: %s does not run: %s", entry, config.describe(), error)
    chosen = min(times, key=times.__getitem__)
    log.info("seqfast: tuned %s: %s (%.3f ms)", entry, chosen.describe(), times[chosen])
    return chosen


def tuning_file(device: torch.device) -> Path:
    """The file holding the tuned configurations for `device`'s model and this Triton."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", torch.cuda.get_device_name(device))
    return cache_dir() / "tuning" / f"{name}-triton-{triton.__version__}.json"


def _as_json(config: Config) -> dict[str, Any]:
    return {"blocks": dict(config.blocks), "warps": config.num_warps, "stages": config.num_stages}
