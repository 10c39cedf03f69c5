"""The live bytes of one training step over its forward-then-backward schedule, computed from the
partitioned graphs' fake values at the traced sizes, before anything runs.

Memory is counted by storage: a view costs nothing, a value is live from the node that creates its
storage to the last node that reads it. What the forward returns (the values kept for the
backward, the user's outputs) stays live into the backward; the backward's outputs (the
gradients) stay live to its end. Graph inputs (parameters, the batch) live regardless and are
counted apart. A fused operator's workspace is live while it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from seqcompile.fx.nodes import concrete, val
from seqcompile.memory.estimate import graph_outputs, is_fused_output, saved_values
from seqcompile.ops import registry


@dataclasses.dataclass(frozen=True)
class StepMemory:
    kept_bytes: int
    """What the forward computes and keeps for the backward."""
    kept_tensors: int
    kept_fused_bytes: int
    """Part of `kept_bytes` that fused operators made (their outputs, sums and row statistics)."""
    recomputed_bytes: int
    """What the backward's recompute allocates (checkpoint regions, the memory budget): the
    values it makes again instead of keeping, and the intermediates it makes on the way."""
    kept_input_bytes: int
    """Graph inputs other than parameters that the backward reads (the batch, or activations
    an earlier graph made): kept alive for the backward too."""
    kept_shapes: tuple[tuple[int, ...], ...]
    """The shape of each tensor the backward reads from the forward, made there or an input,
    parameters and the user's outputs aside."""
    peak_bytes: int
    """The most bytes live at once over the step, gradients made so far included, inputs not."""
    peak_node: str
    """The node running at the peak."""
    parameter_bytes: int
    input_bytes: int
    """The other graph inputs: the batch, or what an earlier graph made."""
    gradient_bytes: int
    """What the backward returns: the inputs' gradients."""
    timeline: Timeline
    """Live bytes after each call in the graphs, the forward's then the backward's."""


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Live bytes after each step of a schedule (an op, or a graph node), the forward's then the
    backward's."""

    values: tuple[int, ...]
    forward_steps: int
    """How many of `values` belong to the forward."""

    @property
    def peak(self) -> int:
        return max(self.values, default=0)

    @property
    def after_forward(self) -> int:
        """What the forward leaves live: what it keeps for the backward and returns."""
        return self.values[self.forward_steps - 1] if self.forward_steps else 0

    @property
    def after_backward(self) -> int:
        return self.values[-1] if self.values else 0


def step_memory(
    forward: GraphModule,
    backward: GraphModule,
    num_fwd_outputs: int,
    parameters: set[str],
    recomputed: Iterable[Node] = (),
) -> StepMemory:
    """The step's memory; `parameters` names the forward's placeholders that are parameters and
    `recomputed` the backward's nodes that redo forward work."""
    forward_out = graph_outputs(forward)
    placeholders = forward.graph.find_nodes(op="placeholder")
    inputs = {key: size for n in placeholders for key, size in storages(n)}
    params = {key: size for n in placeholders if n.name in parameters for key, size in storages(n)}
    user = {key for n in forward_out[:num_fwd_outputs] for key, _ in storages(n)}
    kept_nodes = saved_values(forward, num_fwd_outputs)
    kept = {
        key: size
        for n in kept_nodes
        for key, size in storages(n)
        if key not in params and key not in user
    }
    made = kept.keys() - inputs.keys()
    fused = {key for n in kept_nodes if is_fused_output(n) for key, _ in storages(n)}
    redone = {
        key: size
        for n in recomputed
        for key, size in storages(n)
        if key not in inputs and key not in kept
    }
    live: dict[StorageWeakRef, int] = {}
    held = {key for n in forward_out for key, _ in storages(n)}
    fwd = _walk(forward, inputs, held, live)
    grads = {key: size for n in graph_outputs(backward) for key, size in storages(n)}
    bwd = _walk(backward, inputs, user | set(grads), live)
    peak_bytes, peak_node = max(fwd.peak, bwd.peak)
    return StepMemory(
        kept_bytes=sum(kept[key] for key in made),
        kept_tensors=sum(1 for n in kept_nodes if any(key in made for key, _ in storages(n))),
        kept_fused_bytes=sum(kept[key] for key in made & fused),
        recomputed_bytes=sum(redone.values()),
        kept_input_bytes=sum(size for key, size in kept.items() if key in inputs),
        kept_shapes=tuple(
            tuple(concrete(n) for n in leaf.shape)
            for node in kept_nodes
            for leaf in tree_flatten(val(node))[0]
            if isinstance(leaf, torch.Tensor) and StorageWeakRef(leaf.untyped_storage()) in kept
        ),
        peak_bytes=peak_bytes,
        peak_node=peak_node,
        parameter_bytes=sum(params.values()),
        input_bytes=sum(size for key, size in inputs.items() if key not in params),
        gradient_bytes=sum(size for key, size in grads.items() if key not in inputs),
        timeline=Timeline(fwd.timeline + bwd.timeline, len(fwd.timeline)),
    )


