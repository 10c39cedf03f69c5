"""A small GPT-style model and the demo that trains it with eager PyTorch, Inductor and seqfast side
by side, printing the loss curves, step times, the memory kept for the backward and the fusion
report. Tests and benchmarks reuse the model at other sizes."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from seqcompile.memory.saved import saved_bytes
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


EXECUTORS: dict[str, Callable[[nn.Module], Callable[..., torch.Tensor]]] = {
    "eager": lambda model: model,
    "inductor": torch.compile,
    "seqfast": lambda model: torch.compile(model, backend="seqfast"),
}
"""What the demo trains with: each wraps a copy of the model into its step function."""


def run_demo(
    steps: int = 12, device: str | None = None
) -> tuple[dict[str, Run], dict[str, int], CompileReport]:
    """Train the same initial model with eager, Inductor and seqfast, and print what happened:
    the loss curves, the median step time, and the bytes each keeps for the backward (measured
    with saved-tensor hooks on one more step)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = GPTConfig()
    batch, length = 8, 32
    torch.manual_seed(0)
    initial = GPT(config).to(dev)
    runs, kept = {}, {}
    with collecting() as report:
        for executor, wrap in EXECUTORS.items():
            model = copy.deepcopy(initial)
            step_fn = wrap(model)
            runs[executor] = train(
                model, step_fn, config, steps=steps, batch=batch, length=length, device=dev
            )
            data = toy_batch(config, batch, length, dev, torch.Generator().manual_seed(steps))
            lasting = [*model.parameters(), *model.buffers(), *data]
            kept[executor] = saved_bytes(functools.partial(step_fn, *data), lasting)
    print(
        f"seqcompile demo: GPT {config.n_layers} layers, d_model {config.d_model}, dropout"
        f" {config.dropout}, {batch} x {length} tokens, on {dev}"
    )
    print(f"{'step':>4}" + "".join(f"  {e + ' loss':>13}" for e in EXECUTORS))
    for i in range(steps):
        print(f"{i:>4}" + "".join(f"  {runs[e].losses[i]:>13.4f}" for e in EXECUTORS))
    # The first step of a compiled model includes compilation; the median of the rest is the
    # steady state.
    print()
    print(f"{'':<36}" + "".join(f"{e:>10}" for e in EXECUTORS))
    rows = {
        "median step time (ms)": [
            f"{statistics.median(runs[e].step_seconds[1:]) * 1e3:.1f}" for e in EXECUTORS
        ],
        "first step, with compilation (s)": [f"{runs[e].step_seconds[0]:.1f}" for e in EXECUTORS],
        "kept for the backward (MiB)": [f"{kept[e] / 2**20:.2f}" for e in EXECUTORS],
    }
    for label, values in rows.items():
        print(f"{label:<36}" + "".join(f"{v:>10}" for v in values))
    print(
        "Dropout draws different random numbers under each executor, so the curves agree in trend,"
        " not digit for digit."
    )
    if dev.type == "cpu":
        print(
            "On CPU the fused operators run as plain ATen that Inductor compiles with the rest of"
            " the graph. What the backward keeps and the loss curves carry over to CUDA (the same"
            " memory plan decides what is kept); the step times do not: on CUDA the fused"
            " operators are generated Triton kernels."
        )
    print()
    print(report)
    return runs, kept, report
