"""Sharding rules of `seqfast::linear_row_loss` and its backward: the forward only replicated (its
program may take any statistic of all the rows), the backward as the forward placed its
gradients."""

from __future__ import annotations

from collections.abc import Sequence

from seqcompile.ops.fused_op import Call
from seqcompile.ops.linear_head import backward_sharding as backward  # noqa: F401
from seqcompile.ops.sharding import (
    NoSharding,
    Shape,
    Strategy,
    shards,
)


@shards("nothing")
def forward(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    raise NoSharding("the loss's program may take any statistic of all the rows")
