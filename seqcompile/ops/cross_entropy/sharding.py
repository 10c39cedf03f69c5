"""Sharding rule of `seqfast::cross_entropy`, its backward and in-place twin: every tensor holds one
entry per row of the logits, so any row dimension shards."""

from __future__ import annotations

from seqcompile.ops.sharding import rows_everywhere

RULE = rows_everywhere("logits")
