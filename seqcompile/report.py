"""CompileReport: what a compile fused (per family, with the operators the registry says each
family makes), what it recognized but refused and why, the kernels it generated, and what the
backward keeps in memory (each launched operator's saves, from its registry entry). `str(report)`
is a readable table."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING

from seqcompile.codegen import KernelSource, KernelSpec
from seqcompile.ops import registry
from seqcompile.ops.fused_op import FusedOp

if TYPE_CHECKING:
    from seqcompile.memory.budget import RecomputePlan
    from seqcompile.memory.cost import NodeCost
    from seqcompile.memory.liveness import StepMemory
    from seqcompile.verify import Finding


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

    source: KernelSource
    spec: KernelSpec
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
    def path(self):
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
    step: StepMemory
    """Kept bytes by kind, the peak, and the live bytes over the forward-then-backward schedule."""
    written_over_bytes: int = 0
    """Bytes the backward writes its results over (saved tensors it reads last) instead of
    allocating them."""
    budget: RecomputePlan | None = None
    """What the memory budget made the planner recompute (None without a budget)."""
    recompute: NodeCost | None = None
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
    verified: list[Finding] = dataclasses.field(default_factory=list)
    """What the `verify` option found, per graph (empty without it)."""
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

    def __str__(self) -> str:
        lines = [f"seqfast compile report: {len(self.graphs)} graph(s)", "", "fused sites:"]
        if self.counts:
            width = max(len(name) for name in self.counts)
            lines += [
                f"  {name:<{width}}  {n}{_operators(name)}"
                for name, n in sorted(self.counts.items())
            ]
        else:
            lines.append("  (none)")
        lines += ["", "recognized but not fused:"]
        lines += [f"  {m.pattern}: {m.site}: {m.reason}" for m in self.missed] or ["  (none)"]
        if self.rewritten:
            lines += ["", "math written out, read as the op it computes (checked by evaluation):"]
            lines += [f"  {m.pattern}: {m.site}: {m.reason}" for m in self.rewritten]
        if self.refuted:
            lines += ["", "readings refuted by evaluating the model's code (left as written):"]
            lines += [f"  {m.pattern}: {m.site}: {m.reason}" for m in self.refuted]
        lines += ["", "generated kernels (those the compiled graphs launch):"]
        lines += _kernel_lines(self.kernels) or ["  (none)"]
        if self.sites:
            lines += ["", "fused sites at the traced sizes:"] + [f"  {v}" for v in self.sites]
        if self.implementations:
            lines += ["", "what each fused call runs:"] + _implementation_lines(
                self.implementations
            )
        if self.variants:
            lines += ["", "backward variants:"] + [f"  {v}" for v in self.variants]
        if self.copies:
            lines += ["", "copies made of tensors a kernel does not take at their strides:"]
            lines += [f"  {label}: {n}x" for label, n in self.copies.items()]
        lines += ["", "memory of the step (at traced sizes):"]
        lines += [line for m in self.memory for line in _memory_lines(m)] or [
            "  (no training graph)"
        ]
        saving = _launched(self.kernels, self.implementations) if self.memory else []
        if saving:
            lines += ["", "what each fused operator keeps for its backward:"]
            lines += [f"  {entry.name}: {entry.saves}" for entry in saving]
        if self.verified:
            lines += ["", "verify (compiled graph against eager):"]
            lines += [str(finding) for finding in self.verified]
        return "\n".join(lines) + "\n"


def _operators(family: str) -> str:
    """The fused operators a built-in family makes, as the registry says (nothing for a user
    pattern's name)."""
    names = [entry.name for entry in registry.entries_of(family)]
    return f"  ({', '.join(names)})" if names else ""


def _launched(kernels: list[KernelUse], calls: list[ImplementationUse]) -> list[FusedOp]:
    """The registry's entries the compiled graphs run (their kernels or their lowerings), in the
    registry's order."""
    ops = {use.op for use in kernels} | {use.op for use in calls}
    return [entry for entry in registry.ENTRIES if entry.name in ops]


def _implementation_lines(uses: list[ImplementationUse]) -> list[str]:
    """One line per graph, direction, operator, implementation and reason, with its calls'
    count and first site."""
    groups: dict[tuple[str, ...], list[ImplementationUse]] = {}
    for use in uses:
        key = (use.graph, use.direction, use.op, use.implementation, use.reason)
        groups.setdefault(key, []).append(use)
    lines = []
    for (graph, direction, op, implementation, reason), group in groups.items():
        where = group[0].site if len(group) == 1 else f"{len(group)} calls, first {group[0].site}"
        lines.append(f"  {graph} {direction} {op}: {implementation} ({reason}): {where}")
    return lines


def _kernel_lines(uses: list[KernelUse]) -> list[str]:
    """Each kernel with its file, then the fused-op calls that launch it."""
    by_kernel: dict[KernelSource, list[KernelUse]] = {}
    for use in uses:
        by_kernel.setdefault(use.source, []).append(use)
    lines = []
    for source, launches in by_kernel.items():
        lines.append(f"  {source.name}  ({source.path})")
        lines += [f"    {use}" for use in launches]
    return lines


def _memory_lines(m: MemoryPlan) -> list[str]:
    step = m.step
    lines = [
        f"  {m.graph}: kept for the backward {step.kept_tensors} tensors,"
        f" {format_bytes(step.kept_bytes)} (fused-op saves {format_bytes(step.kept_fused_bytes)},"
        f" other saves {format_bytes(step.kept_bytes - step.kept_fused_bytes)});"
        f" the backward's recompute makes {format_bytes(step.recomputed_bytes)};"
        f" partitioner {m.partitioner}"
    ]
    if m.written_over_bytes:
        reused = format_bytes(m.written_over_bytes)
        lines.append(f"    {reused} of it reused by the backward for its results")
    if m.recompute is not None and m.recompute.flops + m.recompute.moved_bytes:
        lines.append(
            f"    recomputed in the backward: {m.recompute.flops / 1e9:.3g} GFLOP,"
            f" {format_bytes(m.recompute.moved_bytes)} moved"
        )
    if m.budget is not None:
        lines.append(f"    {_budget_line(m.budget)}")
    lines.append(
        f"    peak {format_bytes(step.peak_bytes)} at {step.peak_node} (activations and gradients);"
        f" parameters {format_bytes(step.parameter_bytes)}, parameters' gradients"
        f" {format_bytes(step.gradient_bytes)}, other inputs {format_bytes(step.input_bytes)}"
    )
    return lines


def _budget_line(plan: RecomputePlan) -> str:
    if plan.cheap_only:
        return (
            f"no memory budget: recomputing {len(plan.recomputed)} cheap nodes (no matmul or"
            f" attention) keeps {format_bytes(plan.planned_bytes)} of"
            f" {format_bytes(plan.baseline_bytes)}, ~{plan.seconds * 1e6:.0f} us on the device"
            " roofline"
        )
    verdict = "met" if plan.reachable else "NOT reachable, the least the planner found"
    return (
        f"memory budget {plan.budget}: target {format_bytes(plan.target_bytes)} of"
        f" {format_bytes(plan.baseline_bytes)} saved without it; plan keeps"
        f" {format_bytes(plan.planned_bytes)} ({verdict})"
        f" by recomputing {len(plan.recomputed)} nodes,"
        f" {plan.cost.flops / 1e9:.3g} GFLOP, ~{plan.seconds * 1e6:.0f} us on the device roofline"
    )


def format_bytes(n: int) -> str:
    """`n` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


_collectors = threading.local()


@contextlib.contextmanager
def collecting() -> Iterator[CompileReport]:
    """Within the block, every finished graph report is also merged into the yielded report, and
    the copies run time makes are counted in its `copies`."""
    from seqcompile.codegen.copies import counting_copies

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
