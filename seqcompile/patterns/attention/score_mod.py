"""Element-wise modifications of attention scores as models write them between `q @ k^T` and the
biases and masks: `50 * tanh(s / 50)` (Gemma 2, Grok), `s.clamp(-c, c)`, `sigmoid`, any pointwise
op whose other operands are constants. The chain of such ops from the product up to the last one
is run again on a stand-in to register the function (`ops/attention/score_mods.py`), which the
attention kernels compute in place of the chain, with its derivative in the backward.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch.fx import Node

from seqcompile.fx.nodes import tensor_val
from seqcompile.ops.attention import score_mods
from seqcompile.ops.pointwise.region import UnsupportedRegion
from seqcompile.patterns.attention.masks import constant
from seqcompile.patterns.engine import Reject

Tensor = torch.Tensor


def modified_operand(node: Node) -> Node | None:
    """The scores `node` modifies: its one tensor operand, where it is a pointwise op with a
    floating result whose other operands are constants."""
    if node.op != "call_function" or torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return None
    value = tensor_val(node)
    if value is None or not value.is_floating_point():
        return None
    tensors = [a for a in _operands(node) if isinstance(a, Node) and constant(a) is None]
    if len(tensors) != 1 or any(_unknown(a) for a in _operands(node) if a is not tensors[0]):
        return None
    return tensors[0]


def _operands(node: Node) -> list[object]:
    return [*node.args, *node.kwargs.values()]


def _unknown(value: object) -> bool:
    """An operand that is no constant a replay can pass on."""
    if isinstance(value, Node):
        return constant(value) is None
    return isinstance(value, list | tuple) and any(_unknown(v) for v in value)


def register_chain(
    chain: Sequence[Node], scores: Node, after: float, passed: Collection[Node] = ()
) -> str | Reject:
    """The key of `after * chain(x)`, the nodes of `chain` (from the product `scores` up, each
    reading the one before) run on x in place of `scores`; a node of `passed` (a product by a
    tensor q or k takes instead) passes its scores on. A Reject where it cannot be traced or
    printed."""

    def g(x: Tensor) -> Tensor:
        values: dict[Node, Tensor] = {scores: x}
        for node in chain:
            if node in passed:
                values[node] = next(values[a] for a in node.args if a in values)
                continue
            values[node] = node.target(
                *_replayed(node.args, values), **_replayed(node.kwargs, values)
            )
        out = values[chain[-1]]
        return out if after == 1.0 else out * after

    try:
        return score_mods.register(g, describe([n for n in chain if n not in passed], after))
    except UnsupportedRegion as why:
        return Reject("the scores' modification cannot go into the kernel: {}", why)


def _replayed(args: object, values: dict[Node, Tensor]) -> object:
    if isinstance(args, Node):
        if args in values:
            return values[args]
        fake = tensor_val(args)  # a 0-d tensor constant stays a tensor (`torch.max` takes one)
        return constant(args) if fake is None else torch.full((), constant(args), dtype=fake.dtype)
    if isinstance(args, list | tuple):
        return type(args)(_replayed(a, values) for a in args)
    if isinstance(args, dict):
        return {k: _replayed(v, values) for k, v in args.items()}
    return args


def describe(chain: Sequence[Node], after: float) -> str:
    """The modification as a formula of s, the scaled product: `50 * tanh(0.02 * s)`."""
    text = "s"
    for node in chain:
        name = node.target.__name__.split(".")[0]
        rest = [f"{constant(a) if isinstance(a, Node) else a:g}" for a in node.args[1:]
                if isinstance(a, Node | int | float) and not isinstance(a, bool)]  # fmt: skip
        if name in ("to", "_to_copy"):
            continue
        text = f"{name}({', '.join([text, *rest])})"
    return text if after == 1.0 else f"{after:g} * {text}"
