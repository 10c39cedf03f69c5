"""Stage 3, fuse: pattern families that replace sub-graphs with fused `seqfast` operators."""

from __future__ import annotations

from seqcompile.patterns.engine import Pattern
from seqcompile.patterns.norm import NormPattern

FAMILIES = ("norm",)
"""Report keys of the built-in families; user patterns may not take these names."""


def builtin_patterns() -> list[Pattern]:
    return [NormPattern()]
