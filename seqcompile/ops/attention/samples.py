"""Sample inputs of `seqfast::attention` and the eager composition that defines its answer:
every tensor argument present in some sample (biases, masks, relative bias, prefix, document
ids, sink), each size 0, 1 and odd, non-finite rows and rows whose every key is masked."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from seqcompile.ops.samples import Sample, generator, randn

Tensor = torch.Tensor
FLOAT32_MIN = torch.finfo(torch.float32).min
BASE = dict(b=1, h=3, lq=5, lk=7, d=9)
"""Odd heads and lengths, no multiple of any tile; small, since the interpreter runs the kernels'
programs one by one (TILED has the odd batch)."""
TILED = dict(b=3, h=1, lq=17, lk=19, d=40)
"""Lengths over two of the interpreter's 16-row tiles, the second partial, an odd batch and a head
dim between two powers of two: the first sample, which the sweep runs in every layout."""


def eager(
    q, k, v, bias, mask, scale, causal, masked_value, window, doc_q, doc_kv, rel_bias, prefix,
    sink, **_,
) -> tuple[Tensor]:  # fmt: skip
    """softmax(q k^T * scale + bias + rel_bias, keys hidden by the mask taking `masked_value` and
    those causal, the window, the prefix and the documents hide taking -inf; the sink's logit
    joining each row, its column dropped after) @ v; a row whose every score is -inf gives 0 (as
    SDPA defines it)."""
    if k.shape[-3] not in (q.shape[-3], 1, 0):  # grouped-query heads: head h reads h // group
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = torch.einsum("...id,...jd->...ij", q, k) * scale
    lq, lk = s.shape[-2:]
    query, key = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    if bias is not None:
        s = s + bias
    if rel_bias is not None:  # score (i, j) adds the bias's value at key - query + Lq - 1
        s = s + rel_bias.squeeze(-2)[..., key - query + lq - 1]
    if mask is not None:
        s = torch.where(mask, s, masked_value)
    hidden = torch.zeros(lq, lk, dtype=torch.bool)
    if causal:
        after = key > query
        hidden = hidden | (after if prefix is None else after & (key >= prefix))
    if window:
        hidden = hidden | (query - key >= window)
    if doc_q is not None:
        hidden = hidden | (doc_q != doc_kv)
    s = s.masked_fill(hidden, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.expand(*s.shape[:-1], 1)], -1)
    dead = (s == -math.inf).all(-1, keepdim=True)
    probs = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    return (probs[..., : probs.shape[-1] - (sink is not None)] @ v,)


def _call(g, b, h, lq, lk, d, *, kv_heads=None, **given) -> dict:
    """The op's arguments: q, k, v of the sizes given, and the rest as `given` names them."""
    kv = h if kv_heads is None else kv_heads
    args = dict(
        q=randn(g, b, h, lq, d, scale=1.5), k=randn(g, b, kv, lk, d), v=randn(g, b, kv, lk, d),
        bias=None, mask=None, seed=None, stream=0, p=0.0, scale=max(d, 1) ** -0.5, causal=False,
        masked_value=-math.inf, window=0, score_mod="", doc_q=None, doc_kv=None, rel_bias=None,
        prefix=None, sink=None,
    )  # fmt: skip
    args.update(given)
    return args


def _sample(name: str, args: dict) -> Sample:
    learned = [n for n in ("bias", "rel_bias", "sink") if args[n] is not None]
    return Sample(name, args, eager, grads=("q", "k", "v", *learned))


