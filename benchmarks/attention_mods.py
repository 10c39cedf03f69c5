"""Score modifications and masks the fused attention computes in its kernels, against FlexAttention
given the same modification as `score_mod` and `mask_mod` (with its block mask), and SDPA where a
mask or bias tensor expresses it: forward and forward + backward time and TFLOP/s, in one run.

    python -m benchmarks.attention_mods [--quick | --short] [--mods NAME ...] [--lengths L ...]
        [--output benchmarks/results/<device>.md]

Modifications, each at every length (tokens B * L and hidden H * D fixed): causal; causal with a
sliding window; causal with soft-capped scores (`cap * tanh(scores / cap)`); causal with ALiBi by
distance (fixed slopes times key - query); T5's relative-position buckets from a learned table
(bidirectional, the table's gradient included); causal over a packed batch of three documents per
row. seqfast gets what its pattern would give the op: the causal, window and document arguments,
the soft cap as a registered score modification, a relative bias per diagonal (1, H, 1, 2L - 1).

FLOPs count the (query, key) pairs the mask leaves: forward 4 * D * H * pairs, forward + backward
3.5x that, the same for every executor. Before an executor is timed its output and gradients are
checked against the first executor that ran (SDPA where it takes the case, else FlexAttention):
max|a - b| / max|b|. FlexAttention is compiled on CUDA (its only efficient form) and runs eager,
forward only, on CPU (it has no CPU backward). Compile time is never timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import seqcompile.ops.attention  # noqa: F401  (registers torch.ops.seqfast.attention)
from benchmarks.common import brief, emit, header, progress, standard_setup, table, timed_ms
from seqcompile.ops.attention import score_mods

Tensor = torch.Tensor
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
BUCKETS, MAX_DISTANCE, CAP, WINDOW = 32, 128, 30.0, 1024


@dataclasses.dataclass(frozen=True)
class Mod:
    name: str
    causal: bool = True
    window: bool = False
    softcap: bool = False
    alibi: bool = False
    t5: bool = False
    documents: bool = False


MODS = [
    Mod("causal"),
    Mod("window", window=True),
    Mod("softcap", softcap=True),
    Mod("alibi", alibi=True),
    Mod("t5 buckets", causal=False, t5=True),
    Mod("documents", documents=True),
]


@dataclasses.dataclass
class Inputs:
    q: Tensor
    k: Tensor
    v: Tensor
    grad_out: Tensor
    scale: float
    window: int
    slopes: Tensor  # (H,) ALiBi's
    table: Tensor  # (H, BUCKETS) T5's, requires grad
    buckets: Tensor  # (2L - 1,) the bucket of each key - query diagonal, from 1 - L up
    ids: Tensor  # (B, L) document ids

    def learned(self, mod: Mod) -> list[Tensor]:
        return [self.q, self.k, self.v] + ([self.table] if mod.t5 else [])


def t5_buckets(relative: Tensor) -> Tensor:
    """Bidirectional buckets of key - query, as T5 computes them."""
    half = BUCKETS // 2
    bucket = (relative > 0).long() * half
    distance = relative.abs()
    exact = half // 2
    far = (
        exact
        + (
            torch.log(distance.float().clamp(min=1) / exact)
            / math.log(MAX_DISTANCE / exact)
            * (half - exact)
        ).long()
    )
    return bucket + torch.where(distance < exact, distance, far.clamp(max=half - 1))


def make_inputs(b: int, h: int, length: int, d: int, dtype, device) -> Inputs:
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> Tensor:
        return torch.randn(shape, device=device, dtype=dtype, generator=g)

    q, k, v = (randn(b, h, length, d).requires_grad_() for _ in range(3))
    cuts = [0, length // 2, length * 4 // 5, length]
    ids = torch.zeros(b, length, dtype=torch.int64, device=device)
    for doc, (start, end) in enumerate(zip(cuts, cuts[1:], strict=False)):
        ids[:, start:end] = doc
    diagonals = torch.arange(1 - length, length, device=device)
    slopes = 2.0 ** (-8.0 * torch.arange(1, h + 1, device=device) / h)
    return Inputs(
        q, k, v, randn(b, h, length, d), d**-0.5, min(WINDOW, length // 4), slopes,
        (randn(h, BUCKETS) * 0.5).requires_grad_(), t5_buckets(diagonals), ids,
    )  # fmt: skip


def soft_cap(s: Tensor) -> Tensor:
    return CAP * torch.tanh(s / CAP)


def keep(mod: Mod, t: Inputs, b, h, q_idx, kv_idx):
    """Whether query q_idx sees key kv_idx (FlexAttention's mask_mod, broadcastable)."""
    seen = torch.ones_like(q_idx == kv_idx)
    if mod.causal:
        seen = seen & (kv_idx <= q_idx)
    if mod.window:
        seen = seen & (q_idx - kv_idx < t.window)
    if mod.documents:
        seen = seen & (t.ids[b, q_idx] == t.ids[b, kv_idx])
    return seen


def modified(mod: Mod, t: Inputs, s, b, h, q_idx, kv_idx):
    """The scaled scores modified (FlexAttention's score_mod, broadcastable)."""
    length = t.q.shape[-2]
    if mod.softcap:
        s = soft_cap(s)
    if mod.alibi:
        s = s + t.slopes[h] * (kv_idx - q_idx)
    if mod.t5:
        s = s + t.table[h, t.buckets[kv_idx - q_idx + length - 1]]
    return s


def seqfast(mod: Mod, t: Inputs) -> Tensor:
    b, h, length, _ = t.q.shape
    rel = None
    if mod.alibi:
        rel = (t.slopes[:, None] * torch.arange(1 - length, length, device=t.q.device)).view(
            1, h, 1, -1
        )
    if mod.t5:
        rel = t.table[:, t.buckets].view(1, h, 1, -1)
    docs = (t.ids[:, None, :, None], t.ids[:, None, None, :]) if mod.documents else (None, None)
    cap = score_mods.register(soft_cap, f"{CAP:g} * tanh(s / {CAP:g})") if mod.softcap else ""
    window = t.window if mod.window else 0
    out, _, _ = torch.ops.seqfast.attention(
        t.q, t.k, t.v, None, None, None, 0, 0.0, t.scale, mod.causal, -math.inf, window, cap, *docs,
        None if rel is None else rel.to(t.q.dtype),
    )  # fmt: skip
    return out


def flex(mod: Mod, t: Inputs, block_mask, attend: Callable) -> Tensor:
    return attend(
        t.q, t.k, t.v, scale=t.scale, block_mask=block_mask,
        score_mod=functools.partial(modified, mod, t),
    )  # fmt: skip


def sdpa(mod: Mod, t: Inputs) -> Tensor:
    """SDPA with the modification as a tensor: `is_causal` alone, else a boolean mask or a float
    bias (-inf where masked) at the scores' size."""
    if mod.softcap:
        raise NotImplementedError("no tensor expresses a soft cap")
    if not (mod.window or mod.alibi or mod.t5 or mod.documents):
        return F.scaled_dot_product_attention(t.q, t.k, t.v, is_causal=mod.causal, scale=t.scale)
    length = t.q.shape[-2]
    idx = torch.arange(length, device=t.q.device)
    batch = torch.arange(t.q.shape[0], device=t.q.device)[:, None, None, None]
    heads = torch.arange(t.q.shape[1], device=t.q.device)[None, :, None, None]
    q_idx, kv_idx = idx[:, None], idx[None, :]
    seen = keep(mod, t, batch, heads, q_idx, kv_idx)
    if mod.alibi or mod.t5:
        zeros = torch.zeros((), device=t.q.device, dtype=torch.float32)
        bias = modified(mod, t, zeros, batch, heads, q_idx, kv_idx).to(t.q.dtype)
        mask = bias.masked_fill(~seen, -math.inf)
    else:
        mask = seen
    return F.scaled_dot_product_attention(t.q, t.k, t.v, attn_mask=mask, scale=t.scale)


def visible_pairs(mod: Mod, t: Inputs) -> int:
    length = t.q.shape[-2]
    idx = torch.arange(length, device=t.q.device)
    batch = torch.arange(t.q.shape[0], device=t.q.device)[:, None, None]
    seen = keep(mod, t, batch, None, idx[:, None], idx[None, :])
    return int(seen.expand(t.q.shape[0], length, length).sum()) * t.q.shape[1]


def run(fn: Callable[[], Tensor], t: Inputs, mod: Mod, backward: bool) -> list[Tensor]:
    out = fn()
    if not backward:
        return [out.detach()]
    return [out.detach(), *torch.autograd.grad(out, t.learned(mod), t.grad_out)]


def relative_error(got: list[Tensor], reference: list[Tensor]) -> float:
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()
        for a, b in zip(got, reference, strict=False)
    )


