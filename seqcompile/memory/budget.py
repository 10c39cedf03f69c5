"""Rematerialization under a memory budget: which forward values the backward recomputes instead
of keeping, chosen on the joint graph before it is partitioned.

The model: the backward needs some forward values; each needed value is either kept or, when it
is recomputed, its own inputs are needed in its place, back to what is kept. Starting from the
save-everything plan (only the user's checkpoint regions recomputed), a greedy loop recomputes the
move that frees the most kept bytes per second of recompute on the device roofline: first every
cheap move that frees bytes (no FLOPs: with no budget, that is all), then any move until the kept
bytes fit the budget. A move is one kept value alone (its inputs become kept), the value with
the chain of unkept values it is computed from (back to kept values, or to values whose memory a
kept value holds anyway), or the chains of every kept value sharing its storage (views of one
tensor are freed together); a move that redoes a multi-output op also selects its other outputs
again. Views and tuple selections are free to recompute,
norms and pointwise regions cheap, matmuls and attention dear. The chosen nodes are tagged for
recomputation the way torch tags checkpoint regions (with no region id, so no boundary
between them is kept), and the partitioner places them.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Iterable

import torch
from torch._functorch import partitioners
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from seqcompile.memory.cost import NodeCost, Roofline, node_cost, total_cost
from seqcompile.memory.estimate import graph_outputs
from seqcompile.memory.liveness import storages
from seqcompile.memory.partition import is_random
from seqcompile.options import Budget

_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)
MOVED_PER_FREED_BYTE = 4
"""With no budget, a cheap move is taken when its recompute moves at most this many bytes per kept
byte it frees (an activation recomputed from its input: 2; a loss over the logits recomputed to
free its row statistics: far more)."""


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    """What the budget changed in one graph."""

    budget: str
    target_bytes: int
    baseline_bytes: int
    """What the save-everything plan keeps, by the planner's model."""
    planned_bytes: int
    """What the plan keeps, by the planner's model."""
    recomputed: tuple[str, ...]
    """The nodes the plan added to the recomputation, in the order chosen."""
    cost: NodeCost
    """FLOPs and bytes of recomputing them once."""
    seconds: float
    """Their recompute time on the roofline."""
    reachable: bool
    """Whether the plan fits the target; when not, it is the least the planner could reach."""
    cheap_only: bool = False
    """No budget: only what is cheap to recompute was chosen."""


def plan_recompute(
    joint: GraphModule,
    num_fwd_outputs: int,
    budget: Budget,
    roofline: Roofline,
) -> RecomputePlan:
    """Choose what to recompute so that the kept bytes fit `budget`, and tag those joint-graph
    nodes for recomputation. First, at any budget, what is cheap: every move of nodes without
    FLOPs in the cost model (views, casts, pointwise regions, norms; never a matmul or attention)
    that frees kept bytes, at most `MOVED_PER_FREED_BYTE` moved per byte freed; then, until the
    budget fits, the best move of any kind."""
    model = _KeptModel(joint, num_fwd_outputs)
    baseline = model.kept_bytes
    target = budget.target(baseline)
    chosen: list[Node] = []
    for cheap_only in (True, False):
        while cheap_only or model.kept_bytes > target:
            move = model.best_move(roofline, cheap_only=cheap_only)
            if move is None:
                break
            model.recompute(move)
            chosen.extend(n for n in move if n not in chosen)
    for node in chosen:  # no region id: the plan has no region boundary to keep
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta.pop("ac_graph_id", None)
    return RecomputePlan(
        budget=str(budget),
        target_bytes=target,
        baseline_bytes=baseline,
        planned_bytes=model.kept_bytes,
        recomputed=tuple(n.name for n in chosen),
        cost=total_cost(chosen, model.cost),
        seconds=sum(model.cost(n).seconds(roofline) for n in chosen),
        reachable=model.kept_bytes <= target,
        cheap_only=budget.unlimited,
    )


