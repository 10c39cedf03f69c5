"""A residual + norm's output is made again in the backward from the sum its backward keeps, not
kept beside it: the step keeps one activation per norm instead of two, and its loss and gradients
stay those of the step that keeps both."""

import copy

import pytest
import torch
import torch.nn.functional as F
from checks import kept_for_backward
from torch import nn

from seqcompile.report import collecting

WIDTH, BATCH, LENGTH = 16, 2, 8


class PreNorm(nn.Module):
    """A branch added to the residual stream, normalized, and read by a linear: the linear keeps
    the norm's output for its weight gradient. (A head after it joins the loss.)"""

    def __init__(self, rms: bool, p: float):
        super().__init__()
        self.branch, self.fc = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3 * WIDTH)
        self.norm = nn.RMSNorm(WIDTH) if rms else nn.LayerNorm(WIDTH)
        self.head = nn.Linear(3 * WIDTH, 5)
        self.p = p

    def forward(self, x):
        h = x + F.dropout(self.branch(x), self.p, self.training)
        return self.head(torch.tanh(self.fc(self.norm(h)))).square().mean()


def step(model, x, **options):
    """Loss, gradients and the bytes kept for the backward of one compiled step, seeded."""
    torch._dynamo.reset()
    model.zero_grad()
    compiled = torch.compile(model, backend="seqfast", options=options)
    with collecting() as report:
        compiled(x).backward()  # compile outside the hooks: tracing saves too
    model.zero_grad()
    torch.manual_seed(1)
    loss = compiled(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, kept_for_backward(compiled, x), report


@pytest.mark.kernels("add_norm_fwd", "add_norm_bwd")
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize(
    "p", [0.0, pytest.param(0.1, marks=pytest.mark.slow)], ids=["p0", "dropout"]
)  # dropout under the interpreter takes 18 s a case
def test_the_norm_output_is_made_again_from_the_kept_sum(rms, p, impl):
    torch.manual_seed(0)
    model = PreNorm(rms, p).train()
    x = torch.randn(BATCH, LENGTH, WIDTH)
    loss, grads, kept, report = step(model, x)
    assert report.counts["norm"] == 1, str(report)
    plan = report.memory[0].budget
    assert plan.cheap_only and plan.cost.flops == 0
    assert any(name.startswith("add_norm") for name in plan.recomputed), plan.recomputed
    kept_loss, kept_grads, kept_both, _ = step(model, x, checkpoint="none")
    assert kept_both - kept == BATCH * LENGTH * WIDTH * 4  # the norm's float32 output
    torch.testing.assert_close(loss, kept_loss, rtol=0, atol=0)
    for g, expected in zip(grads, kept_grads, strict=True):
        torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-7)
    if p == 0:
        eager = copy.deepcopy(model)
        eager.zero_grad()
        eager(x).backward()
        torch.testing.assert_close(loss, eager(x).detach(), rtol=1e-5, atol=1e-6)
        for g, parameter in zip(grads, eager.parameters(), strict=True):
            torch.testing.assert_close(g, parameter.grad, rtol=1e-4, atol=1e-5)


class NormOut(PreNorm):
    """The norm's output is also the model's: it lives after the step anyway."""

    def forward(self, x):
        y = self.norm(x + self.branch(x))
        return (self.fc(y).square().mean(), y)


def test_an_output_the_caller_gets_is_not_made_again(tmp_path):
    torch.manual_seed(0)
    model = NormOut(rms=False, p=0.0).train()
    x = torch.randn(BATCH, LENGTH, WIDTH)
    with collecting() as report:
        compiled = torch.compile(model, backend="seqfast", options={"dump_dir": str(tmp_path)})
        loss, _ = compiled(x)
        loss.backward()
    assert report.counts["norm"] == 1, str(report)
    assert not any(n.startswith("add_norm") for n in report.memory[0].budget.recomputed)
    backward = next(tmp_path.glob("*/*_lower_backward.py")).read_text()
    assert "seqfast.add_norm.default" not in backward
