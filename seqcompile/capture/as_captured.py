"""A graph seqfast cannot keep correct runs as Dynamo captured it, nothing fused, said in a warning
and the report: one that holds something the stages refuse (`Uncompilable`), and one on a tensor
subclass (DTensor, a quantized or nested tensor, ...) on which a stage, or the compiled graph's
first call, fails."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from seqcompile.report import CompileReport, Missed, publish


def subclass_in(gm: GraphModule, example_inputs: Sequence[Any]) -> str | None:
    """The name of a tensor subclass (DTensor, a quantized or nested tensor, ...) among the
    graph's inputs or the values Dynamo recorded for its nodes (None: it holds none)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    values = [*example_inputs, *(n.meta.get("example_value") for n in gm.graph.nodes)]
    found = next((v for v in pytree.tree_leaves(values) if is_traceable_wrapper_subclass(v)), None)
    return None if found is None else type(found).__name__


def captured_if_first_call_fails(
    compiled: Callable[..., Any], gm: GraphModule, name: str, subclass: str
) -> Callable[..., Any]:
    """`compiled`, unless its first call raises: then that call and every later one run the graph
    as Dynamo captured it, said as `as_captured` says it (AOTAutograd's runtime meets some
    tensor subclass graphs only there, where every rank fails alike)."""
    chosen: list[Callable[..., Any]] = []

    def run(*args: Any) -> Any:
        if chosen:
            return chosen[0](*args)
        try:
            result = compiled(*args)
        except Exception as error:
            reason = f"it holds a {subclass}, on which its first call raised {first_line(error)}"
            chosen.append(as_captured(gm, reason, name))
            return chosen[0](*args)
        chosen.append(compiled)
        return result

    return run


def first_line(error: BaseException) -> str:
    """The error's type and the first line of its message, as the report says what failed."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def as_captured(gm: GraphModule, reason: str, name: str) -> Callable[..., Any]:
    """Run the graph as Dynamo captured it, saying why in a warning and the report."""
    warnings.warn(f"seqfast: {name} runs as captured, nothing fused: {reason}", stacklevel=2)
    report = CompileReport(graphs=[name])
    report.missed.append(Missed(name, "graph", f"runs as captured, nothing fused: {reason}"))
    publish(report)
    return gm.forward
