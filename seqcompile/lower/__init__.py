"""Stage 6's fused calls: what each runs (`choice.py`, measured by `measure.py`), chosen for all
of a plan's graphs once stage 5 has made them (so the report says it at compile time, though the
backward is lowered only at the first backward), and inlined into its graph (`inline.py`): a call
that runs its lowering (or a vendor's kernels) as plain ATen for the executor to compile with its
neighbours, a call that runs its kernels as their launches, for the executor to make from its own
code (on CUDA under Inductor, and under Triton's interpreter with the eager executor, which runs
what CUDA runs), or, under the eager executor on CUDA, from a plan of them made once
(`planned_launches.py`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from torch.fx import GraphModule, Node

from seqcompile.fx.nodes import device_of, site_name
from seqcompile.lower.choice import Choice, choose
from seqcompile.lower.inline import BODIES, fake_mode_of, inline_bodies
from seqcompile.lower.planned_launches import launches_planned
from seqcompile.lower.traced_launches import inline_launches, launch_trace, launches_inlined
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call
from seqcompile.options import Options
from seqcompile.report import CompileReport, ImplementationUse

__all__ = ["CHOSEN", "choose_implementations", "implement", "launches_inlined", "launches_planned"]

log = logging.getLogger("seqcompile")

CHOSEN = "seqfast_implementation"
"""The `node.meta` key of a fused call's `Choice`."""


def choose_implementations(
    gm: GraphModule,
    fake_mode: Any,
    options: Options,
    executor: str,
    report: CompileReport,
    where: tuple[str, str],
) -> None:
    """Choose what each fused call of `gm` runs (kept on the node) and note it in `report`
    (`where`: the graph's name and direction)."""
    graph, direction = where
    for node, choice in choose(gm, fake_mode, options, executor).items():
        device = device_of(node)
        if choice.implementation == "kernel" and launches_inlined(device, executor):
            choice = _launching(node, choice, fake_mode, "launched by the executor")
        elif choice.implementation == "kernel" and launches_planned(device, executor):
            choice = _launching(node, choice, fake_mode, "launched from its plan", planned=True)
        node.meta[CHOSEN] = choice
        entry = registry.entry_of(node)
        label = entry.label_of(Call.of(node))
        report.saves.setdefault(entry.name, entry.saves)
        site = site_name(node)
        use = ImplementationUse(
            graph, direction, label, node.name, site, choice.implementation, choice.reason
        )
        report.add_implementation(use)


def _launching(
    node: Node, choice: Choice, fake_mode: Any, how: str, planned: bool = False
) -> Choice:
    """`choice` (the call's kernels), launched as `how` says where the call's launches trace."""
    traced = launch_trace(node, fake_mode)
    if isinstance(traced, str):
        return dataclasses.replace(choice, reason=f"{choice.reason}; called as an op: {traced}")
    reason = f"{choice.reason}; {how}"
    return dataclasses.replace(choice, reason=reason, launched=True, planned=planned)


def implement(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    options: Options,
    executor: str,
    report: CompileReport,
    where: tuple[str, str],
) -> list[str]:
    """Inline the lowerings and vendor bodies chosen for `gm`'s fused calls, and the launches of
    those that run kernels the executor launches (choosing first for a graph that reaches stage
    6 without its choices); the ops inlined, in order."""
    fake_mode = fake_mode_of(gm, example_inputs)
    if any(_unchosen(node) for node in gm.graph.nodes):
        choose_implementations(gm, fake_mode, options, executor, report, where)
    launched = [node for node in gm.graph.nodes if _chosen(node).launched]
    planned = {node for node in launched if _chosen(node).planned}
    ops = [str(node.target) for node in launched]
    for node, why in inline_launches(gm, fake_mode, launched, planned).items():
        log.warning("seqfast: %s is called as an op after all: %s", node.name, why)
    bodies = {node: _chosen(node).implementation for node in gm.graph.nodes}
    bodies = {node: kind for node, kind in bodies.items() if kind in BODIES}
    return ops + inline_bodies(gm, example_inputs, bodies)


def _unchosen(node: Any) -> bool:
    return registry.entry_of(node) is not None and not isinstance(node.meta.get(CHOSEN), Choice)


def _chosen(node: Any) -> Choice:
    choice = node.meta.get(CHOSEN)
    return choice if isinstance(choice, Choice) else Choice("", "")
