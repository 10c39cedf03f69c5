"""Gradient accumulation into `.grad` (option `accumulate_grads`): the backward adds each
parameter's gradient straight into the parameter's existing `.grad`, and hands autograd None for
it, so a micro-batch allocates no weight-sized gradient and runs no separate accumulation kernel.

The forward saves each such parameter for the backward (most are saved anyway, for the matmuls'
input gradients), so a backward finds the `.grad`s of the parameters its own forward call ran with,
even when one compiled graph serves several modules. The backward graph gets one more placeholder
per parameter, its `.grad`, passed in at run time and traced laid out as `zeros_like` lays out
the parameter (the `.grad` a first micro-batch creates; where the user laid one out otherwise, an
executor compiled to that layout gets it through a copy); the backward as autograd traced it is
kept beside, for calls whose gradients must go through autograd (`lower/gradient_destination.py`
chooses both). Where a gradient comes from, the accumulation goes in: a weight-gradient matmul
becomes `addmm_` into `.grad`, a fused op's backward output goes through the op's accumulation
hook in the registry (the linear + cross-entropy scales its finished weight gradient into it), an
embedding's backward scatters its rows into it, a sum of such terms (a tied weight) accumulates
each term; any other gradient (biases, norm weights) is computed and then added in place.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

import seqcompile.ops.accumulate  # noqa: F401  (registers the seqfast::accumulate* ops)
from seqcompile.fx.nodes import is_call, val
from seqcompile.memory.estimate import graph_outputs
from seqcompile.ops import registry

aten = torch.ops.aten
seqfast = torch.ops.seqfast


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """Which forward inputs accumulate into their `.grad`, and the two backwards."""

    positions: tuple[int, ...]
    """The inputs of the graph Dynamo captured (parameters) whose gradients are added into
    `.grad`."""
    inputs: tuple[int, ...]
    """Where the forward graph receives them (after AOTAutograd's effect tokens)."""
    arguments: tuple[int, ...]
    """Where the backward receives each of those parameters, saved by the forward."""
    returning: GraphModule
    """The backward as autograd traced it, returning every gradient: it takes the same inputs
    as the accumulating backward but the `.grad`s."""
    hooked: tuple[str, ...] = ()
    """Fused backward calls whose gradients their registry hook accumulates."""


def accumulate_into_grads(
    forward: GraphModule, backward: GraphModule, num_fwd_outputs: int, positions: list[int]
) -> Accumulation:
    """Make `forward` save the parameters at `positions` (forward inputs) that have a gradient,
    keep a copy of `backward` as it is, and rewrite `backward` so those gradients are accumulated
    into new trailing placeholders, one per parameter, and returned as None."""
    outputs = graph_outputs(backward)
    taken = [p for p in positions if isinstance(outputs[p], Node)]
    placeholders = list(forward.graph.find_nodes(op="placeholder"))
    # the forward's inputs start with AOTAutograd's effect tokens, which have no gradient
    tokens = len(placeholders) - len(outputs)
    inputs = tuple(p + tokens for p in taken)
    # a `.grad` as run time creates it, not as the gradient is made (a sum's is expanded)
    layouts = {p: torch.empty_like(val(placeholders[p + tokens])) for p in taken}
    arguments = save_for_backward(forward, backward, num_fwd_outputs, list(inputs))
    returning = copy.deepcopy(backward)
    graph = backward.graph
    last_placeholder = list(graph.find_nodes(op="placeholder"))[-1]
    hooked = []
    for position in taken:
        gradient = outputs[position]
        with graph.inserting_after(last_placeholder):
            buffer = graph.placeholder(f"grad_{position}")
        buffer.meta["val"] = layouts[position]
        last_placeholder = buffer
        with graph.inserting_before(gradient.next):
            hooked += _accumulate(graph, buffer, gradient)
        outputs[position] = None
    output = next(iter(graph.find_nodes(op="output")))
    output.args = (tuple(outputs),)
    graph.eliminate_dead_code()
    backward.recompile()
    return Accumulation(tuple(taken), inputs, arguments, returning, tuple(dict.fromkeys(hooked)))


def save_for_backward(
    forward: GraphModule, backward: GraphModule, num_fwd_outputs: int, inputs: list[int]
) -> tuple[int, ...]:
    """Where the backward receives each forward input (placeholder) at `inputs`, adding it to
    what the forward saves where it is not saved yet. AOTAutograd's layout: the forward returns
    its outputs, then the saved tensors, then saved opaque objects and sizes; the backward takes
    the saved sizes, then the saved tensors (in the same order), then the rest. A parameter goes
    first among the saved tensors, where AOTAutograd checks version counters."""
    placeholders = list(forward.graph.find_nodes(op="placeholder"))
    forward_output = next(iter(forward.graph.find_nodes(op="output")))
    returned = list(forward_output.args[0])
    sizes = sum(
        isinstance(val(n), int | float | torch.SymInt | torch.SymFloat)
        for n in returned[num_fwd_outputs:]
    )
    received = list(backward.graph.find_nodes(op="placeholder"))
    first_tensor = received[sizes]  # a saved tensor, or what follows them
    added = 0
    for position in inputs:
        parameter = placeholders[position]
        if parameter.name not in {node.name for node in received}:
            returned.insert(num_fwd_outputs + added, parameter)
            with backward.graph.inserting_before(first_tensor):
                placeholder = backward.graph.placeholder(parameter.name)
            placeholder.meta["val"] = val(parameter)
            added += 1
            received = list(backward.graph.find_nodes(op="placeholder"))
    forward_output.args = (tuple(returned),)
    forward.recompile()
    backward.recompile()
    where = {node.name: i for i, node in enumerate(received)}
    return tuple(where[placeholders[position].name] for position in inputs)


def _accumulate(graph: Any, buffer: Node, gradient: Node) -> list[str]:
    """Insert the calls that add `gradient`'s value into `buffer`, inside its producer when the
    producer allows; return the fused backward calls whose hook did it."""
    if is_call(gradient, aten.add.Tensor) and all(
        isinstance(a, Node) and val(a).shape == val(gradient).shape for a in gradient.args[:2]
    ):
        return [name for term in gradient.args[:2] for name in _accumulate(graph, buffer, term)]
    matmul, transposed = _through_transposes(gradient)
    if is_call(matmul, aten.mm.default):
        a, b = matmul.args
        if transposed:  # (a @ b)^T = b^T @ a^T; permute, as decomposed graphs spell it
            a, b = (graph.call_function(aten.permute.default, (x, [1, 0])) for x in (b, a))
        graph.call_function(seqfast.accumulate_matmul_.default, (buffer, a, b))
        return []
    if gradient.target is operator.getitem:
        call, output = gradient.args
        entry = registry.entry_of(call)
        if entry is not None and entry.accumulate is not None:
            if entry.accumulate(graph, buffer, call, output):
                return [call.name]
    if is_call(gradient, aten.embedding_dense_backward.default) and not gradient.args[4]:
        rows, indices, _, padding_idx, _ = gradient.args
        graph.call_function(seqfast.accumulate_rows_.default, (buffer, rows, indices, padding_idx))
        return []
    graph.call_function(seqfast.accumulate_.default, (buffer, gradient))
    return []


def _through_transposes(node: Node) -> tuple[Node, bool]:
    """The node under a chain of 2-D transposes, and whether the chain transposes it."""
    transposed = False
    while is_call(node, aten.t.default) or (
        is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]
    ):
        node, transposed = node.args[0], not transposed
    return node, transposed
