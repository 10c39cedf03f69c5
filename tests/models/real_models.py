"""Tiny, randomly initialized real models for the real-model tier: Hugging Face architectures,
nanoGPT and minGPT written as their authors write them, and `nn.Transformer`; each `Case` names
its batch, its loss and the sites each fused family must find, counted from the model's code."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, LAYERS, HEADS, FFN, VOCAB, POSITIONS = 32, 2, 4, 64, 101, 64
BATCH, LENGTH, TARGET_LENGTH = 2, 10, 8
PADDED = 3
"""Padding at the end of the batch's second row, masked out by the attention mask."""


@dataclasses.dataclass(frozen=True)
class Case:
    """A model under test. `build(implementation)` makes it (call it under a fixed seed),
    `batch()` its keyword inputs and `loss(output)` the scalar a training step differentiates.
    `sites` is the fused count per family (attention, norm, loss) and `activations` the fewest
    pointwise regions it must have: one per activation site."""

    name: str
    build: Callable[[str], nn.Module]
    batch: Callable[[], dict[str, Any]]
    loss: Callable[[Any], torch.Tensor]
    sites: dict[str, int]
    activations: int
    implementations: tuple[str, ...]
    """The attention implementations it has; the first one runs in the default test run."""
    missed: tuple[str, ...] = ()
    """A part of each refusal reason the report must have, and no other refusal."""
    slow: bool = False
    """Whether even its first implementation waits for the slow tier: a model whose code paths
    another case in the default run already takes (the default run has a time budget)."""


def sites(attention: int, norm: int, loss: int) -> dict[str, int]:
    return {"attention": attention, "norm": norm, "loss": loss}


def projected(select: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    """A loss that projects `select(output)` on fixed random weights: every element of the output
    gets its own gradient, unlike a mean after a norm (whose gradient is nearly zero)."""

    def loss(output: Any) -> torch.Tensor:
        out = select(output)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        return (out * weights).sum()

    return loss


LOGITS_RETURNED = ("the logits are read elsewhere",)
"""The refusal of a model that returns its logits beside its loss: the output projection and the
cross-entropy cannot become one op that never builds the logits."""


def own_loss(output: Any) -> torch.Tensor:
    """The model's own cross-entropy (a Hugging Face output's `.loss`)."""
    return output.loss


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens(length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    """Token ids above the special ones (0-2)."""
    return torch.randint(3, VOCAB, (BATCH, length), generator=_generator(seed))


def padding_mask() -> torch.Tensor:
    """1 for tokens, 0 for the padding at the end of the second row."""
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, -PADDED:] = 0
    return mask


def causal_lm_batch() -> dict[str, Any]:
    ids, mask = tokens(), padding_mask()
    return dict(
        input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), use_cache=False
    )


def encoder_batch() -> dict[str, Any]:
    return dict(input_ids=tokens(), attention_mask=padding_mask())


def seq2seq_batch() -> dict[str, Any]:
    return dict(
        input_ids=tokens(),
        attention_mask=padding_mask(),
        decoder_input_ids=tokens(TARGET_LENGTH, seed=1),
        use_cache=False,
    )


def hf_model(model_class: str, config_class: str, **config: Any) -> Callable[[str], nn.Module]:
    def build(implementation: str) -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_class)(**config)
        cfg._attn_implementation = implementation
        return getattr(transformers, model_class)(cfg)

    return build


