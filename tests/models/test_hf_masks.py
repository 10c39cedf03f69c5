"""Hugging Face causal LMs' attention masks, built from position comparisons (`kv_idx <= q_idx`,
Mistral's `kv_idx > q_idx - sliding_window`) and a padding mask: the kernel computes the causal
triangle and the window from positions and reads only the padding, with either attention
implementation, and a training step matches eager. Gemma 2 adds soft-capped scores and
alternates windowed and global layers."""

import pytest
import torch
from checks import kernel_flags, saved_tensors

from models.real_models import GQA, Case, causal_lm_batch, hf_model, own_loss, sites
from models.test_real_models import assert_gradients_match, step
from seqcompile.report import collecting

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
    keys = [dict(k.spec.key) for k in report.kernels if k.spec.template == "attention_fwd"]
    assert keys and all(
        key == kernel_flags(mask=True, causal=True, window=windowed) for key in keys
    ), keys
    torch.testing.assert_close(loss, expected)
    assert_gradients_match(fast, eager)
    assert not score_sized_saves(case, implementation)


def score_sized_saves(case: Case, implementation: str) -> list[torch.Size]:
    """Shapes of what a compiled training step keeps for its backward that are as large as the
    scores' last two dims (a mask or bias built at that size)."""
    torch.manual_seed(0)
    model = case.build(implementation).train()
    compiled, batch = torch.compile(model, backend="seqfast"), case.batch()
    tensors = [t for t in batch.values() if isinstance(t, torch.Tensor)]
    lasting = [*model.parameters(), *model.buffers(), *tensors]
    saved = saved_tensors(lambda: case.loss(compiled(**batch)), lasting)
    length = batch["input_ids"].shape[-1]
    return [t.shape for t in saved.values() if t.dim() >= 2 and t.shape[-2:] == (length, length)]


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
    keys = [dict(k.spec.key) for k in report.kernels if k.spec.template == "attention_fwd"]
    common = dict(mask=True, causal=True, softcap=True)
    assert keys == [kernel_flags(**common, window=True), kernel_flags(**common)], keys
    assert report.counts["attention"] == 2
    assert all("attention" not in m.pattern for m in report.missed), report
    torch.testing.assert_close(loss, expected)
    assert_gradients_match(fast, eager)
    assert not score_sized_saves(case, "eager")


def test_a_packed_batch_compares_document_ids_in_the_kernel():
    """Three documents packed in one row (position ids restart), one in the other: Hugging Face
    derives document ids from the position ids, and the kernel compares them."""
    build, _ = MODELS["llama"]
    ids = causal_lm_batch()["input_ids"]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], list(range(10))])

    def packed():
        return dict(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)

    case = Case("llama-packed", build, packed, own_loss, sites(2, 5, 1), 2, ("sdpa",))
    eager, expected, _ = step(case, "sdpa", compiled=False)
    fast, loss, report = step(case, "sdpa", compiled=True)
    keys = [dict(k.spec.key) for k in report.kernels if k.spec.template == "attention_fwd"]
    assert keys and all(key["documents"] for key in keys), keys
    torch.testing.assert_close(loss, expected)
    assert_gradients_match(fast, eager)
