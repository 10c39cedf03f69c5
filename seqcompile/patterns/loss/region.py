"""The region of a linear: every node computed from its output, when they end in one scalar the
graph returns (the loss), with what computes the values the loss reads only for it (a teacher's
head and its row math), and which values carry a gradient. The row-wise loss chunks the region;
the loss-like pattern reads it to say what an unfused loss computes.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from seqcompile.fx.nodes import RESHAPES, grad_enabled_at, is_call, tensor_val
from seqcompile.patterns.engine import FuseContext
from seqcompile.patterns.loss.linear import linear_at
from seqcompile.patterns.pointwise_ops import element_wise

aten = torch.ops.aten
_MAX_REGION = 256
"""Nodes past which a linear's region is taken for the rest of a model, not a loss."""
PULLABLE = frozenset(
    [*RESHAPES, aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
     aten._log_softmax.default, aten.transpose.int, aten.permute.default, aten.t.default,
     aten.to.dtype, aten._to_copy.default, aten.detach.default, aten.clone.default]
)  # fmt: skip
"""Ops (beyond element-wise ones) pulled into the region with the values the loss reads."""
_NOT_LOSS = frozenset(
    [aten.mm.default, aten.bmm.default, aten.addmm.default, aten.linear.default,
     aten.matmul.default, aten.baddbmm.default, aten.convolution.default,
     aten.scaled_dot_product_attention.default, aten.embedding.default]
)  # fmt: skip
"""Ops that mark a linear's region as more of the model (a loss reads its logits row by row)."""


def region_to_loss(start: Node) -> tuple[list[Node], Node] | None:
    """Every node computed from `start`, in graph order, and the one the graph returns (the loss);
    None where they are not a loss over `start` (too many, a matmul, not one scalar out)."""
    region, frontier = {start}, [start]
    while frontier:
        for user in frontier.pop().users:
            if user in region or user.op == "output":
                continue
            if user.op != "call_function" or is_call(user, *_NOT_LOSS):
                return None
            if len(region) >= _MAX_REGION:
                return None
            region.add(user)
            frontier.append(user)
    sinks = [n for n in region if any(u.op == "output" for u in n.users)]
    if len(sinks) != 1 or sinks[0] is start:
        return None
    out = tensor_val(sinks[0])
    if out is None or not out.is_floating_point() or out.numel() != 1:
        return None
    nodes = [n for n in start.graph.nodes if n in region and n is not start]
    return nodes, sinks[0]


def pulled(nodes: list[Node], start: Node, gradients: Gradients) -> list[Node]:
    """`nodes` with what computes the values they read only for them, up to a linear, and
    carries no gradient: row math on a teacher's logits, and the teacher's head itself, then
    run a chunk at a time too (or, where not row-wise, before the op, as it ran before)."""
    region = {start, *nodes}
    frontier = outside_values(nodes, start)
    while frontier:
        node = frontier.pop()
        if node in region or node.op != "call_function" or node.is_impure():
            continue
        if gradients.carries[node]:
            continue
        if not all(u in region for u in node.users):
            continue
        linear = linear_at(node) is not None
        if not (linear or is_call(node, *PULLABLE) or element_wise(node.target)):
            continue
        region.add(node)
        if not linear:
            frontier.extend(node.all_input_nodes)
        elif is_call(node, aten.matmul.default):
            region.add(node.args[1])  # (the transpose of the weight)
    return [n for n in start.graph.nodes if n in region and n is not start]


def outside_values(nodes: list[Node], start: Node) -> list[Node]:
    """The values the region reads that it does not compute, in order of first reading."""
    inside = {start, *nodes}
    return list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))


class Gradients:
    """Which values of a graph carry a gradient: computed from inputs that require grad, with
    grad mode on and no `detach` on the way (a teacher's head under no_grad, or over detached
    values, carries none). One pass over the graph, in order."""

    def __init__(self, ctx: FuseContext) -> None:
        self.modes: dict[Node, bool] = {}
        self.carries: dict[Node, bool] = {}
        mode = None
        for node in ctx.gm.graph.nodes:
            mode = grad_enabled_at(node) if mode is None else mode
            if is_call(node, torch._C._set_grad_enabled):
                mode = bool(node.args[0])
            self.modes[node] = mode
            if node.op == "placeholder":
                self.carries[node] = ctx.training and node in ctx.grad_inputs
            else:
                self.carries[node] = (
                    mode
                    and not is_call(node, aten.detach.default)
                    and any(self.carries.get(a, False) for a in node.all_input_nodes)
                )

    def needed(self, nodes: list[Node], externals: list[Node]) -> list[Node]:
        """The values the region reads that need a gradient through it: they carry one, and a
        region node reads them with grad mode on."""
        inside = set(nodes)
        return [
            e
            for e in externals
            if self.carries[e] and any(self.modes[u] for u in e.users if u in inside)
        ]
