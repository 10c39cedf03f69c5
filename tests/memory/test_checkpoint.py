"""User `torch.utils.checkpoint` regions: captured inline with their nodes tagged, fused inside,
recomputed in the backward (fused operators and seeded dropout included), random values the
same in the recomputation as in the forward."""

import functools

import pytest
import torch
import torch.nn.functional as F
from checks import TINY_GPT
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from seqcompile.demo import GPT, toy_batch
from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # each test compiles a checkpointed model


class CheckpointedGPT(GPT):
    """The demo GPT with each block optionally in a checkpoint."""

    checkpointed = True

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        logits = self.ln_f(x) @ self.tok.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


CONFIG = TINY_GPT


def step(model, rest, checkpointed):
    """Loss, gradients and report of one compiled step, seeded the same way each time."""
    torch._dynamo.reset()
    model.checkpointed = checkpointed
    model.zero_grad()
    idx, targets = toy_batch(CONFIG, 2, 16, torch.device("cpu"), torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    with collecting() as report:
        loss = torch.compile(model, backend="seqfast", options={"rest": rest})(idx, targets)
    loss.backward()
    return loss, [p.grad.clone() for p in model.parameters()], report


def kept(report):
    return sum(plan.step.kept_bytes for plan in report.memory)


@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_checkpointed_blocks_fuse_recompute_and_match_the_plain_step(rest):
    torch.manual_seed(0)
    model = CheckpointedGPT(CONFIG)
    loss, grads, report = step(model, rest, checkpointed=True)
    plain_loss, plain_grads, plain_report = step(model, rest, checkpointed=False)
    assert report.counts == plain_report.counts
    assert report.counts["attention"] == 2 and report.counts["norm"] == 5
    assert kept(report) < 0.5 * kept(plain_report)
    # same seed, same dropout sites: the recomputed masks are the forward's
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    for g, plain in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, plain, rtol=1e-5, atol=1e-6)


def noisy(linear, x):
    h = linear(x)
    return F.gelu(h + torch.rand_like(h)) * h.sigmoid()


@pytest.mark.parametrize("rest", ["eager", "inductor"])
@torch._inductor.config.patch(fallback_random=True)  # else Inductor draws its own numbers
def test_a_random_op_in_a_checkpoint_draws_the_same_numbers_when_recomputed(rest):
    linear = torch.nn.Linear(8, 8)

    def fn(x):
        return checkpoint(noisy, linear, x, use_reentrant=False).sum()

    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(3)
    expected = fn(x)
    (expected_grad,) = torch.autograd.grad(expected, x)
    torch.manual_seed(3)
    actual = torch.compile(fn, backend="seqfast", options={"rest": rest})(x)
    (grad,) = torch.autograd.grad(actual, x)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(grad, expected_grad)


def test_a_selective_policy_is_reported_and_the_region_recomputed_whole():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else None

    linear = torch.nn.Linear(8, 8)
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)

    def fn(x):
        h = checkpoint(
            lambda x: F.gelu(linear(x)).sin(), x, use_reentrant=False, context_fn=context_fn
        )
        return h.sum()

    x = torch.randn(4, 8, requires_grad=True)
    expected = fn(x)
    (expected_grad,) = torch.autograd.grad(expected, x)
    with collecting() as report:
        actual = torch.compile(fn, backend="seqfast")(x)
    (grad,) = torch.autograd.grad(actual, x)
    assert any("context_fn" in m.reason for m in report.missed), report
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(grad, expected_grad)
