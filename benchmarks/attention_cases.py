"""The attention benchmark's cases: the shapes, masks and dropout it measures (`cases`, by size
option) and the seeded inputs of one case (`make_inputs`)."""

from __future__ import annotations

import dataclasses
import math

import torch

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class Case:
    length: int
    head_dim: int
    batch: int
    heads: int
    causal: bool
    p: float
    bias: str  # "none"; "pad": (B, 1, 1, L), 0 or -inf per key; "full": (1, H, L, L), random;
    # "tri": the causal triangle as an (L, L) boolean mask tensor, as a model's buffer holds it
    kv_heads: int | None = None  # grouped-query attention: H // kv_heads query heads per k, v

    @property
    def groups(self) -> int:
        return self.heads // (self.kv_heads or self.heads)

    def flops(self, backward: bool) -> float:
        forward = 4 * self.batch * self.heads * self.length**2 * self.head_dim
        halved = self.causal or self.bias == "tri"
        return forward / (2 if halved else 1) * (3.5 if backward else 1.0)

    def scores_gib(self) -> float:
        """The float32 scores the eager spelling materializes."""
        return self.batch * self.heads * self.length**2 * 4 / 2**30

    def cells(self) -> list[object]:
        heads = f"{self.heads}/{self.kv_heads}" if self.groups > 1 else self.heads
        return [
            self.length, self.head_dim, f"{self.batch}x{heads}", self.causal, self.p, self.bias,
        ]  # fmt: skip


@dataclasses.dataclass
class Inputs:
    q: Tensor  # (B, H, L, D), requires grad, as k and v
    k: Tensor  # (B, H // groups, L, D), as v
    v: Tensor
    grad_out: Tensor  # (B, H, L, D)
    bias: Tensor | None  # (B, 1, 1, L) or (1, H, L, L), q's dtype
    mask: Tensor | None  # (L, L) bool, True where a query attends: the "tri" case
    seed: Tensor | None  # 0-d int64, when p > 0
    future: Tensor | None  # (L, L) bool, True above the diagonal, when causal (eager's mask)
    scale: float


SHORT_GRID = [(False, 0.0, "none"), (True, 0.0, "none"), (True, 0.1, "none"), (False, 0.0, "pad")]
"""`--short`'s (causal, p, bias): SDPA's flash backend takes the first three, not the fourth."""
GPT2 = dict(length=1024, head_dim=64, batch=8, heads=12)
"""GPT-2 small's attention at its context and a batch of 8, which `--short` adds causal with and
without dropout, and with dropout and the causal triangle read from a mask tensor (a model's
buffer): beside the causal row, that row shows what the mask's block lists cost."""
LLAMA = dict(length=4096, head_dim=128, batch=4, heads=32, kv_heads=8)
"""A LLaMA-style attention with grouped-query heads (4 query heads per key/value head), which
`--short` adds causal."""


def cases(
    quick: bool,
    lengths: list[int],
    head_dims: list[int],
    itemsize: int,
    cap_gib: float,
    short: bool = False,
) -> list[Case]:
    """(causal, p, bias) for every length and head dim; bias cases are non-causal."""
    if quick:
        tokens, hidden = 64, 64
        grid = [(False, 0.0, "none"), (True, 0.0, "none"), (False, 0.1, "none")]
        grid += [(False, 0.0, "pad"), (False, 0.1, "full"), (False, 0.0, "tri")]
    elif short:
        tokens, hidden = 16384, 2048
        grid = SHORT_GRID
    else:
        tokens, hidden = 16384, 2048
        grid = [(causal, p, "none") for causal in (False, True) for p in (0.0, 0.1)]
        grid += [(False, p, bias) for bias in ("pad", "full", "tri") for p in (0.0, 0.1)]
    found = []
    for head_dim in head_dims:
        for length in lengths:
            for causal, p, bias in grid:
                heads = hidden // head_dim
                if bias == "full" and heads * length**2 * itemsize / 2**30 > cap_gib:
                    continue  # the (1, H, L, L) bias alone passes the memory cap
                found.append(Case(length, head_dim, tokens // length, heads, causal, p, bias))
    if quick:  # grouped-query heads, as `--short`'s LLaMA shape has them
        found.append(Case(64, 32, 1, 2, causal=True, p=0.0, bias="none", kv_heads=1))
    if short:
        found += [Case(**GPT2, causal=True, p=p, bias="none") for p in (0.0, 0.1)]
        found.append(Case(**GPT2, causal=False, p=0.1, bias="tri"))
        found.append(Case(**LLAMA, causal=True, p=0.0, bias="none"))
    return found


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device) -> Inputs:
    g = torch.Generator(device=device).manual_seed(0)
    shape = (case.batch, case.heads, case.length, case.head_dim)

    def randn(size: tuple[int, ...]) -> Tensor:
        return torch.randn(size, device=device, dtype=dtype, generator=g)

    q = randn(shape).requires_grad_()
    kv_shape = (case.batch, case.heads // case.groups, case.length, case.head_dim)
    k, v = (randn(kv_shape).requires_grad_() for _ in range(2))
    bias = None
    if case.bias == "pad":
        kept = torch.randint(
            case.length // 2, case.length + 1, (case.batch, 1, 1, 1), device=device, generator=g
        )
        keys = torch.arange(case.length, device=device)
        bias = torch.where(keys < kept, 0.0, -math.inf).to(dtype)
    elif case.bias == "full":
        bias = randn((1, case.heads, case.length, case.length))
    mask = None
    if case.bias == "tri":
        mask = torch.ones(case.length, case.length, dtype=torch.bool, device=device).tril()
    seed = None
    if case.p > 0:
        seed = torch.randint(0, 2**62, (), dtype=torch.int64, device=device, generator=g)
    future = None
    if case.causal:
        future = torch.ones(case.length, case.length, dtype=torch.bool, device=device).triu(1)
    return Inputs(q, k, v, randn(shape), bias, mask, seed, future, case.head_dim**-0.5)
