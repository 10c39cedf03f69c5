"""Stage 6's fused calls: what each runs (`choice.py`, measured by `measure.py`), chosen for all
of a plan's graphs once stage 5 has made them (so the report says it at compile time, though the
backward is lowered only at the first backward), and, where a call runs its lowering, the lowering
inlined into its graph (`inline.py`) for the executor to compile with its neighbours."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.fx import GraphModule

from seqcompile.fx_utils import site_name
from seqcompile.lower.choice import Choice, choose
from seqcompile.lower.inline import fake_mode_of, inline_lowerings
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call
from seqcompile.options import Options
from seqcompile.report import CompileReport, ImplementationUse

__all__ = ["CHOSEN", "choose_implementations", "implement"]

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
        node.meta[CHOSEN] = choice
        label = registry.entry_of(node).label_of(Call.of(node))
        site = site_name(node)
        use = ImplementationUse(
            graph, direction, label, node.name, site, choice.implementation, choice.reason
        )
        report.add_implementation(use)


def implement(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    options: Options,
    executor: str,
    report: CompileReport,
    where: tuple[str, str],
) -> list[str]:
    """Inline the lowerings chosen for `gm`'s fused calls (choosing first for a graph that
    reaches stage 6 without its choices); the ops inlined, in order."""
    if any(_unchosen(node) for node in gm.graph.nodes):
        fake_mode = fake_mode_of(gm, example_inputs)
        choose_implementations(gm, fake_mode, options, executor, report, where)
    lowered = [node for node in gm.graph.nodes if _runs(node) == "lowering"]
    return inline_lowerings(gm, example_inputs, lowered)


def _unchosen(node: Any) -> bool:
    return registry.entry_of(node) is not None and not isinstance(node.meta.get(CHOSEN), Choice)


def _runs(node: Any) -> str | None:
    choice = node.meta.get(CHOSEN)
    return choice.implementation if isinstance(choice, Choice) else None
