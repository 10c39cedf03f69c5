"""Sharding rules of `seqfast::attention` and its backward: batch or heads sharded (grouped-query
heads where both head counts divide by the mesh), the biases, masks and positions sharded where they
are not broadcast along that dimension; a learned bias's gradient partial where it is. Nothing that
draws dropout is sharded."""

from __future__ import annotations

from collections.abc import Sequence

from seqcompile.ops.fused_op import Call
from seqcompile.ops.sharding import (
    Shape,
    Shard,
    Strategy,
    along,
    is_spec,
    no_dropout,
    shape_of,
    shards,
)

_AUXILIARY = ("bias", "mask", "doc_q", "doc_kv", "rel_bias", "prefix", "sink")
"""Attention's tensors that broadcast against the scores (batch, heads, queries, keys)."""


def _attention_dims(call: Call) -> tuple[Shape, tuple[int, ...]]:
    """The scores' shape and the dimensions of it (batch, heads) a rule may shard: heads only
    where each shard's query heads share its key heads, as both counts divide by the mesh."""
    q, k = shape_of(call["q"]), shape_of(call["k"])
    ranks = call["q"].mesh.size()
    heads = q[1] == k[1] or (q[1] % ranks == 0 and k[1] % ranks == 0)
    return (q[0], q[1], q[2], k[2]), (0, 1) if heads else (0,)


HEADS = "the batch, or the heads where both head counts divide by the mesh's size"


def _attention(call: Call, by_head: tuple[str, ...], placed_outputs) -> list[Strategy]:
    """Along each dimension a rule may shard: the tensors `by_head` sharded, the auxiliary ones
    where they are not broadcast, the outputs as `placed_outputs(scores, dim)` puts them."""
    no_dropout(call)
    scores, dims = _attention_dims(call)
    options = []
    for d in dims:
        inputs = {name: along(shape_of(call[name]), scores, d)
                  for name in _AUXILIARY if is_spec(call[name])}  # fmt: skip
        inputs |= {name: Shard(d) for name in by_head}
        options.append(Strategy(placed_outputs(scores, d), inputs))
    return options


@shards(HEADS)
def forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    return _attention(call, ("q", "k", "v"), lambda scores, d: [Shard(d)] * len(outputs))


@shards(HEADS)
def backward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """q, k, v and the forward's results sharded; a learned bias's gradient sharded where the
    bias is, partial where it broadcasts along the sharded dimension."""

    def grads(scores: Shape, d: int) -> list:
        return [Shard(d)] * 3 + [along(s, scores, d, reduced=True) for s in outputs[3:]]

    by_head = ("grad_out", "q", "k", "v", "out", "row_max", "log_sum")
    return _attention(call, by_head, grads)
