"""The loss of Hugging Face models through seqfast: the causal-LM path (fp32 upcast, shifted
labels padded with -100) and the seq2seq path fuse their cross-entropy, and the step matches
eager."""

import copy

import pytest
import torch

from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # whole models: the real-model tier

transformers = pytest.importorskip("transformers")
VOCAB = 101


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config), False


def bart():
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config), True


@pytest.mark.parametrize("make", [gpt2, bart])
def test_the_loss_fuses_and_the_step_matches_eager(make):
    torch.manual_seed(0)
    eager, encoder_decoder = make()
    eager.train()
    fast = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    labels = torch.randint(3, VOCAB, (2, 8), generator=g)
    labels[0, :3] = -100
    inputs = dict(input_ids=ids, labels=labels, use_cache=False)
    if encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (2, 8), generator=g)

    expected = eager(**inputs).loss
    expected.backward()
    with collecting() as report:
        loss = torch.compile(fast, backend="seqfast")(**inputs).loss
    loss.backward()
    assert report.counts["loss"] == 1, str(report)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    for (name, p_fast), p_eager in zip(fast.named_parameters(), eager.parameters(), strict=True):
        if p_eager.grad is not None:
            torch.testing.assert_close(p_fast.grad, p_eager.grad, atol=2e-5, rtol=1e-4, msg=name)


def gemma2():
    """Gemma 2 caps its logits (`final_logit_softcapping`): tanh between the head and the loss."""
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=16,
        final_logit_softcapping=30.0, pad_token_id=0,
    )  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


def cohere():
    """Cohere scales its logits (`logit_scale`) between the head and the loss."""
    config = transformers.CohereConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        logit_scale=0.25, pad_token_id=0,
    )  # fmt: skip
    return transformers.CohereForCausalLM(config)


@pytest.mark.parametrize("make", [gemma2, cohere])
def test_logits_capped_or_scaled_after_the_head_join_it_in_chunks(make):
    """With `fuse_lm_head_loss`, a head whose logits pass through a soft cap or a scale joins the
    loss as the row-wise loss: the step matches eager and builds no logits."""
    from seqcompile.integrations.transformers import fuse_lm_head_loss

    torch.manual_seed(0)
    eager = make().train()
    fast = fuse_lm_head_loss(copy.deepcopy(eager))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 8), generator=g)
    labels = torch.randint(3, VOCAB, (2, 8), generator=g)
    labels[0, :3] = -100
    inputs = dict(input_ids=ids, labels=labels, use_cache=False)
    expected = eager(**inputs).loss
    expected.backward()
    with collecting() as report:
        loss = torch.compile(fast, backend="seqfast")(**inputs).loss
    loss.backward()
    assert any("linear_row_loss" in site for site in report.sites), str(report)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    for (name, p_fast), p_eager in zip(fast.named_parameters(), eager.parameters(), strict=True):
        if p_eager.grad is not None:
            torch.testing.assert_close(p_fast.grad, p_eager.grad, atol=2e-5, rtol=1e-4, msg=name)
