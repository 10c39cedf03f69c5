"""Stage 3, fuse: pattern families that replace sub-graphs with fused `seqfast` operators."""

from __future__ import annotations

from seqcompile.ops import registry
from seqcompile.patterns.attention import AttentionPattern
from seqcompile.patterns.engine import Pattern
from seqcompile.patterns.loss import LossLikePattern, LossPattern, RowLossPattern
from seqcompile.patterns.norm import NormPattern

FAMILIES = registry.FAMILIES
"""Report keys of the built-in families (those the registry's entries name); user patterns may
not take these names."""


def builtin_patterns() -> list[Pattern]:
    return [AttentionPattern(), NormPattern(), RowLossPattern(), LossPattern(), LossLikePattern()]
