"""The loss family: a cross-entropy fused into `seqfast::cross_entropy` (with the linear before it,
`seqfast::linear_cross_entropy`), any loss read row by row over a linear's logits chunked into
`seqfast::linear_row_loss`, and a line in the report for each loss left unfused."""

from __future__ import annotations

from seqcompile.patterns.loss.loss_like import LossLikePattern
from seqcompile.patterns.loss.pattern import LossPattern
from seqcompile.patterns.loss.row_loss import RowLossPattern

__all__ = ["LossLikePattern", "LossPattern", "RowLossPattern"]
