"""Sharding rule of `seqfast::soft_cross_entropy` and its backward: every tensor holds one
entry per row of the logits, so any row dimension shards."""

from __future__ import annotations

from seqcompile.ops.sharding import rows_everywhere

RULE = rows_everywhere("logits")
