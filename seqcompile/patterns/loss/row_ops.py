"""What core ATen ops do to the rows of a loss's logits, for the row-wise reading
(`row_split.py`): which ops reshape, reduce or normalize a row value; `Layout`, where a value's
rows lie; and `NotRowWise`, the refusal that names the op that stops the reading.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

aten = torch.ops.aten
Tensor = torch.Tensor

VIEWS = frozenset(
    [aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dims,
     aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default, aten.expand.default]
)  # fmt: skip
"""Ops that give a row value another shape over the same rows (an expand only of its trailing
dimensions, checked by the sizes)."""
REDUCTIONS = {
    aten.sum.dim_IntList: 1, aten.amax.default: 1, aten.amin.default: 1, aten.mean.dim: 1,
    aten.any.dims: 1, aten.prod.dim_int: 1, aten.any.dim: 1, aten.argmax.default: 1,
    aten.argmin.default: 1, aten.logsumexp.default: 1, aten._log_softmax.default: 1,
    aten._softmax.default: 1, aten.sum.default: None, aten.mean.default: None,
}  # fmt: skip
"""Reductions (and the row-wise normalizations) with the index of their dims argument (None:
over every element)."""
IDENTITIES = frozenset([aten.clone.default, aten.alias.default, aten.detach.default])
NORMALIZATIONS = frozenset([aten._log_softmax.default, aten._softmax.default])
"""Row-wise ops over a dimension that keep it."""
MATMULS = frozenset([aten.mm.default, aten.addmm.default])
PERMUTES = frozenset([aten.permute.default, aten.transpose.int])
SUMS = frozenset([aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default])
MEANS = frozenset([aten.mean.dim, aten.mean.default])


class NotRowWise(Exception):
    """The loss is not row-wise math plus an affine function of row sums; says which op."""


def value_of(node: Node) -> Tensor:
    """The tensor `node` computes; NotRowWise where it computes something else (the list of a
    `split`, the tuple of a `max.dim`), which no row value is."""
    value = node.meta.get("val")
    if not isinstance(value, Tensor):
        kind = f"{len(value)} values" if isinstance(value, list | tuple) else type(value).__name__
        raise NotRowWise(
            f"{node.target} gives {kind}, not one tensor; the chunked loss reads ops of one"
            " output (a loss written over the whole logits is chunked by seqfast itself)"
        )
    return value


def shape_of(node: Node) -> tuple[int, ...]:
    return tuple(value_of(node).shape)


def row_prefix(shape: tuple[int, ...], rows: int) -> int | None:
    """The fewest leading dimensions (at least one where there are any) whose sizes multiply to
    `rows`; None where none do."""
    product = 1
    for q, size in enumerate(shape):
        product *= size
        if product == rows:
            return q + 1
        if product > rows:
            return None
    return 0 if rows == 1 else None


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a row value's rows lie: `rows`, its dimensions that index the rows, in the order
    that numbers them (the logits' own order); the chunk holds the value as `(c, *others)`, the
    other dimensions in their order."""

    rank: int
    rows: tuple[int, ...]

    @property
    def others(self) -> list[int]:
        return [d for d in range(self.rank) if d not in self.rows]

    def in_chunk(self, dim: int) -> int:
        """The chunk's dimension for the value's (other) dimension `dim`."""
        return 1 + self.others.index(dim % self.rank)

    @property
    def leading(self) -> bool:
        return self.rows == tuple(range(len(self.rows)))

    def without(self, dims: list[int]) -> Layout:
        """The layout once the (other, or size-1 row) dimensions `dims` are removed."""
        kept = [d for d in range(self.rank) if d not in dims]
        return Layout(len(kept), tuple(kept.index(r) for r in self.rows if r not in dims))
