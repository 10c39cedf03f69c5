"""A candidate of math written out: a value read as the op it may compute (`written_out`
decides by evaluating it), and what the readers share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from seqcompile.fx.nodes import (
    arg,
)
from seqcompile.normalize.context import RuleContext

aten = torch.ops.aten
MAX_DEPTH = 8
"""How many ops a value computed from x alone (the max a softmax subtracts) may take."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """`out` read as `op` of `operands` (x first; then a weight and a bias where it has them)."""

    op: str
    out: Node
    operands: tuple[Node, ...]
    reduced: tuple[int, ...]
    """The dims of x the op reduces over, kept whole when it is evaluated on a few rows."""
    compute: Callable[..., torch.Tensor]
    """The op on concrete operands."""
    build: Callable[[RuleContext], Node]
    """The op's call, inserted where the rule context inserts."""
    text: str
    """What the report says `out` was read as."""


def from_only(value: Any, x: Node, depth: int = MAX_DEPTH) -> bool:
    """Whether `value` is a node computed from `x` alone (constants aside), in a few ops."""
    if value is x:
        return True
    if not isinstance(value, Node) or value.op != "call_function" or depth == 0:
        return False
    inputs = value.all_input_nodes
    return bool(inputs) and all(from_only(i, x, depth - 1) for i in inputs)


def one_dim(node: Node, rank: int | None) -> int | None:
    dims = arg(node, 1, "dim")
    if rank is None or rank == 0:
        return None
    if isinstance(dims, int):
        return dims % rank
    if isinstance(dims, list | tuple) and len(dims) == 1 and isinstance(dims[0], int):
        return dims[0] % rank
    return None
