"""Sharding rules of `seqfast::add_norm` and its backward: rows (any dimension but the last, which
it normalizes) sharded, weights replicated, weight gradients partial sums; nothing that draws
dropout."""

from __future__ import annotations

from collections.abc import Sequence

from seqcompile.ops.fused_op import Call
from seqcompile.ops.sharding import (
    ROWS,
    Partial,
    Shape,
    Shard,
    Strategy,
    is_spec,
    no_dropout,
    placed,
    row_dims,
    shape_of,
    shards,
)


@shards(ROWS)
def forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    no_dropout(call)
    return [
        Strategy([placed(s, Shard(d)) for s in outputs], {"x": Shard(d), "residual": Shard(d)})
        for d in row_dims(call, "x")
    ]


@shards(ROWS)
def backward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """The input gradients sharded as the rows, the weight and bias gradients partial."""
    no_dropout(call)
    rows = ("grad_out", "grad_sum", "saved", "mean", "rstd")
    return [
        Strategy(
            [placed(s, Shard(d) if i < 2 else Partial()) for i, s in enumerate(outputs)],
            {name: placed(shape_of(call[name]), Shard(d)) for name in rows if is_spec(call[name])},
        )
        for d in row_dims(call, "saved")
    ]
