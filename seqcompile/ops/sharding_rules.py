"""The fused operators' sharding rules (`FusedOp.sharding`, registered by `ops/sharding.py`): for
each op, the placements along one mesh dimension it computes correctly on each rank's shard.

- `add_norm` and the row losses: rows (any dimension but the last, which they reduce over)
  sharded, weights replicated, weight gradients partial sums.
- `attention`: batch or heads sharded (grouped-query heads where both head counts divide by the
  mesh), the biases, masks and positions sharded where they are not broadcast along that
  dimension; a learned bias's gradient partial where it is.
- `pointwise`: any dimension of the region's shape, inputs broadcast along it replicated.
- `linear_cross_entropy`: rows sharded when it sums (its loss a partial sum); a mean divides by
  the count of every shard's targets, so it only runs replicated, as does `linear_row_loss`,
  whose program may take any statistic of the rows.

Nothing that draws dropout is sharded: each shard would draw the same mask from the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence

from seqcompile.ops.fused_op import Call
from seqcompile.ops.sharding import (
    NoSharding,
    Partial,
    Shape,
    Shard,
    Strategy,
    along,
    is_spec,
    placed,
    shape_of,
    shards,
)

ROWS = "rows (any dimension but the last, which it normalizes)"
LOSS_ROWS = "rows (any dimension but the last, the classes)"
DROPOUT = "it draws dropout: every shard would draw the same mask from the one seed"


def _row_dims(call: Call, name: str) -> range:
    """The dimensions of argument `name` that index rows: all but the last."""
    return range(len(shape_of(call[name])) - 1)


def _no_dropout(call: Call) -> None:
    if call["seed"] is not None and call["p"] > 0:
        raise NoSharding(DROPOUT)


@shards(ROWS)
def norm_forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    _no_dropout(call)
    return [
        Strategy([placed(s, Shard(d)) for s in outputs], {"x": Shard(d), "residual": Shard(d)})
        for d in _row_dims(call, "x")
    ]


@shards(ROWS)
def norm_backward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """The input gradients sharded as the rows, the weight and bias gradients partial."""
    _no_dropout(call)
    rows = ("grad_out", "grad_sum", "saved", "mean", "rstd")
    return [
        Strategy(
            [placed(s, Shard(d) if i < 2 else Partial()) for i, s in enumerate(outputs)],
            {name: placed(shape_of(call[name]), Shard(d)) for name in rows if is_spec(call[name])},
        )
        for d in _row_dims(call, "saved")
    ]


def rows_everywhere(anchor: str):
    """The rule of an op whose every tensor, argument and output, holds one entry per row of
    argument `anchor` (the cross-entropies and their backward ops)."""

    @shards(LOSS_ROWS)
    def rule(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
        tensors = [name for name in call if is_spec(call[name])]
        return [
            Strategy([placed(s, Shard(d)) for s in outputs], {n: Shard(d) for n in tensors})
            for d in _row_dims(call, anchor)
        ]

    return rule


@shards("rows of a sum (any dimension of the hidden states but the last)")
def linear_loss_forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """A sum over rows: the loss and the weight gradients partial, the hidden gradient sharded."""
    if call["mean"]:
        raise NoSharding("its mean divides by the count of every shard's targets")
    return [
        Strategy(
            [Partial(), placed(outputs[1], Shard(d)), *(placed(s, Partial()) for s in outputs[2:])],
            {"hidden": Shard(d), "target": Shard(d)},
        )
        for d in _row_dims(call, "hidden")
    ]


@shards("nothing")
def row_program(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    raise NoSharding("the loss's program may take any statistic of all the rows")


@shards("the forward's gradients as it placed them")
def linear_loss_backward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """The forward's gradients scaled by the loss's (replicated) gradient: placed as they are."""
    if shape_of(call["dhidden"]) == (0,):
        raise NoSharding("it makes no gradient of the hidden states")
    options = []
    for d in _row_dims(call, "dhidden"):
        grads = [Shard(d), placed(shape_of(call["dweight"]), Partial()),
                 placed(shape_of(call["dbias"]), Partial())]  # fmt: skip
        scaled = dict(zip(("dhidden", "dweight", "dbias"), grads, strict=True))
        options.append(Strategy(grads, scaled))
    return options


_AUXILIARY = ("bias", "mask", "doc_q", "doc_kv", "rel_bias", "prefix")
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
    _no_dropout(call)
    scores, dims = _attention_dims(call)
    options = []
    for d in dims:
        inputs = {name: along(shape_of(call[name]), scores, d)
                  for name in _AUXILIARY if is_spec(call[name])}  # fmt: skip
        inputs |= {name: Shard(d) for name in by_head}
        options.append(Strategy(placed_outputs(scores, d), inputs))
    return options


@shards(HEADS)
def attention_forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    return _attention(call, ("q", "k", "v"), lambda scores, d: [Shard(d)] * len(outputs))


@shards(HEADS)
def attention_backward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """q, k, v and the forward's results sharded; a learned bias's gradient sharded where the
    bias is, partial where it broadcasts along the sharded dimension."""

    def grads(scores: Shape, d: int) -> list:
        return [Shard(d)] * 3 + [along(s, scores, d, reduced=True) for s in outputs[3:]]

    by_head = ("grad_out", "q", "k", "v", "out", "row_max", "log_sum")
    return _attention(call, by_head, grads)


ANY = "any dimension of the region's shape (an input broadcast along it replicated)"


@shards(ANY)
def pointwise_forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """Any dimension of the region's shape; an input broadcast along it is replicated."""
    if call["seed"] is not None:
        raise NoSharding(DROPOUT)
    return _elementwise(outputs, {"inputs": call["inputs"]})


@shards(ANY)
def pointwise_backward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
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
