"""Reference implementation of `seqfast::attention` and its backward in plain ATen: the test oracle
for the kernels and what runs on CPU without the interpreter.

It materializes the scores, so it is exact where the kernels are tiled, and defines the semantics
the kernels follow: scores `q @ k^T * scale`, modified by the registered element-wise function
`score_mod` when given, plus `bias`, plus `rel_bias` (..., 1, Lq + Lk - 1) at key - query + Lq - 1
(a bias that depends only on the key's position less the query's); positions the boolean `mask`
rejects take `masked_value`; positions above the diagonal (causal) but for keys before the
`prefix`, keys `window` or more positions before the query (a sliding window, when `window` > 0)
and keys of another document than the query's (`doc_kv` unlike `doc_q`) take -inf; then
softmax, over each row's scores and its `sink` logit where given (a term of the denominator with
no value), and dropout (attention's own stream, `dropout.py`). A row whose every score is -inf gives
zero output and zero gradients (as torch's SDPA defines it); a row filled with a finite
`masked_value` averages over all keys (as eager softmax does). `forward` and `backward` take the
op's arguments by the names of its schema, the operands as their 4-D views.
"""

from __future__ import annotations

import math

import torch

from seqcompile.ops.attention import dropout, score_mods

Tensor = torch.Tensor


def expand_heads(t: Tensor, heads: int) -> Tensor:
    """Key/value heads repeated for the query heads that share them (grouped-query attention)."""
    if t.shape[1] == heads:  # (no heads at all included)
        return t
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def diagonal_keep(
    rows: int, cols: int, causal: bool, window: int, device: torch.device
) -> Tensor | None:
    """Where query i may see key j, top-left aligned: j <= i when `causal`, i - j < `window`
    when `window` > 0; None when both are off."""
    if not causal and window <= 0:
        return None
    i = torch.arange(rows, device=device)[:, None]
    j = torch.arange(cols, device=device)[None, :]
    keep = torch.ones((), dtype=torch.bool, device=device)
    if causal:
        keep = keep & (j <= i)
    if window > 0:
        keep = keep & (i - j < window)
    return keep.expand(rows, cols)


def diagonals(rows: int, cols: int, device: torch.device) -> Tensor:
    """Index of each score's diagonal in a relative bias: key - query + rows - 1, (rows, cols)."""
    i = torch.arange(rows, device=device)[:, None]
    return torch.arange(cols, device=device)[None, :] - i + rows - 1


def relative_scores(rel_bias: Tensor, rows: int, cols: int) -> Tensor:
    """A relative bias (..., 1, rows + cols - 1) spread over the scores (..., rows, cols)."""
    return rel_bias[..., 0, :][..., diagonals(rows, cols, rel_bias.device)]


def relative_grad(ds: Tensor, rel_bias: Tensor) -> Tensor:
    """The gradient of a relative bias: the scores' gradients summed along each diagonal (and over
    what the bias broadcasts), shaped as `rel_bias`."""
    rows, cols = ds.shape[-2:]
    index = diagonals(rows, cols, ds.device).flatten().expand(*ds.shape[:-2], rows * cols)
    sums = ds.new_zeros((*ds.shape[:-2], rows + cols - 1))
    sums.scatter_add_(-1, index, ds.flatten(-2))
    return sums.unsqueeze(-2).sum_to_size(rel_bias.shape).to(rel_bias.dtype)


