"""The report's text: `render` writes a `CompileReport` as the readable table `str(report)` gives
(the package's face makes it the report's `__str__`). It stands above the report's data and
imports nothing of the stages."""

from __future__ import annotations

from typing import Any

from seqcompile.report.data import CompileReport, KernelFile, RecomputeSummary


def render(report: CompileReport) -> str:
    """The `CompileReport` as text: fused sites per family, what was recognized but not fused,
    rewritten or refuted, the kernels, what each call runs, backward variants, copies, the memory
    of the step and what each operator keeps, and what `verify` found."""
    lines = [f"seqfast compile report: {len(report.graphs)} graph(s)", "", "fused sites:"]
    if report.counts:
        width = max(len(name) for name in report.counts)
        lines += [
            f"  {name:<{width}}  {n}{_operators(report.operators.get(name, ()))}"
            for name, n in sorted(report.counts.items())
        ]
    else:
        lines.append("  (none)")
    lines += ["", "recognized but not fused:"]
    lines += [f"  {m.pattern}: {m.site}: {m.reason}" for m in report.missed] or ["  (none)"]
    if report.rewritten:
        lines += ["", "math written out, read as the op it computes (checked by evaluation):"]
        lines += [f"  {m.pattern}: {m.site}: {m.reason}" for m in report.rewritten]
    if report.refuted:
        lines += ["", "readings refuted by evaluating the model's code (left as written):"]
        lines += [f"  {m.pattern}: {m.site}: {m.reason}" for m in report.refuted]
    lines += ["", "generated kernels (those the compiled graphs launch):"]
    lines += _kernel_lines(report.kernels) or ["  (none)"]
    if report.sites:
        lines += ["", "fused sites at the traced sizes:"] + [f"  {v}" for v in report.sites]
    if report.implementations:
        lines += ["", "what each fused call runs:"] + _implementation_lines(report.implementations)
    if report.variants:
        lines += ["", "backward variants:"] + [f"  {v}" for v in report.variants]
    if report.copies:
        lines += ["", "copies made of tensors a kernel does not take at their strides:"]
        lines += [f"  {label}: {n}x" for label, n in report.copies.items()]
    lines += ["", "memory of the step (at traced sizes):"]
    lines += [line for m in report.memory for line in _memory_lines(m)] or ["  (no training graph)"]
    saving = _launched(report) if report.memory else []
    if saving:
        lines += ["", "what each fused operator keeps for its backward:"]
        lines += [f"  {op}: {report.saves[op]}" for op in saving]
    if report.verified:
        lines += ["", "verify (compiled graph against eager):"]
        lines += [str(finding) for finding in report.verified]
    return "\n".join(lines) + "\n"


def _operators(names: tuple[str, ...]) -> str:
    """The fused operators a family makes (nothing for a user pattern's name)."""
    return f"  ({', '.join(names)})" if names else ""


def _launched(report: Any) -> list[str]:
    """The fused operators the compiled graphs run (their kernels or their lowerings) whose
    saves the report holds, in the order they first appear."""
    ops = dict.fromkeys([u.op for u in report.kernels] + [u.op for u in report.implementations])
    return [op for op in ops if op in report.saves]


def _implementation_lines(uses: list[Any]) -> list[str]:
    """One line per graph, direction, operator, implementation and reason, with its calls'
    count and first site."""
    groups: dict[tuple[str, ...], list[Any]] = {}
    for use in uses:
        key = (use.graph, use.direction, use.op, use.implementation, use.reason)
        groups.setdefault(key, []).append(use)
    lines = []
    for (graph, direction, op, implementation, reason), group in groups.items():
        where = group[0].site if len(group) == 1 else f"{len(group)} calls, first {group[0].site}"
        lines.append(f"  {graph} {direction} {op}: {implementation} ({reason}): {where}")
    return lines


def _kernel_lines(uses: list[Any]) -> list[str]:
    """Each kernel with its file, then the fused-op calls that launch it."""
    by_kernel: dict[KernelFile, list[Any]] = {}
    for use in uses:
        by_kernel.setdefault(use.source, []).append(use)
    lines = []
    for source, launches in by_kernel.items():
        lines.append(f"  {source.name}  ({source.path})")
        lines += [f"    {use}" for use in launches]
    return lines


def _memory_lines(m: Any) -> list[str]:
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


def _budget_line(plan: RecomputeSummary) -> str:
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
