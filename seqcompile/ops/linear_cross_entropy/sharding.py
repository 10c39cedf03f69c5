"""Sharding rules of `seqfast::linear_cross_entropy` and its backward: rows sharded when it sums
(its loss a partial sum); a mean divides by the count of every shard's targets, so it only runs
replicated."""

from __future__ import annotations

from collections.abc import Sequence

from seqcompile.ops.fused_op import Call
from seqcompile.ops.linear_head import backward_sharding as backward  # noqa: F401
from seqcompile.ops.sharding import (
    NoSharding,
    Partial,
    Shape,
    Shard,
    Strategy,
    placed,
    row_dims,
    shards,
)


@shards("rows of a sum (any dimension of the hidden states but the last)")
def forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """A sum over rows: the loss and the weight gradients partial, the hidden gradient sharded."""
    if call["mean"]:
        raise NoSharding("its mean divides by the count of every shard's targets")
    return [
        Strategy(
            [Partial(), placed(outputs[1], Shard(d)), *(placed(s, Partial()) for s in outputs[2:])],
            {"hidden": Shard(d), "target": Shard(d)},
        )
        for d in row_dims(call, "hidden")
    ]