def scores(
    *,
    q: Tensor,
    k: Tensor,
    bias: Tensor | None,
    mask: Tensor | None,
    scale: float,
    causal: bool,
    masked_value: float,
    window: int = 0,
    score_mod: str = "",
    doc_q: Tensor | None = None,
    doc_kv: Tensor | None = None,
    rel_bias: Tensor | None = None,
    prefix: Tensor | None = None,
    **_: object,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """float32 scores after the score modification, biases, mask, causal and window, where each
    query may attend, and the modification's derivative (None without one); the op's other
    arguments are ignored."""
    s = q.float() @ expand_heads(k, q.shape[1]).float().transpose(-1, -2) * scale
    slope = None
    if score_mod:
        s, slope = score_mods.apply(score_mod, s)
    if bias is not None:
        s = s + bias.float()
    if rel_bias is not None:
        s = s + relative_scores(rel_bias.float(), *s.shape[-2:])
    attend = torch.ones((), dtype=torch.bool, device=q.device).expand(s.shape)
    if mask is not None:
        s = s.masked_fill(~mask, masked_value)
        attend = attend & mask
    if doc_q is not None:
        same = doc_q == doc_kv
        s = s.masked_fill(~same, -math.inf)
        attend = attend & same
    keep = diagonal_keep(s.shape[-2], s.shape[-1], causal, window, q.device)
    if prefix is not None:  # (B, H, 1, 1): keys before it are seen by every query
        keep = keep | (torch.arange(s.shape[-1], device=q.device) < prefix)
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
        attend = attend & keep
    return s, attend, slope


def row_statistics(s: Tensor, sink: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-row max and log of the sum of `exp(s - max)`, over the row's `sink` logit too where
    given ((..., Lq, 1)); (0, +inf) for rows of -inf only, so that `exp(s - max - log_sum)` is the
    softmax and is 0 on such rows."""
    if sink is not None:
        s = torch.cat([s, sink.float().expand(*s.shape[:-1], 1)], -1)
    if s.shape[-1] == 0:  # no keys at all: every row is empty
        return s.new_zeros(s.shape[:-1]), s.new_full(s.shape[:-1], math.inf)
    row_max = s.amax(-1)
    empty = row_max == -math.inf
    row_max = row_max.masked_fill(empty, 0.0)
    log_sum = torch.log(torch.exp(s - row_max[..., None]).sum(-1)).masked_fill(empty, math.inf)
    return row_max, log_sum


def probabilities(s: Tensor, row_max: Tensor, log_sum: Tensor) -> Tensor:
    return torch.exp(s - row_max[..., None] - log_sum[..., None])


def dropout_scale(
    shape: torch.Size, seed: Tensor | None, stream: int, p: float, device: torch.device
) -> Tensor | None:
    """Per-score multiplier of dropout (0 or 1/(1-p)), by attention's stream (`dropout.py`)."""
    if p == 0:
        return None
    keep = dropout.keep_mask(seed.to(device), shape, stream, p)
    return keep.float() / (1.0 - p)


def forward(
    *, q: Tensor, v: Tensor, seed, stream, p, sink=None, **others
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward on the op's arguments by name (`others`: those only `scores` reads)."""
    s, _, _ = scores(q=q, **others)
    row_max, log_sum = row_statistics(s, sink)
    prob = probabilities(s, row_max, log_sum)
    drop = dropout_scale(s.shape, seed, stream, p, q.device)
    if drop is not None:
        prob = prob * drop
    out = prob @ expand_heads(v, q.shape[1]).float()
    return out.to(v.dtype).contiguous(), row_max, log_sum


def no_bias_grad(q: Tensor, bias: Tensor | None) -> Tensor:
    """The empty tensor the backward returns in place of a bias gradient nobody asked for."""
    return q.new_empty((0,), dtype=bias.dtype if bias is not None else q.dtype)


def sum_heads(grad: Tensor, kv_heads: int) -> Tensor:
    """Gradient per query head summed over the query heads that share a key/value head."""
    b, h, length, d = grad.shape
    if h == kv_heads:  # (no heads at all included)
        return grad
    return grad.view(b, kv_heads, h // kv_heads, length, d).sum(2)


def sink_grad(sink: Tensor, row_max: Tensor, log_sum: Tensor, delta: Tensor) -> Tensor:
    """The gradient of the sink logits (..., Lq, 1): minus each row's sink probability times its
    delta (grad_out . out, (..., Lq)), summed to the sink's shape."""
    prob = torch.exp(sink.float() - (row_max + log_sum)[..., None])
    return (-prob * delta[..., None]).sum_to_size(sink.shape).to(sink.dtype)


def backward(*, q: Tensor, k: Tensor, v: Tensor, **others) -> tuple[Tensor, ...]:
    """The backward on the op's arguments by name."""
    s, attend, slope = scores(q=q, k=k, **others)
    grad_out, out, row_max, log_sum, seed, stream, p, scale, bias, rel_bias = (
        others[name]
        for name in (
            "grad_out", "out", "row_max", "log_sum", "seed", "stream", "p", "scale", "bias",
            "rel_bias",
        )
    )  # fmt: skip
    bias_grad, rel_grad = others["bias_grad"], others["rel_grad"]
    prob = probabilities(s, row_max, log_sum)
    drop = dropout_scale(s.shape, seed, stream, p, q.device)
    dropped = prob if drop is None else prob * drop
    do = grad_out.float()
    heads, kv_heads = q.shape[1], k.shape[1]
    dv = dropped.transpose(-1, -2) @ do
    dp = do @ expand_heads(v, heads).float().transpose(-1, -2)
    if drop is not None:
        dp = dp * drop
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = torch.where(attend, prob * (dp - delta), 0.0)
    dbias = ds.sum_to_size(bias.shape).to(bias.dtype) if bias_grad else no_bias_grad(q, bias)
    drel = relative_grad(ds, rel_bias) if rel_grad else no_bias_grad(q, rel_bias)
    sink = others.get("sink")
    if others.get("sink_grad"):
        dsink = sink_grad(sink, row_max, log_sum, delta[..., 0])
    else:
        dsink = no_bias_grad(q, sink)
    if slope is not None:
        ds = ds * slope
    dq = ds @ expand_heads(k, heads).float() * scale
    dk = ds.transpose(-1, -2) @ q.float() * scale
    return (
        dq.to(q.dtype),
        sum_heads(dk, kv_heads).to(k.dtype),
        sum_heads(dv, kv_heads).to(v.dtype),
        dbias.contiguous(),
        drel.contiguous(),
        dsink.contiguous(),
    )