def bench_mod(mod: Mod, t: Inputs, device: torch.device, cap_gib: float) -> dict[str, list]:
    """{executor: [fwd ms, fwd+bwd ms, note]}: each checked against the first that ran, then
    timed."""
    b, h, length, _ = t.q.shape
    on_cuda = device.type == "cuda"
    # FlexAttention recompiles for every modification and length: past `recompile_limit` (8)
    # compiles Dynamo would run it eagerly, so each case starts from an empty cache
    torch._dynamo.reset()
    mask_mod = functools.partial(keep, mod, t)
    block_mask = create_block_mask(mask_mod, b if mod.documents else None, None, length, length,
                                   device=device)  # fmt: skip
    attend = torch.compile(flex_attention) if on_cuda else flex_attention
    constants = dataclasses.replace(  # FlexAttention's inputs on CPU, where it has no backward
        t, q=t.q.detach(), k=t.k.detach(), v=t.v.detach(), table=t.table.detach()
    )
    executors = {
        "sdpa": functools.partial(sdpa, mod, t),
        "flex": functools.partial(flex, mod, t if on_cuda else constants, block_mask, attend),
        "seqfast": functools.partial(seqfast, mod, t),
    }
    results, reference = {}, None
    scores_gib = b * h * length**2 * t.q.element_size() / 2**30
    for name, fn in executors.items():
        backward = on_cuda or name != "flex"
        if name == "sdpa" and scores_gib > cap_gib and not mod == Mod("causal"):
            results[name] = ["-", "-", f"skipped: a {scores_gib:.0f} GiB mask"]
            continue
        try:
            outputs = run(fn, t, mod, backward)
        except NotImplementedError as why:
            results[name] = ["-", "-", str(why)]
            continue
        except torch.cuda.OutOfMemoryError:
            results[name] = ["-", "-", "OOM"]
            continue
        except RuntimeError as error:  # recorded and counted as a failure, not hidden
            results[name] = ["-", "-", f"FAILED: {brief(error, 80)}"]
            continue
        note = "the reference"
        if reference is not None:
            error = relative_error(outputs, reference)
            note = f"{'MISMATCH ' if error > TOLERANCE[t.q.dtype] else ''}rel err {error:.1e}"
        reference = reference or outputs
        with torch.no_grad():
            fwd = timed_ms(fn, device)
        both = timed_ms(lambda fn=fn: run(fn, t, mod, True), device) if backward else "-"
        results[name] = [fwd, both, note if backward else f"{note} (forward only)"]
        del outputs
    return results


