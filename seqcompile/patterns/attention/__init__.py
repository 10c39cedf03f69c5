"""The attention family: scaled_dot_product_attention and attention written out with matmul and
softmax, read into typed readings, checked against the model's code and fused into one op."""

from __future__ import annotations

from seqcompile.patterns.attention.pattern import AttentionPattern

__all__ = ["AttentionPattern"]
