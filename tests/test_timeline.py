"""`seqcompile.memory_timeline`: eager's live bytes measured op by op (what the forward leaves is
what autograd saves, the backward ends with the gradients), seqfast's planned schedule read from
the memory model and composed across graphs, the picture, and the refusals."""

import dataclasses
import sys

import pytest
import torch
from checks import TINY_GPT, kept_for_backward, tiny_gpt_batch

import seqcompile
from seqcompile.demo import GPT
from seqcompile.memory.liveness import Timeline, combined_peak, combined_timeline
from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # each test compiles and runs a model

CONFIG = TINY_GPT


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(CONFIG)


def gradient_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_eagers_timeline_keeps_what_autograd_saves_and_ends_with_the_gradients(model):
    timelines = seqcompile.memory_timeline(model, tiny_gpt_batch(), budgets=())
    eager = timelines.eager
    saved = kept_for_backward(model, *tiny_gpt_batch())
    # the forward leaves what autograd saved, plus the loss and a few small values
    assert saved <= eager.after_forward <= 1.1 * saved
    assert eager.after_backward == gradient_bytes(model)
    assert eager.peak >= eager.after_forward
    assert 0 < eager.forward_steps < len(eager.values)


def test_the_planned_timeline_is_the_memory_models(model):
    timelines = seqcompile.memory_timeline(model, tiny_gpt_batch(), budgets=(1.0, 0.25))
    torch._dynamo.reset()
    with collecting() as report:
        torch.compile(model, backend="seqfast", dynamic=False)(*tiny_gpt_batch())
    (plan,) = report.memory
    full, quarter = timelines.planned[1.0], timelines.planned[0.25]
    assert full == plan.step.timeline
    assert full.after_forward >= plan.step.kept_bytes
    assert quarter.after_forward < 0.5 * full.after_forward
    assert full.peak < timelines.eager.peak
    assert full.after_backward == quarter.after_backward >= gradient_bytes(model)


def test_graphs_compose_forwards_in_order_and_backwards_in_reverse(model):
    small, large = (
        seqcompile.memory_timeline(model, tiny_gpt_batch(size), budgets=(1.0,)).planned[1.0]
        for size in (1, 3)
    )
    steps = [_Step(small, peak_bytes=small.peak + 7), _Step(large, peak_bytes=large.peak + 5)]
    both = combined_timeline(steps)
    n, m = small.forward_steps, large.forward_steps
    assert both.forward_steps == n + m
    forward_small, backward_small = small.values[:n], small.values[n:]
    forward_large, backward_large = large.values[:m], large.values[m:]
    expected = (
        forward_small
        + tuple(small.after_forward + v for v in forward_large)
        # the second graph's backward runs first, over the first graph's kept values; the first
        # graph's backward then runs with the second's gradients held
        + tuple(small.after_forward + v for v in backward_large)
        + tuple(large.after_backward + v for v in backward_small)
    )
    assert both.values == expected
    assert combined_peak(steps) == max(
        small.peak + 7 + large.after_backward, large.peak + 5 + small.after_forward
    )


@dataclasses.dataclass
class _Step:
    """The two fields of StepMemory the composition reads."""

    timeline: Timeline
    peak_bytes: int


def test_the_models_gradients_are_left_as_they_were(model):
    grads = [torch.full_like(p, 3.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    seqcompile.memory_timeline(model, tiny_gpt_batch(), budgets=())
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))


class Logits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = GPT(CONFIG)

    def forward(self, idx):
        return self.gpt(idx), idx


def test_an_output_that_is_no_loss_needs_a_loss_fn():
    model = Logits()
    idx, _ = tiny_gpt_batch()
    with pytest.raises(ValueError, match="pass loss_fn"):
        seqcompile.memory_timeline(model, (idx,), budgets=())
    timelines = seqcompile.memory_timeline(
        model, (idx,), budgets=(), loss_fn=lambda out: out[0].float().mean()
    )
    assert timelines.eager.after_backward == gradient_bytes(model)


def test_the_picture_is_a_png(model, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    seqcompile.memory_timeline(model, tiny_gpt_batch(), path=path, budgets=(1.0, 0.5))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drawing_without_matplotlib_says_what_to_install(model, tmp_path, monkeypatch):
    timelines = seqcompile.memory_timeline(model, tiny_gpt_batch(), budgets=())
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        timelines.draw(tmp_path / "timeline.png")