SHORT_MODS = ("window", "softcap", "documents")
"""`--short`'s modifications: one mask, one score modification, one per-batch mask."""


def options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        help="default 1024 2048 4096 8192 16384; 4096 with --short",
    )
    parser.add_argument(
        "--mods",
        nargs="+",
        choices=[mod.name for mod in MODS],
        help=f"default all; {', '.join(SHORT_MODS)} with --short",
    )


def main() -> None:
    args, device, dtype = standard_setup(__doc__, options)
    tokens, hidden, head_dim = (128, 32, 16) if args.quick else (16384, 1024, 64)
    if args.quick:
        lengths = [64]
    elif args.short:
        lengths = args.lengths or [4096]
    else:
        lengths = args.lengths or [1024, 2048, 4096, 8192, 16384]
    names = args.mods or (SHORT_MODS if args.short else [mod.name for mod in MODS])
    mods = [mod for mod in MODS if mod.name in names]
    rows, mismatches = [], 0
    for length in lengths:
        t = make_inputs(tokens // length, hidden // head_dim, length, head_dim, dtype, device)
        for mod in mods:
            pairs = visible_pairs(mod, t)
            flops = 4 * head_dim * pairs
            results = bench_mod(mod, t, device, cap_gib=8.0)
            for name, (fwd, both, note) in results.items():
                mismatches += note.startswith(("MISMATCH", "FAILED"))
                cells = []
                for ms, factor in ((fwd, 1.0), (both, 3.5)):
                    cells += [ms, flops * factor / (ms * 1e-3) / 1e12] if ms != "-" else ["-"] * 2
                seqfast_both = results["seqfast"][1]
                ratio = both / seqfast_both if "-" not in (both, seqfast_both) else "-"
                rows.append([length, mod.name, name, *cells, ratio, note])
                progress(rows[-1])
            if device.type == "cuda":
                torch.cuda.empty_cache()
    lines = header("Attention score modifications and masks", device, "benchmarks.attention_mods")
    lines += [
        f"dtype {dtype}; B*L = {tokens} tokens, H*D = {hidden} ({head_dim} per head); window"
        f" {WINDOW} keys (or L/4); soft cap {CAP:g}; T5: {BUCKETS} buckets up to {MAX_DISTANCE};"
        " FLOPs over the visible pairs. 'executor / seqfast' = its fwd+bwd ms / seqfast's (above 1:"
        " seqfast is faster).",
        "",
    ]
    columns = ["L", "modification", "executor", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms"]
    columns += ["fwd+bwd TFLOP/s", "executor / seqfast", "check"]
    lines += table(columns, rows)
    emit(lines, args.output)
    if mismatches:
        raise SystemExit(f"benchmarks.attention_mods: {mismatches} runs failed; see check")


if __name__ == "__main__":
    main()
