"""The report as data: what a compile fused, recognized and refused, rewrote, generated, runs
and keeps in memory, as plain dataclasses any stage may write (it imports nothing of the stages).
The protocols name what it holds of the values other stages write (kernel files, costs, memory
plans) without importing them. Its text is `text.render`'s."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Hashable, Iterator
from pathlib import Path
from typing import Any, Protocol

from seqcompile.run.copies import counting_copies


class KernelFile(Protocol):
    """A generated kernel's file (`codegen.KernelSource`)."""

    name: str
    template: str
    key: tuple
    path: Path


class WorkSummary(Protocol):
    """FLOPs and bytes moved (`memory.cost.NodeCost`)."""

    flops: float
    moved_bytes: int


class StepSummary(Protocol):
    """What a step keeps and its peak (`memory.liveness.StepMemory`)."""

    kept_tensors: int
    kept_bytes: int
    kept_fused_bytes: int
    recomputed_bytes: int
    peak_bytes: int
    peak_node: str
    parameter_bytes: int
    gradient_bytes: int
    input_bytes: int


class RecomputeSummary(Protocol):
    """What a memory budget made the planner recompute (`memory.budget.RecomputePlan`)."""

    budget: Any
    cheap_only: bool
    reachable: bool
    recomputed: Any
    target_bytes: int
    baseline_bytes: int
    planned_bytes: int
    seconds: float
    cost: WorkSummary


@dataclasses.dataclass(frozen=True)
class Missed:
    """A site a pattern recognized but did not fuse."""

    site: str
    pattern: str
    reason: str


@dataclasses.dataclass(frozen=True)
class KernelUse:
    """A generated kernel that a compiled graph launches, and where: the fused op's node in the
    forward, backward or inference graph and the source line it was made for."""

    source: KernelFile
    spec: Hashable
    """The kernel's `KernelSpec`."""
    graph: str
    direction: str
    """"forward", "backward" or "inference"."""
    op: str
    """The fused operator's registry name (`add_norm`, or a user pattern's name)."""
    node: str
    """The fused op's node in the lowered graph."""
    site: str
    """The node, with the module path and source line of the code the fused op replaced."""

    def __str__(self) -> str:
        return f"{self.graph} {self.direction} {self.op}: {self.site}"

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def template(self) -> str:
        return self.source.template

    @property
    def key(self) -> tuple:
        return self.source.key

    @property
    def path(self) -> Path:
        return self.source.path


@dataclasses.dataclass(frozen=True)
class ImplementationUse:
    """What a fused call in a lowered graph runs (`lower/choice.py`) and why."""

    graph: str
    direction: str
    op: str
    """The fused operator's registry name (or a user pattern's name)."""
    node: str
    site: str
    implementation: str
    """"kernel" (the op as called), "lowering" (its ATen compiled by the executor) or "vendor" (a
    vendor's kernels called from ATen the executor compiles)."""
    reason: str


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What one training graph's step holds in memory, at the traced sizes."""

    graph: str
    partitioner: str
    step: StepSummary
    """Kept bytes by kind, the peak, and the live bytes over the forward-then-backward schedule."""
    written_over_bytes: int = 0
    """Bytes the backward writes its results over (saved tensors it reads last) instead of
    allocating them."""
    budget: RecomputeSummary | None = None
    """What the memory budget made the planner recompute (None without a budget)."""
    recompute: WorkSummary | None = None
    """FLOPs and bytes of the forward work the backward redoes, whoever chose it."""
    step_seconds: float = 0.0
    """The forward's and backward's nodes priced one by one on the device roofline: an estimate
    for comparing plans, not a measurement."""


