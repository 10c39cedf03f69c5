"""The loss family's last word: a loss it does not fuse still gets a line in the report saying so.

Two kinds of node mark such a loss, once the other patterns have taken what they fuse:
- an ATen loss op other than cross-entropy (`kl_div`, `mse_loss`, `binary_cross_entropy`, the
  margin losses, ...: read from the op's name);
- log-probabilities (`log_softmax`, `logsumexp`, `log` of a `softmax`) that reach the scalar the
  graph returns through row math and sums only (`region.region_to_loss`): a z-loss, an entropy
  term, a divergence written out.
Each is answered with a `Reject` that names what it computes. Where the row-wise loss already
said why the linear before it is not chunked, that line speaks for the site.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from seqcompile.fx.nodes import is_call
from seqcompile.patterns.engine import FuseContext, Reject
from seqcompile.patterns.loss.linear import linear_at
from seqcompile.patterns.loss.pattern import FAMILY, said_at
from seqcompile.patterns.loss.region import PULLABLE, region_to_loss
from seqcompile.patterns.pointwise_ops import element_wise

aten = torch.ops.aten
_LOG_PROBABILITIES = (aten.log_softmax.int, aten._log_softmax.default, aten.logsumexp.default)
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
_DIVERGENCES = frozenset(["kl_div", "binary_cross_entropy", "binary_cross_entropy_with_logits"])
_UNFUSED = (
    "the loss kernels compute cross-entropy (after a linear, any row-wise loss joins it in"
    " chunks); it runs unfused"
)
_UP = 16
"""How many nodes up a walk looks (for the softmax a `log` reads, for the linear whose refusal
speaks for a loss)."""


def _loss_op(node: Node) -> str | None:
    """The name of the ATen loss op `node` calls (None: it calls none, or cross-entropy, which
    the family reads itself)."""
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace != "aten":
        return None
    name = node.target._schema.name.removeprefix("aten::")
    if "backward" in name or name == "cross_entropy_loss":
        return None
    return name if "_loss" in name or name in _DIVERGENCES else None


def _log_probabilities(node: Node) -> bool:
    """Whether `node` computes log-probabilities: a `log_softmax` or `logsumexp`, or a `log` of
    probabilities a `softmax` gave, a few reshapes, gathers or element-wise ops up."""
    if is_call(node, *_LOG_PROBABILITIES):
        return True
    if not is_call(node, aten.log.default):
        return False
    for _ in range(_UP):
        node = node.args[0]
        if not isinstance(node, Node):
            return False
        if is_call(node, *_SOFTMAX):
            return True
        if not (_row_wise(node) and node.args):
            return False
    return False


def _row_wise(node: Node) -> bool:
    """Whether `node` keeps each row of the classes apart (what may lie between the logits of a
    linear, or the probabilities, and a loss)."""
    return is_call(node, *PULLABLE, *_LOG_PROBABILITIES, aten.gather.default) or element_wise(
        node.target
    )


def _said_above(node: Node, ctx: FuseContext) -> bool:
    """Whether the report already says why a linear `node` reads, a few element-wise ops up, is
    not chunked with its loss."""
    seen, frontier = set(), [node]
    while frontier and len(seen) < _UP:
        current = frontier.pop()
        for operand in current.all_input_nodes:
            if operand in seen or operand.op != "call_function":
                continue
            seen.add(operand)
            if linear_at(operand) is not None:
                if said_at(ctx, operand):
                    return True
            elif _row_wise(operand):
                frontier.append(operand)
    return False


def _op_name(node: Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else str(node.target)


class LossLikePattern:
    family = FAMILY

    def find(self, node: Node, ctx: FuseContext) -> Reject | None:
        op = _loss_op(node)
        if op is not None:
            reason = Reject("{} is not read as a loss: {}", op, _UNFUSED)
        elif _log_probabilities(node):
            found = region_to_loss(node)
            if found is None or any(_loss_op(n) is not None for n in found[0]):
                return None  # more of the model, or a loss op that speaks for itself
            ops = ", ".join(sorted({_op_name(n) for n in found[0]}))
            reason = Reject(
                "a sum over the log-probabilities of {} reaches the loss but is no"
                " cross-entropy (it computes {}): {}",
                _op_name(node),
                ops,
                _UNFUSED,
            )
        else:
            return None
        return None if _said_above(node, ctx) else reason