def _bias_and_mask(g, b, h, lq, lk, d, masked_value=-math.inf) -> dict:
    """A learned bias per head and a mask per batch, one query row of batch 0 masked whole."""
    mask = torch.rand((b, 1, lq, lk), generator=g) > 0.3
    mask[:1, :, lq // 2 : lq // 2 + 1] = False
    return _call(
        g, b, h, lq, lk, d, bias=randn(g, 1, h, lq, lk), mask=mask, masked_value=masked_value
    )


def samples() -> Iterator[Sample]:
    """The base samples, every tensor contiguous."""
    g = generator(0)
    yield _sample("tiled-bias-mask", _bias_and_mask(g, **TILED))
    yield _sample("bias-mask", _bias_and_mask(g, **BASE))
    for dim in BASE:
        for size in (0, 1):
            sizes = {**BASE, dim: size}
            yield _sample(f"bias-mask-{dim}{size}", _bias_and_mask(g, **sizes))
    yield _sample("bias-mask-lq0-lk0", _bias_and_mask(g, **{**BASE, "lq": 0, "lk": 0}))
    yield _sample("masked-rows-finfo-min", _bias_and_mask(g, **BASE, masked_value=FLOAT32_MIN))
    yield from _values(g)
    yield from _features(g)


def _values(g) -> Iterator[Sample]:
    """NaN and +-inf in one row of each operand, and a bias row of -inf (every key hidden); the
    q, k and v rows also without a bias, where the kernels keep scores in log2 units."""
    edits = {
        "nan-q-row": ("q", (0, 1, 3), math.nan),
        "inf-q-row": ("q", (0, 0, 4), math.inf),
        "neg-inf-k-row": ("k", (0, 2, 4), -math.inf),
        "nan-v-row": ("v", (0, 0, 6), math.nan),
        "neg-inf-bias-row": ("bias", (0, 1, 2), -math.inf),
        "inf-bias-row": ("bias", (0, 2, 3), math.inf),
    }
    for name, (operand, row, value) in edits.items():
        args = _call(g, **BASE, bias=randn(g, 1, BASE["h"], BASE["lq"], BASE["lk"]))
        args[operand][row] = value
        yield _sample(name, args)
        if operand != "bias":
            args = _call(g, **BASE)
            args[operand][row] = value
            yield _sample(f"{name}-no-bias", args)


def _features(g) -> Iterator[Sample]:
    """No mask or bias at all; the other tensor arguments: a padding mask with a sequence wholly
    padded, grouped heads (also causal over as many keys as queries), a relative bias with a
    prefix, a sink per head with padding and causal, document ids with a window."""
    batched = {**BASE, "b": 3, "h": 1}
    b, h, lq, lk, d = batched.values()
    padding = torch.rand((b, 1, 1, lk), generator=g) > 0.3
    padding[1] = False
    yield _sample("padding-causal", _call(g, **batched, mask=padding, causal=True))
    yield from _block_masks(g)
    yield _sample("plain", _call(g, **BASE))
    yield _sample("grouped-heads", _call(g, **BASE, kv_heads=1, causal=True))
    square = {**BASE, "lk": BASE["lq"]}  # (what SDPA's flash kernels take causal)
    yield _sample("grouped-heads-causal-square", _call(g, **square, kv_heads=1, causal=True))
    prefix = torch.tensor([0, 5, lk], dtype=torch.int64).view(b, 1, 1, 1)
    relative = randn(g, 1, h, 1, lq + lk - 1)
    yield _sample(
        "relative-prefix", _call(g, **batched, causal=True, rel_bias=relative, prefix=prefix)
    )
    for size in (1, 0):  # one query, no query: the relative bias's diagonals are the keys'
        sizes = {**BASE, "lq": size}
        relative = randn(g, 1, h, 1, size + lk - 1)
        yield _sample(f"relative-lq{size}", _call(g, **sizes, causal=True, rel_bias=relative))
    sink = randn(g, 1, BASE["h"], 1, 1, scale=2.0)  # a learned logit per head
    yield _sample("sink-padding-causal", _call(g, **BASE, mask=padding[:1], causal=True, sink=sink))
    length = min(lq, lk)
    ids = torch.randint(0, 3, (b, 1, length), generator=g).sort(-1).values
    yield _sample(
        "documents-window",
        _call(g, b, h, length, length, d, causal=True, window=3, doc_q=ids[..., None],
              doc_kv=ids[..., None, :]),
    )  # fmt: skip


BLOCKED = dict(b=2, h=2, lq=33, lk=35, d=16)
"""Three blocks of the interpreter's 16-row tiles each way, the last one partial."""


def _block_masks(g) -> Iterator[Sample]:
    """Masks and biases with blocks the kernels skip, read whole or read in part: the causal
    triangle kept in a buffer (with -inf, and with the float32 minimum, where no block is
    skipped; as a bias of -inf and 0, also with a window), padding masks and biases by sequence
    length, one sequence padded wholly, and a bias per head with a block of 0, a block of -inf
    and random values."""
    b, h, lq, lk, d = BLOCKED.values()
    triangle = torch.ones(lq, lk, dtype=torch.bool).tril()
    yield _sample("triangle-mask", _call(g, **BLOCKED, mask=triangle))
    yield _sample(
        "triangle-mask-finfo-min", _call(g, **BLOCKED, mask=triangle, masked_value=FLOAT32_MIN)
    )
    lengths = torch.tensor([lk - 3, 0]).view(b, 1, 1, 1)
    padding = torch.arange(lk) < lengths
    yield _sample("padding-mask", _call(g, **BLOCKED, mask=padding))
    per_head = torch.rand((1, h, lq, lk), generator=g) > 0.5
    per_head[:, 0, :16] = True  # one head's first row block sees every key
    per_head[:, 1, :, 16:32] = False  # the other's middle key block is hidden
    yield _sample("head-mask-blocks", _call(g, **BLOCKED, mask=per_head))
    hidden = torch.zeros(lq, lk).masked_fill(~triangle, -math.inf)
    yield _sample("triangle-bias", _call(g, **BLOCKED, bias=hidden))
    yield _sample("triangle-bias-window", _call(g, **BLOCKED, bias=hidden, window=20))
    yield _sample(  # (the masked value, which only a mask takes, has no part)
        "triangle-bias-finfo-min", _call(g, **BLOCKED, bias=hidden, masked_value=FLOAT32_MIN)
    )
    yield _sample(
        "padding-bias",
        _call(g, **BLOCKED, bias=torch.zeros(b, 1, 1, lk).masked_fill(~padding, -math.inf)),
    )
    per_head = randn(g, 1, h, lq, lk)
    per_head[:, 0, :16, :16] = 0.0  # a block the kernels do not read
    per_head[:, 1, :, 16:32] = -math.inf  # a key block they skip
    yield _sample("head-bias-blocks", _call(g, **BLOCKED, bias=per_head))