@dataclasses.dataclass
class _Walk:
    timeline: tuple[int, ...]
    peak: tuple[int, str]


def _walk(
    gm: GraphModule,
    inputs: dict[StorageWeakRef, int],
    held: set[StorageWeakRef],
    live: dict[StorageWeakRef, int],
) -> _Walk:
    """Run `gm`'s schedule over `live` (updated in place): storages appear at their first node
    and go after their last reader unless `held`."""
    nodes = list(gm.graph.nodes)
    last: dict[StorageWeakRef, int] = {}
    for i, node in enumerate(nodes):
        for source in (node, *node.all_input_nodes):
            for key, _ in storages(source):
                last[key] = i
    timeline, peak = [], (sum(live.values()), "")
    for i, node in enumerate(nodes):
        for key, size in storages(node):
            if key not in inputs:
                live.setdefault(key, size)
        running = sum(live.values()) + registry.workspace_of(node)
        peak = max(peak, (running, node.name))
        for key in [k for k in live if last.get(k, -1) <= i and k not in held]:
            del live[key]
        if node.op == "call_function":
            timeline.append(sum(live.values()))
    return _Walk(tuple(timeline), peak)


def storages(node: Any) -> Iterator[tuple[StorageWeakRef, int]]:
    leaves, _ = tree_flatten(val(node))
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            yield StorageWeakRef(storage), concrete(storage.nbytes())


def combined_timeline(steps: Sequence[StepMemory]) -> Timeline:
    """One step's schedule from its graphs' (a graph break makes several): the forwards in
    order, each on top of what the earlier ones keep, then the backwards in reverse, each on top
    of what the earlier graphs still keep and the gradients the later ones made."""
    timelines = [s.timeline for s in steps]
    forward = [
        v + _before(timelines, i, 0)
        for i, t in enumerate(timelines)
        for v in t.values[: t.forward_steps]
    ]
    backward = [
        v + _before(timelines, i, 1)
        for i in reversed(range(len(timelines)))
        for v in timelines[i].values[timelines[i].forward_steps :]
    ]
    return Timeline(tuple(forward + backward), len(forward))


def combined_peak(steps: Sequence[StepMemory]) -> int:
    """The step's peak over its graphs: each graph's own peak on top of what the others hold
    while its backward runs (the larger of its two phases' offsets)."""
    timelines = [s.timeline for s in steps]
    return max(s.peak_bytes + _before(timelines, i, 1) for i, s in enumerate(steps))


def _before(timelines: Sequence[Timeline], i: int, phase: int) -> int:
    """What the other graphs hold while graph `i` runs its forward (phase 0: the earlier graphs'
    kept values) or its backward (phase 1: those, and the later graphs' gradients)."""
    earlier = sum(t.after_forward for t in timelines[:i])
    return earlier + phase * sum(t.after_backward for t in timelines[i + 1 :])
