"""Sharding rules of `seqfast::pointwise` and its backward: any dimension of the region's shape, an
input broadcast along it replicated; nothing that draws dropout."""

from __future__ import annotations

from collections.abc import Sequence

from seqcompile.ops.fused_op import Call
from seqcompile.ops.sharding import (
    DROPOUT,
    NoSharding,
    Shape,
    Shard,
    Strategy,
    along,
    shape_of,
    shards,
)

ANY = "any dimension of the region's shape (an input broadcast along it replicated)"


@shards(ANY)
def forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """Any dimension of the region's shape; an input broadcast along it is replicated."""
    if call["seed"] is not None:
        raise NoSharding(DROPOUT)
    return _elementwise(outputs, {"inputs": call["inputs"]})


@shards(ANY)
def backward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """As the forward: every gradient it returns has the region's shape."""
    if call["seed"] is not None:
        raise NoSharding(DROPOUT)
    return _elementwise(outputs, {"saved": call["saved"], "grads": call["grads"]})


def _elementwise(outputs: Sequence[Shape], lists: dict[str, list]) -> list[Strategy]:
    if not outputs:
        return []
    shape = outputs[0]
    return [
        Strategy(
            [Shard(d)] * len(outputs),
            {name: [along(shape_of(t), shape, d) for t in specs] for name, specs in lists.items()},
        )
        for d in range(len(shape))
    ]
