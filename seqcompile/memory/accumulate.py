"""Gradient accumulation into `.grad` (option `accumulate_grads`): the backward adds each
parameter's gradient straight into the parameter's existing `.grad`, and hands autograd None for
it, so a micro-batch allocates no weight-sized gradient and runs no separate accumulation kernel.

The backward graph gets one placeholder per parameter, its `.grad`; the callable that runs the
backward passes them in (creating zero `.grad`s on the first micro-batch). Where a gradient comes
from, the accumulation goes in: a weight-gradient matmul becomes `addmm_` into `.grad`, a fused
op's backward output goes through the op's accumulation hook in the registry (the linear +
cross-entropy scales its finished weight gradient into it), an embedding's backward
scatters its rows into it, a sum of such terms (a tied weight) accumulates each term; any other
gradient (biases, norm weights) is computed and then added in place.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torch.fx import GraphModule, Node

import seqcompile.ops.accumulate  # noqa: F401  (registers the seqfast::accumulate* ops)
from seqcompile.fx_utils import is_call, val
from seqcompile.memory.estimate import graph_outputs
from seqcompile.ops import registry

aten = torch.ops.aten
seqfast = torch.ops.seqfast


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """Which forward inputs accumulate into their `.grad`, by position."""

    positions: tuple[int, ...]
    hooked: tuple[str, ...] = ()
    """Fused backward calls whose gradients their registry hook accumulates."""


def accumulate_into_grads(backward: GraphModule, positions: list[int]) -> Accumulation:
    """Rewrite `backward` so the gradients of the forward inputs at `positions` (parameters) are
    accumulated into new trailing placeholders, one per parameter, and returned as None."""
    graph = backward.graph
    outputs = graph_outputs(backward)
    last_placeholder = list(graph.find_nodes(op="placeholder"))[-1]
    taken, hooked = [], []
    for position in positions:
        gradient = outputs[position]
        if not isinstance(gradient, Node):
            continue
        with graph.inserting_after(last_placeholder):
            buffer = graph.placeholder(f"grad_{position}")
        buffer.meta["val"] = val(gradient)
        last_placeholder = buffer
        with graph.inserting_before(gradient.next):
            hooked += _accumulate(graph, buffer, gradient)
        outputs[position] = None
        taken.append(position)
    output = next(iter(graph.find_nodes(op="output")))
    output.args = (tuple(outputs),)
    graph.eliminate_dead_code()
    backward.recompile()
    return Accumulation(tuple(taken), tuple(dict.fromkeys(hooked)))


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
        if transposed:  # (a @ b)^T = b^T @ a^T
            a, b = (graph.call_function(aten.t.default, (x,)) for x in (b, a))
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


def check_parameters(parameters: list[Tensor]) -> None:
    """Refuse what cannot see a gradient that never passes through autograd."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError(
            'options["accumulate_grads"] cannot run under torch.distributed: DistributedData'
            "Parallel's reducer and FSDP take each gradient from autograd, which this option"
            " bypasses. Turn the option off, or accumulate with DDP's no_sync()."
        )
    for p in parameters:
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            raise RuntimeError(
                'options["accumulate_grads"] cannot honour a gradient hook on a parameter of'
                f" shape {tuple(p.shape)}: the gradient is added into .grad without passing"
                " through autograd, so the hook would never run. Remove the hook or the option."
            )


def check_backward_writes_grads(parameters: list[Tensor]) -> None:
    """Refuse a backward that autograd runs without writing every parameter's `.grad`
    (`torch.autograd.grad`, `backward(inputs=...)` naming only some): this backward would add the
    gradients into `.grad` anyway and hand the caller none."""
    for p in parameters:
        try:
            writes = torch._C._will_engine_execute_node(get_gradient_edge(p).node)
        except RuntimeError:  # raised for a leaf while autograd.grad runs: it writes no .grad
            writes = False
        if not writes:
            raise RuntimeError(
                'options["accumulate_grads"] adds every parameter\'s gradient into its .grad,'
                " but this backward asks for gradients without writing .grad for the parameter"
                f" of shape {tuple(p.shape)} (torch.autograd.grad, or backward(inputs=...)"
                " naming only some tensors). Call backward() without inputs=, or compile"
                " without accumulate_grads for this use."
            )


def run_accumulating(
    backward: Callable[[list[Any]], Any], parameters: Callable[[], list[Tensor]]
) -> Callable[[list[Any]], Any]:
    """The boxed backward, given each parameter's `.grad` (zeros when it has none) as trailing
    inputs."""

    def run(args: list[Any]) -> Any:
        params = parameters()
        check_parameters(params)
        check_backward_writes_grads(params)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        args.extend(p.grad for p in params)
        return backward(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
