"""Hugging Face causal LMs' attention masks, built from position comparisons (`kv_idx <= q_idx`,
Mistral's `kv_idx > q_idx - sliding_window`) and a padding mask: the kernel computes the causal
triangle and the window from positions and reads only the padding, with either attention
implementation, and a training step matches eager. Gemma 2 adds soft-capped scores and
alternates windowed and global layers; T5's relative-position bias is read per diagonal."""

import dataclasses

import pytest
import torch
from checks import attention_flags, kernel_flags

from models.real_models import (
    CASES,
    GQA,
    LENGTH,
    T5_V1_1,
    TARGET_LENGTH,
    Case,
    causal_lm_batch,
    hf_model,
    own_loss,
    sites,
)
from models.test_real_models import assert_gradients_match, step
from seqcompile.memory.saved import saved_tensors
from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # whole models: the real-model tier

pytest.importorskip("transformers")

WINDOW = 4
"""Shorter than the batch's 10 tokens."""

MODELS = {
    "llama": (hf_model("LlamaForCausalLM", "LlamaConfig", **GQA), False),
    "mistral-window": (
        hf_model("MistralForCausalLM", "MistralConfig", sliding_window=WINDOW, **GQA),
        True,
    ),
}


@pytest.mark.parametrize("implementation", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
@pytest.mark.parametrize("model", MODELS)
def test_the_kernel_computes_causal_and_window_and_reads_the_padding(model, implementation):
    build, windowed = MODELS[model]
    case = Case(model, build, causal_lm_batch, own_loss, sites(2, 5, 1), 2, (implementation,))
    eager, expected, _ = step(case, implementation, compiled=False)
    fast, loss, report = step(case, implementation, compiled=True)
    keys = [attention_flags(k.spec) for k in report.kernels if k.spec.template == "attention_fwd"]
    assert keys and all(
        key == kernel_flags(mask=True, blocks=True, causal=True, window=windowed) for key in keys
    ), keys
    torch.testing.assert_close(loss, expected)
    assert_gradients_match(fast, eager)
    assert not score_sized_saves(case, implementation)


def score_sized_saves(
    case: Case, implementation: str, scores: tuple[tuple[int, int], ...] = ((LENGTH, LENGTH),)
) -> list[torch.Size]:
    """Shapes of what a compiled training step keeps for its backward whose last two dims are
    those of some attention's `scores` (a mask or bias built at that size)."""
    torch.manual_seed(0)
    model = case.build(implementation).train()
    compiled, batch = torch.compile(model, backend="seqfast"), case.batch()
    tensors = [t for t in batch.values() if isinstance(t, torch.Tensor)]
    lasting = [*model.parameters(), *model.buffers(), *tensors]
    saved = saved_tensors(lambda: case.loss(compiled(**batch)), lasting)
    return [t.shape for t in saved.values() if t.dim() >= 2 and tuple(t.shape[-2:]) in scores]


def test_the_window_changes_the_answer():
    """The window is shorter than the sequence, so a model that ignored it would differ."""
    build, _ = MODELS["mistral-window"]
    torch.manual_seed(0)
    windowed = build("sdpa")
    torch.manual_seed(0)
    wide = hf_model("MistralForCausalLM", "MistralConfig", sliding_window=None, **GQA)("sdpa")
    batch = causal_lm_batch()
    with torch.no_grad(), collecting():
        assert not torch.allclose(own_loss(windowed(**batch)), own_loss(wide(**batch)))


def test_gemma2_caps_its_scores_and_windows_every_other_layer():
    build = hf_model(
        "Gemma2ForCausalLM", "Gemma2Config", head_dim=8, attn_logit_softcapping=50.0,
        final_logit_softcapping=None, sliding_window=WINDOW, query_pre_attn_scalar=8, **GQA,
    )  # fmt: skip
    case = Case("gemma2", build, causal_lm_batch, own_loss, sites(2, 9, 1), 2, ("eager",))
    eager, expected, _ = step(case, "eager", compiled=False)
    fast, loss, report = step(case, "eager", compiled=True)
    keys = [attention_flags(k.spec) for k in report.kernels if k.spec.template == "attention_fwd"]
    common = dict(mask=True, blocks=True, causal=True, score_mod=True)
    assert keys == [kernel_flags(**common, window=True), kernel_flags(**common)], keys
    assert report.counts["attention"] == 2
    assert all("attention" not in m.pattern for m in report.missed), report
    torch.testing.assert_close(loss, expected)
    assert_gradients_match(fast, eager)
    assert not score_sized_saves(case, "eager")


def test_a_packed_batch_compares_document_ids_in_the_kernel():
    """Three documents packed in one row (position ids restart), one in the other: Hugging Face
    derives document ids from the position ids, and the kernel compares them; its causal test of
    the position ids is, within a document, the causal triangle, which the kernel computes."""
    build, _ = MODELS["llama"]
    ids = causal_lm_batch()["input_ids"]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], list(range(10))])

    def packed():
        return dict(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)

    case = Case("llama-packed", build, packed, own_loss, sites(2, 5, 1), 2, ("sdpa",))
    eager, expected, _ = step(case, "sdpa", compiled=False)
    fast, loss, report = step(case, "sdpa", compiled=True)
    keys = [attention_flags(k.spec) for k in report.kernels if k.spec.template == "attention_fwd"]
    assert keys and all(key == kernel_flags(causal=True, documents=True) for key in keys), keys
    torch.testing.assert_close(loss, expected)
    assert_gradients_match(fast, eager)
    assert not score_sized_saves(case, "sdpa")


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_t5_reads_its_relative_position_bias_per_diagonal(implementation):
    """The bucketed table's value per key - query diagonal, for every self-attention (its
    gradient reaching the table, checked against eager); padding (B, 1, 1, Lk) and the decoder's
    causal triangle as elsewhere; the cross-attention's zero position bias is not read."""
    (t5,) = [c for c in CASES if c.name == "t5-v1.1"]
    # heads of 12 dims: no q, k or v shaped like the scores (10 and 8 positions)
    build = hf_model("T5ForConditionalGeneration", "T5Config", **dict(T5_V1_1, d_kv=12))
    case = dataclasses.replace(t5, build=build)
    eager, expected, _ = step(case, implementation, compiled=False)
    fast, loss, report = step(case, implementation, compiled=True)
    keys = [attention_flags(k.spec) for k in report.kernels if k.spec.template == "attention_fwd"]
    assert {frozenset(k.items()) for k in keys} == {
        frozenset(kernel_flags(**flags).items())
        for flags in (
            dict(mask=True, blocks=True, relative=True),  # encoder self-attention
            dict(causal=True, relative=True),  # decoder self-attention
            dict(mask=True, blocks=True),  # cross-attention: the padding mask by its lists
        )
    }, keys
    torch.testing.assert_close(loss, expected)
    assert_gradients_match(fast, eager)
    encoder, decoder = (LENGTH, LENGTH), (TARGET_LENGTH, TARGET_LENGTH)
    assert not score_sized_saves(case, implementation, (encoder, decoder, (TARGET_LENGTH, LENGTH)))


@pytest.mark.parametrize("name", ["bloom", "mpt", "falcon-alibi"])
def test_alibi_models_read_their_slopes_per_key(name):
    """BLOOM, MPT and Falcon add ALiBi as slopes times key positions: the kernel reads it as one
    value per key and head, and the padding per key by its block lists, and computes causal."""
    (case,) = [c for c in CASES if c.name == name]
    eager, expected, _ = step(case, "eager", compiled=False)
    fast, loss, report = step(case, "eager", compiled=True)
    assert len(report.sites) == case.sites["attention"], report.sites
    for line in report.sites:
        what = line.split(": ", 2)[2]
        assert what.startswith("causal, reads a mask (2, 1, 1, 10) by block lists"), line
        assert ", reads a bias (" in what, line
        assert f", {LENGTH}, {LENGTH})" not in what, line
    torch.testing.assert_close(loss, expected)
    assert_gradients_match(fast, eager)
    assert not score_sized_saves(case, "eager")
