"""Hugging Face OPT (pre-LN and the 350m's post-LN with its input and output projections) and
DistilBERT, small and randomly initialized: every residual + LayerNorm site the model's code has
fuses with its residual (and the branch's dropout) folded in, and a training step's output and
every parameter gradient match eager (dropout off).

Each model function returns the class, the config, and the counts read from the model's code:
norm sites, those whose residual sum folds in, and those with dropout on the residual branch."""

import copy

import pytest
import torch
from checks import dumped_add_norms

from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # whole models: the real-model tier

transformers = pytest.importorskip("transformers")

B, L, VOCAB, LAYERS = 2, 8, 100, 2


def opt_pre_ln(dropout):
    """OPT-125m's layout: LayerNorm before each block, a final LayerNorm. Residual + norm sites:
    the embedding sum into layer 0's first norm, each block's residual sum into the next norm
    (2 per layer), the last one into the final norm; all but the embedding sum carry dropout."""
    config = transformers.OPTConfig(
        hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, ffn_dim=64,
        vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32, dropout=dropout,
        pad_token_id=1,
    )  # fmt: skip
    return transformers.OPTModel, config, 2 * LAYERS + 1, 2 * LAYERS + 1, 2 * LAYERS


def opt_pre_ln_no_final_norm_no_bias(dropout):
    config = transformers.OPTConfig(
        hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, ffn_dim=64,
        vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32, dropout=dropout,
        enable_bias=False, _remove_final_layer_norm=True, pad_token_id=1,
    )  # fmt: skip
    return transformers.OPTModel, config, 2 * LAYERS, 2 * LAYERS, 2 * LAYERS - 1


def opt_350m_post_ln(dropout):
    """OPT-350m's layout: LayerNorm after each residual sum (2 per layer, all with dropout), no
    final LayerNorm, embeddings projected in and the output projected out."""
    config = transformers.OPTConfig(
        hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, ffn_dim=64,
        vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=16, dropout=dropout,
        do_layer_norm_before=False, pad_token_id=1,
    )  # fmt: skip
    return transformers.OPTForCausalLM, config, 2 * LAYERS, 2 * LAYERS, 2 * LAYERS


def distilbert(dropout):
    """The embedding sum's norm, then post-LN blocks; dropout only on the feed-forward branch.
    The position embeddings, (1, L, D), broadcast over the batch: that sum stays outside."""
    config = transformers.DistilBertConfig(
        dim=32, n_layers=LAYERS, n_heads=2, hidden_dim=64, vocab_size=VOCAB,
        max_position_embeddings=64, dropout=dropout, attention_dropout=dropout,
    )  # fmt: skip
    return transformers.DistilBertModel, config, 2 * LAYERS + 1, 2 * LAYERS, LAYERS


MODELS = [
    # the real-model tier runs OPT's default layout and DistilBERT in the default run already
    pytest.param(opt_pre_ln, marks=pytest.mark.slow),
    opt_pre_ln_no_final_norm_no_bias,
    opt_350m_post_ln,
    pytest.param(distilbert, marks=pytest.mark.slow),
]


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, 5:] = 0
    return dict(input_ids=torch.randint(3, VOCAB, (B, L), generator=g), attention_mask=mask)


def first_output(model, inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def compile_and_run(model, tmp_path):
    with collecting() as report:
        compiled = torch.compile(model, backend="seqfast", options={"dump_dir": tmp_path})
        out = first_output(compiled, batch())
    return out, report


@pytest.mark.parametrize("model", MODELS)
def test_every_residual_norm_site_fuses_and_the_step_matches_eager(model, tmp_path):
    cls, config, sites, residual_sites, _ = model(0.0)
    torch.manual_seed(0)
    eager = cls(config).train()
    fast = copy.deepcopy(eager)
    expected = first_output(eager, batch())
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (expected * weights).sum().backward()

    actual, report = compile_and_run(fast, tmp_path)
    (actual * weights).sum().backward()

    assert report.counts["norm"] == sites and not report.missed, str(report)
    assert (
        sorted(dumped_add_norms(tmp_path))
        == [(False, 0.0)] * (sites - residual_sites) + [(True, 0.0)] * residual_sites
    )
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-5)
    for (name, p_fast), p_eager in zip(fast.named_parameters(), eager.parameters(), strict=True):
        if p_eager.grad is None:
            assert p_fast.grad is None, name
        else:
            torch.testing.assert_close(p_fast.grad, p_eager.grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("model", MODELS)
def test_dropout_on_the_residual_branch_folds_into_the_norm(model, tmp_path):
    cls, config, sites, residual_sites, dropout_sites = model(0.1)
    torch.manual_seed(0)
    out, report = compile_and_run(cls(config).train(), tmp_path)
    out.sum().backward()

    assert report.counts["norm"] == sites and not report.missed, str(report)
    fused = dumped_add_norms(tmp_path)
    assert sum(residual for residual, _ in fused) == residual_sites, fused
    assert sorted(p for _, p in fused) == [0.0] * (sites - dropout_sites) + [0.1] * dropout_sites
