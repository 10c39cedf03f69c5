"""The linear layer before a loss (an LM head, an output projection, a tied embedding): found
under the logits, and whether it may join a cross-entropy in `seqfast::linear_cross_entropy`, or
why the logits are built.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import RESHAPES, arg, is_barrier, is_call, rank_of, tensor_val
from seqcompile.patterns.loss.read import NONE, Loss, read_loss
from seqcompile.patterns.pointwise_ops import element_wise

aten = torch.ops.aten
_TRANSPOSES = (aten.t.default, aten.numpy_T.default)
_AUTOCAST_SWITCHES = (
    torch.amp.autocast_mode._enter_autocast,
    torch.amp.autocast_mode._exit_autocast,
)


@dataclasses.dataclass
class Linear:
    node: Node
    hidden: Node
    weight: Node
    bias: Node | None
    views: list[Node]
    """Reshapes from the linear's output to the (rows, classes) logits."""


def read_linear(logits: Node) -> Linear | None:
    """The linear that produced `logits` through reshapes that keep the rows in order."""
    views, node = [], logits
    while is_call(node, *RESHAPES):
        views.append(node)
        node = node.args[0]
    linear = linear_at(node)
    if linear is None or tensor_val(node).shape[-1] != tensor_val(logits).shape[-1]:
        return None
    return dataclasses.replace(linear, views=views)


def linear_at(node: Node) -> Linear | None:
    """`node` read as a linear layer: `aten.linear` or `x @ W.t()`, W of rank 2."""
    if is_call(node, aten.linear.default):
        hidden, weight, bias = node.args[0], node.args[1], arg(node, 2, "bias")
    elif is_call(node, aten.matmul.default) and is_call(node.args[1], *_TRANSPOSES):
        hidden, weight, bias = node.args[0], node.args[1].args[0], None
    else:
        return None
    if rank_of(weight) != 2:
        return None
    return Linear(node, hidden, weight, bias, [])


def linear_up(logits: Node) -> tuple[Node, str] | None:
    """A linear that computes `logits` through other ops (a scale, a soft cap), found a few
    element-wise ops up, and why they are built whole: what lies between."""
    node, between = logits, []
    for _ in range(8):
        operands = [a for a in node.all_input_nodes if _same_elements(a, logits)]
        if node.op != "call_function" or len(operands) != 1:
            return None
        if not (is_call(node, *RESHAPES) or element_wise(node.target)):
            return None
        between.append(str(node.target).removeprefix("aten."))
        node = operands[0]
        linear = read_linear(node)
        if linear is not None:
            ops = ", ".join(reversed(between))
            return linear.node, (
                f"the logits come from a linear through {ops}, which the fused linear +"
                " cross-entropy does not compute, so they are built"
            )
    return None


def _same_elements(a: Node, b: Node) -> bool:
    x, y = tensor_val(a), tensor_val(b)
    return x is not None and y is not None and statically_known_true(x.numel() == y.numel())


def why_logits_stay(loss: Loss, linear: Linear) -> str | None:
    """Why the linear feeding the loss cannot join it (None when it can)."""
    chain = {loss.node, *loss.absorbed, *linear.views}
    readers = [u for n in (linear.node, *linear.views) for u in n.users if u not in chain]
    if readers:
        names = ", ".join(sorted(r.name for r in readers))
        return f"the logits are read elsewhere ({names}), so they are built"
    if loss.reduction == NONE:
        return "reduction 'none' needs per-token gradients, so the logits are built"
    if loss.soft:
        return "it takes class indices; against probability targets the logits are built"
    if loss.weight is not None:
        return "it weighs no class; with class weights the logits are built"
    if not only_autocast_between(linear.node, loss.node):
        return "grad mode or an in-place op changes between the linear and the loss"
    return None


def only_autocast_between(first: Node, last: Node) -> bool:
    """No barrier but autocast switches lies between: the fused op names its compute dtype, so
    it may move out of an autocast region, not across a grad-mode change or a mutation."""
    node = first.next
    while node is not last:
        if is_barrier(node) and node.target not in _AUTOCAST_SWITCHES:
            return False
        node = node.next
    return True


def joins_linear(node: Node) -> bool:
    """Whether `node` is a cross-entropy this family fuses with the linear before it
    (`seqfast::linear_cross_entropy`)."""
    loss = read_loss(node)
    if not isinstance(loss, Loss) or loss.order is not None:
        return False
    linear = read_linear(loss.logits)
    return linear is not None and why_logits_stay(loss, linear) is None
