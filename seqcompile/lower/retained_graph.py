"""A backward whose in-place twins (`memory/in_place.py`) write over saved tensors, made safe to run
again: where autograd keeps the graph (`retain_graph=True`), each call hands the twins copies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node

from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call


def written_inputs(backward: GraphModule) -> list[int]:
    """Positions of the backward graph's inputs (saved tensors) that in-place twins write over."""
    written: set[Node] = set()
    for node in backward.graph.nodes:
        entry = registry.entry_of(node)
        if entry is None or entry.in_place is None or node.target is not entry.in_place.twin:
            continue
        over = Call.of(node)[entry.in_place.over]
        if isinstance(over, Node) and over.op == "placeholder":
            written.add(over)
    placeholders = backward.graph.find_nodes(op="placeholder")
    return [i for i, node in enumerate(placeholders) if node in written]


def keeping_saved(
    run: Callable[[list[Any]], Any], positions: list[int]
) -> Callable[[list[Any]], Any]:
    """The boxed backward `run`, whose in-place twins write over its inputs at `positions`, made
    safe to run twice: where autograd keeps the graph for another backward, those inputs are
    copied first (the memory `reuse_saved` would have saved is spent on this call alone), so
    the saved tensors stay as the forward left them; where it frees the graph they cannot be
    read again, and the twins write over them."""
    if not positions:
        return run

    def backward(args: list[Any]) -> Any:
        if torch._C._autograd._get_current_graph_task_keep_graph():
            for i in positions:
                args[i] = _copy(args[i])
        return run(args)

    backward._boxed_call = True  # type: ignore[attr-defined]
    return backward


def _copy(saved: torch.Tensor) -> torch.Tensor:
    """A copy with `saved`'s strides, which the backward was traced (and Inductor compiled) for."""
    copy = torch.empty_strided(saved.size(), saved.stride(), dtype=saved.dtype, device=saved.device)
    return copy.copy_(saved)