@dataclasses.dataclass
class CompileReport:
    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    missed: list[Missed] = dataclasses.field(default_factory=list)
    refuted: list[Missed] = dataclasses.field(default_factory=list)
    """Readings that evaluating the model's code refuted: of a mask or bias (the site reads that
    tensor as it is instead), of math written out as the op it seemed to compute (it stays as
    written)."""
    rewritten: list[Missed] = dataclasses.field(default_factory=list)
    """Math written out that normalize read as the op it computes, each reading confirmed by
    evaluating its code (`normalize/written_out.py`), as (site, op, what it was read as)."""
    kernels: list[KernelUse] = dataclasses.field(default_factory=list)
    memory: list[MemoryPlan] = dataclasses.field(default_factory=list)
    graphs: list[str] = dataclasses.field(default_factory=list)
    verified: list[object] = dataclasses.field(default_factory=list)
    """What the `verify` option found (its `Finding`s), per graph (empty without it)."""
    variants: list[str] = dataclasses.field(default_factory=list)
    """Fused ops whose backward stage 5 changed to another variant (an in-place twin, a
    region backward adding its gradient terms), as "graph: node: variant"."""
    sites: list[str] = dataclasses.field(default_factory=list)
    """What fused sites compute at the traced sizes beyond their kernels (attention's masks and
    the blocks it skips), as "graph op: site: description"."""
    implementations: list[ImplementationUse] = dataclasses.field(default_factory=list)
    """What each fused call of the lowered graphs runs, and why (measured times, the default
    table, the option, the device's rule)."""
    copies: dict[str, int] = dataclasses.field(default_factory=dict)
    """Copies made of tensors a kernel does not take at their strides (an argument a launcher
    reads contiguous, a `.grad` the accumulating backward was compiled at other strides for), as
    "op: argument shape strides" with how many times, while the report was collecting: in
    `explain`'s run, or in the steps run within `collecting()` (a compile alone copies nothing)."""
    operators: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """The fused operators each family counted makes (the registry's; none for a user
    pattern's), written by the stage that counts the sites."""
    saves: dict[str, str] = dataclasses.field(default_factory=dict)
    """What each fused operator keeps for its backward (its registry entry's `saves`), written
    where its calls are listed."""
    withdrawn: tuple[str, ...] = ()
    """Graphs whose kernels, memory plans, site descriptions and backward variants this report
    takes back where it is merged: `verify` replaced their compile (by one without some sites, or
    by eager)."""

    def add_kernel(self, kernel: KernelUse) -> None:
        if kernel not in self.kernels:
            self.kernels.append(kernel)

    def add_implementation(self, use: ImplementationUse) -> None:
        """Record what a fused call runs; a call that runs its lowering launches none of the
        kernels stage 5 listed for it."""
        self.implementations.append(use)
        if use.implementation != "kernel":
            self.kernels = [
                k
                for k in self.kernels
                if (k.graph, k.direction, k.node) != (use.graph, use.direction, use.node)
            ]

    def merge(self, other: CompileReport) -> None:
        gone = set(other.withdrawn)
        self.implementations = [i for i in self.implementations if i.graph not in gone]
        self.kernels = [k for k in self.kernels if k.graph not in gone]
        self.memory = [m for m in self.memory if m.graph not in gone]
        self.variants = [v for v in self.variants if v.split(":", 1)[0] not in gone]
        self.sites = [v for v in self.sites if v.split(" ", 1)[0] not in gone]
        self.counts.update(other.counts)
        self.operators.update(other.operators)
        self.saves.update(other.saves)
        self.missed.extend(other.missed)
        self.refuted.extend(other.refuted)
        self.rewritten.extend(other.rewritten)
        for kernel in other.kernels:
            self.add_kernel(kernel)
        self.memory.extend(other.memory)
        self.graphs.extend(other.graphs)
        self.verified.extend(other.verified)
        self.variants.extend(other.variants)
        self.sites.extend(other.sites)
        self.implementations.extend(other.implementations)


_collectors = threading.local()


@contextlib.contextmanager
def collecting() -> Iterator[CompileReport]:
    """Within the block, every finished graph report is also merged into the yielded report, and
    the copies run time makes are counted in its `copies`."""
    report = CompileReport()
    stack = _collectors.__dict__.setdefault("stack", [])
    stack.append(report)
    try:
        with counting_copies() as copies:
            report.copies = copies
            yield report
    finally:
        stack[:] = [r for r in stack if r is not report]  # by identity: equal reports differ
        report.copies = dict(report.copies)


def publish(report: CompileReport) -> None:
    for collector in getattr(_collectors, "stack", []):
        collector.merge(report)
