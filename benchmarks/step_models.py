"""The models the training-step benchmarks run, each `model(idx, targets)` -> loss:

- `demo`: `seqcompile.demo.GPT` as written (attention written out, the causal mask in a buffer,
  dropout 0.1);
- `gpt2-sdpa`: the same GPT with `F.scaled_dot_product_attention(is_causal=True)`, where Inductor
  runs FlashAttention;
- `llama`: RMSNorm, SwiGLU, rotary positions, grouped-query attention (4 query heads per key
  head), no dropout, an untied head.

Each is built at GPT-2-small scale from the demo's `GPTConfig` (its width, heads, layers, vocab
and length), or tiny with the same config at `--quick` sizes."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from seqcompile.demo import GPT, CausalSelfAttention, GPTConfig

MODELS = ("demo", "gpt2-sdpa", "llama")


def build(name: str, config: GPTConfig) -> nn.Module:
    """The model `name` (one of `MODELS`) at `config`'s sizes."""
    if name == "demo":
        return GPT(config)
    if name == "gpt2-sdpa":
        model = GPT(config)
        for block in model.blocks:
            block.attn.__class__ = SDPAAttention  # the same weights, attention through SDPA
        return model
    if name == "llama":
        return Llama(config)
    raise ValueError(f"no model {name!r}; the models are {', '.join(MODELS)}")


class SDPAAttention(CausalSelfAttention):
    """GPT-2's attention through `F.scaled_dot_product_attention(is_causal=True)`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, d // heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        repeat = self.heads // self.kv_heads  # each key head serves `repeat` query heads
        k, v = (
            z[:, :, None]
            .expand(b, self.kv_heads, repeat, t, self.head_dim)
            .reshape(b, -1, t, self.head_dim)
            for z in (k, v)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.attention_norm = nn.RMSNorm(d, eps=1e-6)
        self.attention = LlamaAttention(d, config.n_heads, max(config.n_heads // 4, 1))
        self.ffn_norm = nn.RMSNorm(d, eps=1e-6)
        self.ffn = SwiGLU(d, 256 * ((8 * d // 3 + 255) // 256))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        head_dim = config.d_model // config.n_heads
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=1e-6)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        inverse = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        self.register_buffer("inverse_frequency", inverse, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inverse_frequency)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
