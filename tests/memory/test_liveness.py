"""The memory model of a step, computed from the partitioned graphs before anything runs, against
what the step really does: the bytes autograd's saved-tensor hooks see kept for the backward (three
models), and the peak the profiler measures (on a graph whose ops all run eagerly, with no
reference implementation's temporaries)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import Action

from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.memory.saved import saved_bytes
from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # each test compiles a model and counts what autograd saves


def predicted_saved_bytes(report):
    return sum(p.step.kept_bytes + p.step.kept_input_bytes for p in report.memory)


def gpt():
    cfg = GPTConfig(vocab=256, max_len=64, d_model=32, n_heads=2, n_layers=2, dropout=0.1)
    model = GPT(cfg)
    idx, targets = toy_batch(cfg, 2, 64, torch.device("cpu"), torch.Generator().manual_seed(0))
    return model, lambda m: m(idx, targets)


def post_ln_encoder_decoder():
    model = nn.Transformer(
        d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
        dropout=0.1, batch_first=True,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    src, tgt = torch.randn(2, 12, 32, generator=g), torch.randn(2, 10, 32, generator=g)
    mask = nn.Transformer.generate_square_subsequent_mask(10)
    return model, lambda m: m(src, tgt, tgt_mask=mask, tgt_is_causal=True).square().mean()


def hugging_face_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=101, n_positions=32, n_embd=32, n_layer=2, n_head=2,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(101, (2, 16), generator=g)
    return transformers.GPT2LMHeadModel(
        config
    ), lambda m: m(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.parametrize("make", [gpt, post_ln_encoder_decoder, hugging_face_gpt2])
def test_kept_for_backward_is_within_ten_percent_of_what_autograd_saves(make):
    torch.manual_seed(0)
    model, run = make()
    model.train()
    compiled = torch.compile(model, backend="seqfast")
    with collecting() as report:
        run(compiled).backward()
    predicted = predicted_saved_bytes(report)
    measured = saved_bytes(lambda: run(compiled), model.parameters())
    assert predicted > 0
    assert abs(predicted - measured) <= 0.1 * measured, (predicted, measured)


def measured_peak(step):
    """The most bytes allocated at once during `step()` beyond what existed before it."""
    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        step()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        peak = max(peak, live)
    return peak


def test_the_peak_of_a_matmul_chain_is_what_the_profiler_measures():
    g = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(a, b, generator=g).requires_grad_()
        for a, b in ((64, 256), (256, 256), (256, 32))
    ]

    def chain(x):
        for w in weights:
            x = x @ w
        return F.softplus(x).sum()

    x = torch.randn(128, 64, generator=g)
    compiled = torch.compile(chain, backend="seqfast", options={"rest": "eager"})
    with collecting() as report:
        compiled(x).backward()
    for w in weights:
        w.grad = None
    (plan,) = report.memory
    measured = measured_peak(lambda: compiled(x).backward())
    assert abs(plan.step.peak_bytes - measured) <= 0.01 * measured, (plan.step.peak_bytes, measured)
    assert plan.step.gradient_bytes == sum(w.numel() * 4 for w in weights)
    assert len(plan.step.timeline.values) > plan.step.timeline.forward_steps > 0
