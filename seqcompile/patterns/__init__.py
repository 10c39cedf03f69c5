"""Stage 3, fuse: pattern families that replace sub-graphs with fused `seqfast` operators."""

from __future__ import annotations

from seqcompile.patterns.attention import AttentionPattern
from seqcompile.patterns.engine import Pattern
from seqcompile.patterns.loss import LossPattern
from seqcompile.patterns.norm import NormPattern

FAMILIES = ("attention", "norm", "loss", "pointwise")
"""Report keys of the built-in families; user patterns may not take these names."""


def builtin_patterns() -> list[Pattern]:
    return [AttentionPattern(), NormPattern(), LossPattern()]
