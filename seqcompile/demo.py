"""A small GPT-style model and the demo that trains it with eager PyTorch and with seqfast side by
side, printing both loss curves, step times and the fusion report. Tests and benchmarks reuse the
model at other sizes."""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from seqcompile.report import CompileReport, collecting


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    max_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.1
    norm: str = "layer"
    """"layer" (nn.LayerNorm), "rms" (nn.RMSNorm) or "t5" (RMSNorm written out by hand)."""


GPT2_SMALL = GPTConfig(vocab=50257, max_len=1024, d_model=768, n_heads=12, n_layers=12, dropout=0.1)


class HandwrittenRMSNorm(nn.Module):
    """RMSNorm as T5 writes it: variance in float32, weight applied in the weight's dtype."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)
        return self.weight * h


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "layer":
        return nn.LayerNorm(config.d_model)
    if config.norm == "rms":
        return nn.RMSNorm(config.d_model, eps=1e-6)
    if config.norm == "t5":
        return HandwrittenRMSNorm(config.d_model)
    raise ValueError(f'GPTConfig.norm must be "layer", "rms" or "t5"; got {config.norm!r}')


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout
        mask = torch.tril(torch.ones(config.max_len, config.max_len, dtype=torch.bool))
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.n_heads)
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        probs = F.dropout(scores.softmax(-1), self.dropout, self.training)
        out = (probs @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(out)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN: each residual sum is normalized and carried on to the next residual add."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = make_norm(config), make_norm(config)
        self.attn, self.mlp = CausalSelfAttention(config), MLP(config)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config.vocab, config.d_model)
        self.pos = nn.Embedding(config.max_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = make_norm(config)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.head.weight = self.tok.weight
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = F.dropout(self.tok(idx) + self.pos(positions), self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def toy_batch(
    config: GPTConfig, batch: int, length: int, device: torch.device, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up from a random start (mod vocab): learnable in a few steps."""
    start = torch.randint(config.vocab, (batch, 1), generator=generator)
    tokens = (start + torch.arange(length + 1)) % config.vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


@dataclasses.dataclass
class Run:
    losses: list[float]
    step_seconds: list[float]


def train(
    model: nn.Module,
    step_fn: Callable[..., torch.Tensor],
    config: GPTConfig,
    *,
    steps: int,
    batch: int,
    length: int,
    device: torch.device,
    seed: int = 0,
) -> Run:
    """Train with AdamW on toy batches; the same seed gives the same batches and dropout draws."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(seed)
    run = Run([], [])
    for _ in range(steps):
        idx, targets = toy_batch(config, batch, length, device, generator)
        start = time.perf_counter()
        loss = step_fn(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        run.step_seconds.append(time.perf_counter() - start)
        run.losses.append(loss.item())
    return run


def run_demo(steps: int = 12, device: str | None = None) -> tuple[Run, Run, CompileReport]:
    """Train the same initial model with eager and with seqfast, and print what happened."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = GPTConfig()
    torch.manual_seed(0)
    eager_model = GPT(config).to(dev)
    fast_model = copy.deepcopy(eager_model)
    batch, length = 8, 32
    eager = train(
        eager_model, eager_model, config, steps=steps, batch=batch, length=length, device=dev
    )
    with collecting() as report:
        compiled = torch.compile(fast_model, backend="seqfast")
        fast = train(
            fast_model, compiled, config, steps=steps, batch=batch, length=length, device=dev
        )
    print(f"seqcompile demo: GPT {config.n_layers} layers, d_model {config.d_model}, on {dev}")
    print(f"{'step':>4}  {'eager loss':>10}  {'seqfast loss':>12}")
    for i, (a, b) in enumerate(zip(eager.losses, fast.losses, strict=True)):
        print(f"{i:>4}  {a:>10.4f}  {b:>12.4f}")
    # The first seqfast step includes compilation; the median of the rest is the steady state.
    print(
        f"median step time: eager {statistics.median(eager.step_seconds[1:]) * 1e3:.1f} ms, "
        f"seqfast {statistics.median(fast.step_seconds[1:]) * 1e3:.1f} ms "
        f"(first seqfast step, with compilation: {fast.step_seconds[0]:.1f} s)"
    )
    if dev.type == "cpu":
        print(
            "on CPU the fused operators run their reference implementation (plain ATen, the"
            " test oracle), so seqfast is not faster here; its speed comes from the Triton"
            " kernels on CUDA"
        )
    print()
    print(report)
    return eager, fast, report
