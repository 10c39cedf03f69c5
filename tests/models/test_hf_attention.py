"""Hugging Face BERT, GPT-2, T5 and BART, small and randomly initialized, with both attention
implementations ("eager" and "sdpa"): every attention site fuses, and a training step's loss and
every parameter gradient match eager (dropout off, padding in the batch)."""

import copy

import pytest
import torch

from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # whole models: the real-model tier

transformers = pytest.importorskip("transformers")

B, L, LD, VOCAB = 2, 8, 6, 100


def bert():
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64,
        attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM, config, 2, False


def gpt2():
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel, config, 2, False


def t5():
    config = transformers.T5Config(
        d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        vocab_size=VOCAB, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration, config, 6, True


def bart():
    config = transformers.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration, config, 6, True


def batch(encoder_decoder: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, 5:] = 0
    inputs = dict(
        input_ids=ids, attention_mask=mask, labels=torch.randint(3, VOCAB, (B, L), generator=g)
    )
    if encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (B, LD), generator=g)
        inputs["labels"] = torch.randint(3, VOCAB, (B, LD), generator=g)
    return inputs


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("model", [bert, gpt2, t5, bart])
def test_every_attention_site_fuses_and_the_step_matches_eager(model, implementation):
    cls, config, sites, encoder_decoder = model()
    config._attn_implementation = implementation
    torch.manual_seed(0)
    eager = cls(config).train()
    fast = copy.deepcopy(eager)
    inputs = batch(encoder_decoder)

    eager(**inputs, use_cache=False).loss.backward()
    with collecting() as report:
        loss = torch.compile(fast, backend="seqfast")(**inputs, use_cache=False).loss
    loss.backward()

    attention_missed = [m for m in report.missed if m.pattern == "attention"]
    assert report.counts["attention"] == sites and not attention_missed, str(report)
    torch.testing.assert_close(loss, eager(**inputs, use_cache=False).loss, atol=1e-5, rtol=1e-5)
    for (name, p_fast), p_eager in zip(fast.named_parameters(), eager.parameters(), strict=True):
        if p_eager.grad is None:
            assert p_fast.grad is None, name
        else:
            torch.testing.assert_close(p_fast.grad, p_eager.grad, atol=2e-5, rtol=1e-4, msg=name)