_DECODER = dict(
    vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, max_position_embeddings=POSITIONS,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
GQA = dict(_DECODER, num_key_value_heads=HEADS // 2)
_BERT = dict(
    vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
    intermediate_size=FFN, max_position_embeddings=POSITIONS,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1,
)  # fmt: skip
_BART = dict(
    vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
    encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
    decoder_ffn_dim=FFN, max_position_embeddings=POSITIONS,
    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
)  # fmt: skip
_WHISPER = dict(
    vocab_size=VOCAB, num_mel_bins=8, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
    encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
    decoder_ffn_dim=FFN, max_source_positions=LENGTH // 2, max_target_positions=POSITIONS,
    dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
    suppress_tokens=None, begin_suppress_tokens=None,
)  # fmt: skip
T5_V1_1 = dict(
    vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=FFN, num_layers=LAYERS,
    num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
    relative_attention_max_distance=16, dropout_rate=0.0, feed_forward_proj="gated-gelu",
    tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
)  # fmt: skip


def whisper_batch() -> dict[str, Any]:
    # the encoder's two convolutions (the second with stride 2) bring LENGTH frames down to the
    # LENGTH // 2 positions it has
    features = torch.randn(BATCH, _WHISPER["num_mel_bins"], LENGTH, generator=_generator())
    return dict(
        input_features=features, decoder_input_ids=tokens(TARGET_LENGTH, seed=1), use_cache=False
    )


def t5_batch() -> dict[str, Any]:
    """The decoder reads the target shifted right and predicts it."""
    target = tokens(TARGET_LENGTH + 1, seed=1)
    return dict(
        seq2seq_batch(),
        decoder_input_ids=target[:, :-1].contiguous(),
        labels=target[:, 1:].contiguous(),
    )


def vit_batch() -> dict[str, Any]:
    return dict(pixel_values=torch.randn(BATCH, 3, 16, 16, generator=_generator()))


BOTH = ("sdpa", "eager")
hidden = projected(lambda out: out.last_hidden_state)

# Counts per family, read from each model's code (L = LAYERS = 2):
# - attention: one site per attention module call: L for decoder-only and encoder-only stacks;
#   3L for encoder-decoders (encoder self, decoder self, decoder cross);
# - norm: every LayerNorm/RMSNorm call, with or without a residual add before it;
# - loss: 1 where the model computes its own cross-entropy;
# - activations: one MLP activation per layer (per feed-forward block in encoder-decoders).
CAUSAL_LM = [
    # pre-norm: input_layernorm and post_attention_layernorm per layer, then the final norm
    Case("llama-gqa", hf_model("LlamaForCausalLM", "LlamaConfig", **GQA),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS, BOTH,
         LOGITS_RETURNED),
    # LLaMA's layers (Qwen2 with biases on q, k and v)
    Case("mistral", hf_model("MistralForCausalLM", "MistralConfig", **GQA),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS, BOTH,
         LOGITS_RETURNED, slow=True),
    Case("qwen2", hf_model("Qwen2ForCausalLM", "Qwen2Config", **GQA),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS, BOTH,
         LOGITS_RETURNED, slow=True),
    # GemmaRMSNorm scales by (1 + weight) in float32
    Case("gemma", hf_model("GemmaForCausalLM", "GemmaConfig", head_dim=WIDTH // HEADS, **GQA),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS, BOTH,
         LOGITS_RETURNED),
    # parallel residual: both norms of a layer read the same input
    Case("gpt-neox", hf_model("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_dropout=0.0,
                         attention_dropout=0.0, **_DECODER),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS, BOTH,
         LOGITS_RETURNED),
    # do_layer_norm_before: self_attn_layer_norm and final_layer_norm per layer, then the
    # decoder's final_layer_norm
    Case("opt", hf_model("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=WIDTH,
                    ffn_dim=FFN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    max_position_embeddings=POSITIONS, word_embed_proj_dim=WIDTH, dropout=0.0,
                    attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS, BOTH,
         LOGITS_RETURNED),
    # word_embeddings_layernorm, two per layer, ln_f; ALiBi attention, eager only. In training
    # its GELU is a custom autograd.Function with a backward of its own: one region per layer,
    # whose kernels compute that backward (traced through the Function)
    Case("bloom", hf_model("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=WIDTH,
                      n_layer=LAYERS, n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 2, 1), LAYERS, ("eager",),
         LOGITS_RETURNED),
    # ln_1 and ln_2 per layer, ln_f. GPT2LMHeadModel's name matches no loss type, so its
    # `loss_function` logs a warning, where Dynamo breaks the graph: the loss compiles in a graph
    # of its own that takes the logits as an input, and no projection is there to refuse
    Case("gpt2", hf_model("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=POSITIONS,
                     n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS, BOTH),
    # CohereLayerNorm is LayerNorm written out (mean, centred squares, rsqrt, a weight, no bias):
    # normalize reads it as layer_norm; input_layernorm per layer (parallel attention and MLP)
    # and the final norm. The logits are scaled before the loss, which reads them whole
    Case("cohere", hf_model("CohereForCausalLM", "CohereConfig", **GQA),
         causal_lm_batch, own_loss, sites(LAYERS, LAYERS + 1, 1), LAYERS, BOTH,
         ("the logits come from a linear through mul.Tensor",), slow=True),
    # XGLM floors the masked scores at finfo.min (`torch.max(scores + mask, finfo.min)`) before
    # its softmax; self_attn_layer_norm and final_layer_norm per layer, then layer_norm
    Case("xglm", hf_model("XGLMForCausalLM", "XGLMConfig", vocab_size=VOCAB, d_model=WIDTH,
                     ffn_dim=FFN, num_layers=LAYERS, attention_heads=HEADS,
                     max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, pad_token_id=0),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS, ("eager",),
         LOGITS_RETURNED, slow=True),
    # beyond the list, in the slow tier. MPT: norm_1 and norm_2 per block, norm_f; its ALiBi
    # slopes are 2 ** x and its mask is Hugging Face's float mask tested back to bool
    Case("mpt", hf_model("MptForCausalLM", "MptConfig", vocab_size=VOCAB, d_model=WIDTH,
                    n_layers=LAYERS, n_heads=HEADS, max_seq_len=POSITIONS, pad_token_id=0),
         causal_lm_batch, own_loss, sites(LAYERS, 2 * LAYERS + 1, 1), 0, ("eager",),
         LOGITS_RETURNED, slow=True),  # its GELU stands alone between two linears: no region
    # Falcon with ALiBi: one input_layernorm per layer (parallel attention and MLP), ln_f; the
    # scores are scaled in place (`attention_logits *= inv_norm_factor`)
    Case("falcon-alibi", hf_model("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB,
                             hidden_size=WIDTH, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, alibi=True, hidden_dropout=0.0,
                             attention_dropout=0.0, bos_token_id=1, eos_token_id=2),
         causal_lm_batch, own_loss, sites(LAYERS, LAYERS + 1, 1), LAYERS, ("eager",),
         LOGITS_RETURNED, slow=True),
    # GPT-J: ln_1 per layer (parallel attention and MLP), ln_f; q and k upcast to float32 and
    # the scores divided by a tensor attribute (a constant once captured)
    Case("gpt-j", hf_model("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_embd=WIDTH,
                      n_layer=LAYERS, n_head=HEADS, rotary_dim=4, n_positions=POSITIONS,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                      eos_token_id=2),
         causal_lm_batch, own_loss, sites(LAYERS, LAYERS + 1, 1), LAYERS, ("eager",),
         LOGITS_RETURNED, slow=True),
]  # fmt: skip

ENCODERS = [
    # post-norm: the embeddings' LayerNorm, then two per layer (after attention, after the MLP)
    Case("bert-padding", hf_model("BertModel", "BertConfig", **_BERT),
         encoder_batch, hidden, sites(LAYERS, 2 * LAYERS + 1, 0), LAYERS, BOTH),
    # BERT's layers, positions counted from the padding
    Case("roberta", hf_model("RobertaModel", "RobertaConfig", **_BERT),
         encoder_batch, hidden, sites(LAYERS, 2 * LAYERS + 1, 0), LAYERS, BOTH, slow=True),
    Case("distilbert", hf_model("DistilBertModel", "DistilBertConfig", vocab_size=VOCAB, dim=WIDTH,
                           n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
                           max_position_embeddings=POSITIONS, dropout=0.0, attention_dropout=0.0),
         encoder_batch, hidden, sites(LAYERS, 2 * LAYERS + 1, 0), LAYERS, BOTH),
    # pre-norm: layernorm_before and layernorm_after per layer, then the final layernorm
    Case("vit", hf_model("ViTModel", "ViTConfig", hidden_size=WIDTH, num_hidden_layers=LAYERS,
                    num_attention_heads=HEADS, intermediate_size=FFN, image_size=16,
                    patch_size=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
         vit_batch, hidden, sites(LAYERS, 2 * LAYERS + 1, 0), LAYERS, BOTH),
]  # fmt: skip

ENCODER_DECODERS = [
    # encoder: two per layer and a final layer_norm; decoder: three per layer and a final one
    Case("whisper", hf_model("WhisperModel", "WhisperConfig", **_WHISPER),
         whisper_batch, hidden, sites(3 * LAYERS, 5 * LAYERS + 2, 0), 2 * LAYERS, BOTH),
    # T5LayerNorm is RMSNorm written out: one per sublayer (two per encoder layer, three per
    # decoder layer) and a final_layer_norm per stack; the gated-GELU feed-forward is the
    # activation site
    Case("t5-v1.1", hf_model("T5ForConditionalGeneration", "T5Config", **T5_V1_1),
         t5_batch, own_loss, sites(3 * LAYERS, 5 * LAYERS + 2, 1), 2 * LAYERS, BOTH,
         LOGITS_RETURNED),
    # post-norm: layernorm_embedding per stack, two per encoder layer, three per decoder layer,
    # no final norm
    Case("bart", hf_model("BartModel", "BartConfig", **_BART),
         seq2seq_batch, hidden, sites(3 * LAYERS, 5 * LAYERS + 2, 0), 2 * LAYERS, BOTH,
         slow=True),
]  # fmt: skip


# --------------------------------------------------------------------------------------------
# nanoGPT (karpathy/nanoGPT, model.py) as written there


@dataclasses.dataclass
class NanoGPTConfig:
    block_size: int = POSITIONS
    vocab_size: int = VOCAB
    n_layer: int = LAYERS
    n_head: int = HEADS
    n_embd: int = WIDTH
    dropout: float = 0.0
    bias: bool = True
    flash: bool = True
    """nanoGPT takes the SDPA path whenever torch has it; here the test picks the path."""


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = config.flash
        if not self.flash:
            causal = torch.tril(torch.ones(config.block_size, config.block_size))
            self.register_buffer("bias", causal.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                is_causal=True,
            )  # fmt: skip
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# --------------------------------------------------------------------------------------------
# minGPT (karpathy/minGPT, mingpt/model.py) as written there


class NewGELU(nn.Module):
    """GELU's tanh approximation written out, as in Google BERT and OpenAI GPT."""

    def forward(self, x):
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class MinBlock(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)  # minGPT's is nanoGPT's manual path, with biases
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.ModuleDict(
            dict(
                c_fc=nn.Linear(config.n_embd, 4 * config.n_embd),
                c_proj=nn.Linear(4 * config.n_embd, config.n_embd),
                act=NewGELU(),
                dropout=nn.Dropout(config.dropout),
            )
        )
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class MinGPT(nn.Module):
    def __init__(self, config: NanoGPTConfig):
        super().__init__()
        self.block_size = config.block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([MinBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size
        pos = torch.arange(0, t, dtype=torch.long, device=device).unsqueeze(0)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


def gpt_batch() -> dict[str, Any]:
    """Next-token targets, the last one of each row ignored (-1)."""
    ids = tokens(LENGTH + 1)
    targets = ids[:, 1:].clone()
    targets[:, -1] = -1
    return dict(idx=ids[:, :-1].contiguous(), targets=targets)


def _nanogpt(implementation: str) -> nn.Module:
    # the manual path runs without biases: nanoGPT's bias=False option
    flash = implementation == "sdpa"
    return NanoGPT(NanoGPTConfig(flash=flash, bias=flash))


def _mingpt(implementation: str) -> nn.Module:
    return MinGPT(NanoGPTConfig(flash=False))


def gpt_loss(output: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return output[1]


# --------------------------------------------------------------------------------------------
# nn.Transformer


def _transformer(implementation: str) -> nn.Module:
    return nn.Transformer(
        d_model=WIDTH, nhead=HEADS, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
        dim_feedforward=FFN, dropout=0.0, batch_first=True,
    )  # fmt: skip


def transformer_batch() -> dict[str, Any]:
    g = _generator()
    source_padding = padding_mask() == 0  # True where a key is padding
    return dict(
        src=torch.randn(BATCH, LENGTH, WIDTH, generator=g),
        tgt=torch.randn(BATCH, TARGET_LENGTH, WIDTH, generator=g),
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(TARGET_LENGTH),
        src_key_padding_mask=source_padding,
        memory_key_padding_mask=source_padding,
        tgt_is_causal=True,
    )


SCRIPTS = [
    # ln_1 and ln_2 per block, ln_f; F.cross_entropy on the flattened logits
    Case("nanogpt", _nanogpt, gpt_batch, gpt_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS,
         ("sdpa", "manual"), LOGITS_RETURNED),
    Case("mingpt", _mingpt, gpt_batch, gpt_loss, sites(LAYERS, 2 * LAYERS + 1, 1), LAYERS,
         ("manual",), LOGITS_RETURNED),
    # post-norm: norm1, norm2 per encoder layer and the encoder's final norm; norm1-3 per decoder
    # layer and the decoder's final norm; a ReLU per feed-forward block
    Case("nn-transformer", _transformer, transformer_batch, projected(lambda out: out),
         sites(3 * LAYERS, 5 * LAYERS + 2, 0), 2 * LAYERS, ("sdpa",)),
]  # fmt: skip

CASES = CAUSAL_LM + ENCODERS + ENCODER_DECODERS + SCRIPTS
