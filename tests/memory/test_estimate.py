"""The memory estimate of what the forward keeps for the backward."""

import torch
import torch.nn as nn

from seqcompile.report import collecting


class PostLN(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x, h):
        return self.norm(x + self.lin(h))


def test_fused_op_keeps_its_sum_and_row_statistics():
    rows, d = 12, 16
    x, h = torch.randn(rows, d, requires_grad=True), torch.randn(rows, d, requires_grad=True)
    with collecting() as report:
        torch.compile(PostLN(d), backend="seqfast")(x, h)
    (plan,) = report.memory
    sum_bytes, stats_bytes = rows * d * 4, 2 * rows * 4
    assert plan.step.kept_fused_bytes == sum_bytes + stats_bytes
    # besides that, only the linear's input is kept: it is a graph input, so not counted
    assert plan.step.kept_bytes == plan.step.kept_fused_bytes