def recomputed_in(backward: GraphModule, joint_forward: set[str]) -> list[Node]:
    """The backward's nodes that redo forward work: calls named as joint-graph forward nodes (the
    partitioners copy a recomputed node under its own name)."""
    return [n for n in backward.graph.nodes if n.op == "call_function" and n.name in joint_forward]


def forward_nodes(joint: GraphModule) -> list[Node]:
    """The joint graph's forward, where the partitioners draw the line: every node up to the last
    one AOTAutograd traced for the forward, tangents aside."""
    nodes = list(joint.graph.nodes)
    last = max(
        i
        for i, n in enumerate(nodes)
        if partitioners._has_tag_is_forward(n) or partitioners._is_primal(n)
    )
    return [n for n in nodes[: last + 1] if not partitioners._is_tangent(n)]


class _KeptModel:
    """The kept values of a recompute set, by storage, updated move by move."""

    def __init__(self, joint: GraphModule, num_fwd_outputs: int) -> None:
        forward = forward_nodes(joint)
        self.forward = set(forward)
        self.order = {n: i for i, n in enumerate(joint.graph.nodes)}
        self._costs: dict[Node, NodeCost] = {}
        self._storages: dict[Node, list[tuple[StorageWeakRef, int]]] = {}
        self.holding: dict[StorageWeakRef, set[Node]] = {}
        users_outside = [n for n in forward if any(u not in self.forward for u in n.users)]
        self.free = {  # storages that live regardless: inputs and the user's outputs
            key
            for n in (
                *joint.graph.find_nodes(op="placeholder"),
                *graph_outputs(joint)[:num_fwd_outputs],
            )
            if isinstance(n, Node)
            for key, _ in self.storages(n)
        }
        self.recomputed = {n for n in forward if _user_recomputed(n)}
        self.kept: set[Node] = set()
        self.holders: Counter[StorageWeakRef] = Counter()
        self.kept_bytes = 0
        self._keep(_frontier(users_outside, self.recomputed))

    def _keep(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            if node in self.kept:
                continue
            self.kept.add(node)
            for key, size in self.storages(node):
                if key in self.free:
                    continue
                self.holding.setdefault(key, set()).add(node)
                if self.holders[key] == 0:
                    self.kept_bytes += size
                self.holders[key] += 1

    def _drop(self, node: Node) -> None:
        if node not in self.kept:
            return
        self.kept.remove(node)
        for key, size in self.storages(node):
            if key in self.free:
                continue
            self.holding[key].discard(node)
            self.holders[key] -= 1
            if self.holders[key] == 0:
                self.kept_bytes -= size

    def recompute(self, move: list[Node]) -> None:
        self.recomputed.update(move)
        for node in move:
            self._drop(node)
        self._keep(self._new_inputs(move))

    def _new_inputs(self, move: list[Node]) -> list[Node]:
        inside = set(move)
        return [
            i
            for n in move
            for i in n.all_input_nodes
            if i not in inside and i not in self.recomputed and i not in self.kept
        ]

    def gain(self, move: list[Node]) -> int:
        """Kept bytes the move frees (negative when its inputs weigh more)."""
        dropping = Counter(key for n in move if n in self.kept for key, _ in self.storages(n))
        freed = {
            key: size
            for n in move
            for key, size in self.storages(n)
            if key not in self.free and dropping[key] == self.holders[key] > 0
        }
        added = {
            key: size
            for i in self._new_inputs(move)
            for key, size in self.storages(i)
            if key not in self.free and self.holders[key] == dropping[key]
        }
        return sum(freed.values()) - sum(added.values())

    def best_move(self, roofline: Roofline, cheap_only: bool = False) -> list[Node] | None:
        """The move that frees the most kept bytes per second of recompute (None: no move frees
        any); with `cheap_only`, among moves whose nodes have no FLOPs."""
        best, best_score = None, (0.0, 0)
        for node in sorted(self.kept, key=self.order.__getitem__):
            if not self._recomputable(node):
                continue
            chains = (self._chain(node), self._chain(node, read_held=True))
            for candidate in (self._unit(node), *chains, self._sharing(node)):
                move = self._with_selections(candidate)
                if cheap_only and any(self.cost(n).flops for n in move):
                    continue
                gain = self.gain(move)
                if gain <= 0:
                    continue
                moved = sum(self.cost(n).moved_bytes for n in move)
                if cheap_only and gain * MOVED_PER_FREED_BYTE < moved:
                    continue
                seconds = sum(self.cost(n).seconds(roofline) for n in move)
                score = (gain / seconds if seconds else float("inf"), gain)
                if score > best_score:
                    best, best_score = move, score
        return best

    def storages(self, node: Node) -> list[tuple[StorageWeakRef, int]]:
        if node not in self._storages:
            self._storages[node] = list(storages(node))
        return self._storages[node]

    def cost(self, node: Node) -> NodeCost:
        if node not in self._costs:
            self._costs[node] = node_cost(node)
        return self._costs[node]

    def _recomputable(self, node: Node) -> bool:
        if node not in self.forward or node.op != "call_function" or node.is_impure():
            return False
        target = node.target
        if target is operator.getitem:
            return self._recomputable(node.args[0])
        if isinstance(target, torch._ops.OpOverload):
            return not is_random(target)
        return False

    def _unit(self, node: Node) -> list[Node]:
        """`node`, with the multi-output op it selects from."""
        if node.target is operator.getitem and node.args[0] not in self.recomputed:
            return [node.args[0], node]
        return [node]

    def _with_selections(self, move: list[Node]) -> list[Node]:
        """`move`, with every selection from a multi-output op it recomputes: the op runs again
        in the backward, so keeping its other outputs would waste their bytes (min-cut selects
        them again; the default partitioner would keep them)."""
        inside = set(move)
        return move + [
            user
            for n in move
            if n.target is not operator.getitem
            for user in n.users
            if user.target is operator.getitem
            and user in self.forward
            and user not in inside
            and user not in self.recomputed
        ]

    def _sharing(self, node: Node) -> list[Node]:
        """The chains of every kept value that shares a storage with `node` (views of one
        tensor are freed together or not at all)."""
        sharing = {other for key, _ in self.storages(node) for other in self.holding.get(key, ())}
        move: list[Node] = []
        for other in sorted(sharing, key=self.order.__getitem__):
            if self._recomputable(other):
                move.extend(n for n in self._chain(other) if n not in move)
        return move

    def _chain(self, node: Node, read_held: bool = False) -> list[Node]:
        """`node` and the unkept, recomputable values it is computed from, back to kept ones;
        with `read_held`, also back to values whose memory another kept value holds (an alias of
        a kept sum is then read, not made again)."""
        move, stack = [], [node]
        while stack:
            current = stack.pop()
            if current in move:
                continue
            move.append(current)
            for i in current.all_input_nodes:
                if i in self.recomputed or (i in self.kept and i is not node):
                    continue
                if self._recomputable(i) and not (read_held and self._held_elsewhere(i, node)):
                    stack.append(i)
        return move

    def _held_elsewhere(self, value: Node, node: Node) -> bool:
        """Whether all of `value`'s memory lives anyway: inputs, outputs, or held by a kept value
        other than `node`."""
        return all(
            key in self.free or self.holding.get(key, set()) - {node}
            for key, _ in self.storages(value)
        )


def _user_recomputed(node: Node) -> bool:
    """Whether a checkpoint region recomputes `node`: tagged, and not the last node before a
    later region (torch keeps that one, so that consecutive regions do not recompute each
    other)."""
    if node.meta.get("recompute") not in _RECOMPUTED:
        return False
    region = node.meta.get("ac_graph_id")
    return not any(
        u.meta.get("recompute") in _RECOMPUTED
        and region is not None
        and u.meta.get("ac_graph_id", region) > region
        for u in node.users
    )


def _frontier(needed: Iterable[Node], recomputed: set[Node]) -> set[Node]:
    """What is kept when the backward needs `needed` and `recomputed` is recomputed."""
    kept, seen, stack = set(), set(), list(needed)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in recomputed:
            stack.extend(node.all_input_nodes)
        else:
            kept.add(node)
    return kept
