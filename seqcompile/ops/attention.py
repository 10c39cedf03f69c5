"""The fused attention operator `seqfast::attention` and its backward `seqfast::attention_backward`:
schema, fake implementation, kernel launch, autograd; the reference lives in
`attention_reference.py`, which also states the semantics.

    scores = g(q @ k^T * scale), g the registered score modification `score_mod` (or none)
    biased = scores + bias + rel_bias[..., 0, j - i + Lq - 1]     (query i, key j)
    out = dropout(softmax(where(mask, biased, masked_value), causal, prefix, window, docs), p) @ v

q is (..., H, Lq, D) and k, v are (..., Hk, Lk, D). Batch dimensions broadcast as matmul's do,
except that the head dimension (the third from last) may also group: H a multiple of Hk, query head
h reading key/value head h // (H / Hk), as SDPA's `enable_gqa`. The kernels see 4-D (batch, heads,
length, head_dim) views. `bias` (float, may require grad) and `mask` (bool, True where a query may
attend) broadcast to the scores (..., H, Lq, Lk) and are read through zero strides, so a padding
mask (B, 1, 1, Lk) is read as one vector per batch. `causal` and `window` (query i sees keys j <=
i, and i - j < window when window > 0) are computed from the positions, never read, and the kernels
skip the key blocks they hide; `prefix` (..., 1, 1), integers, widens causal to a prefix LM's mask:
every query also sees the keys before the prefix's length. `doc_q` (..., Lq, 1) and `doc_kv` (...,
1, Lk), document ids of the queries and keys of packed sequences, are compared in the kernel (a key
of another document takes -inf, as above the causal diagonal), which skips the blocks where no
query shares a document with a key. `rel_bias` (..., 1, Lq + Lk - 1), a bias that depends only on
the key's position less the query's (T5's relative-position buckets, ALiBi by distance), is read
per diagonal, never spread to the scores' size, and its gradient is summed per diagonal in the
kernel. q @ k^T runs in q's dtype and probs @ v in v's, with float32 accumulation. Returns `(out,
row_max, log_sum)`, out in v's dtype; the backward saves q, k, v, out and the two per-row
statistics, never the probabilities, and regenerates the dropout mask from the seed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from seqcompile.codegen import KernelSpec, copies, kernel_function
from seqcompile.fx_utils import concrete
from seqcompile.ops import attention_configs as configs
from seqcompile.ops import attention_reference as reference
from seqcompile.ops import attention_vendor as vendor
from seqcompile.ops import samples_attention, score_mods, sharding_rules
from seqcompile.ops.attention_layout import Layout, broadcasts_to
from seqcompile.ops.fused_op import Call, FusedOp, Vendor, gradients, named, needs_grad
from seqcompile.run import runtime, tuning

Tensor = torch.Tensor
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def forward_spec(**flags: bool) -> KernelSpec:
    """The forward kernel for the flags `_flags` gives."""
    return KernelSpec.of("attention_fwd", **flags)


def backward_specs(*, bias_grad: bool, rel_grad: bool = False, **flags: bool) -> list[KernelSpec]:
    return [
        DELTA,
        KernelSpec.of("attention_bwd_dkdv", **flags),
        KernelSpec.of("attention_bwd_dq", bias_grad=bias_grad, rel_grad=rel_grad, **flags),
    ]


DELTA = KernelSpec.of("attention_bwd_delta")


def _flags(call: Mapping[str, Any]) -> dict[str, bool]:
    """What the kernels are specialized on."""
    return dict(
        bias=call["bias"] is not None,
        mask=call["mask"] is not None,
        dropout=call["p"] > 0,
        causal=call["causal"],
        window=call["window"] > 0,
        score_mod=score_mods.lookup(call["score_mod"]).kernel if call["score_mod"] else (),
        documents=call["doc_q"] is not None,
        relative=call["rel_bias"] is not None,
        prefix=call["prefix"] is not None,
    )


def forward_kernels_of(call: Mapping[str, Any]) -> list[KernelSpec]:
    """The kernel an `attention` call launches (`call`: its arguments by name)."""
    return [forward_spec(**_flags(call))]


def backward_kernels_of(call: Mapping[str, Any]) -> list[KernelSpec]:
    """The kernels an `attention_backward` call launches: the row deltas, dk and dv, dq."""
    return backward_specs(bias_grad=call["bias_grad"], rel_grad=call["rel_grad"], **_flags(call))


def _products(call: Call, q_dims: int, v_dims: int) -> int:
    """FLOPs of products over the scores the kernels visit, `q_dims` of them as long as q's head
    dim and `v_dims` as v's (those causal and window hide are not counted)."""
    q, k, v = (call.value(name) for name in "qkv")
    lq, lk = concrete(q.shape[-2]), concrete(k.shape[-2])
    scores = (
        concrete(q.numel())
        // concrete(q.shape[-1])
        // max(lq, 1)
        * visible_pairs(lq, lk, call["causal"], call["window"])
    )
    return 2 * scores * concrete(q_dims * q.shape[-1] + v_dims * v.shape[-1])


def visible_pairs(lq: int, lk: int, causal: bool, window: int) -> int:
    """How many (query, key) pairs `causal` and `window` leave, top-left aligned: those with
    key - query <= 0 (all, without causal) less those with key - query <= -window."""
    kept = _pairs_below(lq, lk, 0) if causal else lq * lk
    return kept - (_pairs_below(lq, lk, -window) if window > 0 else 0)


def _pairs_below(lq: int, lk: int, diagonal: int) -> int:
    """Pairs (i, j) of an Lq x Lk grid with j - i <= `diagonal`: row i has
    clamp(i + diagonal + 1, 0, Lk) of them, 0 up to row `start`, Lk from row `full` on."""
    c = diagonal + 1
    start, full = min(max(-c, 0), lq), min(max(lk - c, 0), lq)
    return (full - start) * c + (start + full - 1) * (full - start) // 2 + (lq - full) * lk


def forward_flops(call: Call) -> int:
    """q @ k^T and probs @ v."""
    return _products(call, 1, 1)


def backward_flops(call: Call) -> int:
    """q @ k^T again, grad_out @ v^T, probs^T @ grad_out, dscores @ k and dscores^T @ q."""
    return _products(call, 3, 2)


def describe(call: Call) -> str | None:
    """The masks a call computes from positions or reads, and the key blocks its forward visits
    at the traced sizes with this device's tiles (None for plain attention)."""
    q, k = call.value("q"), call.value("k")
    causal = "causal" if call["prefix"] is None else "causal after a prefix (its keys seen by all)"
    kinds = ([causal] if call["causal"] else []) + (
        [f"sliding window {call['window']}"] if call["window"] else []
    )
    if call["score_mod"]:
        kinds.append(f"scores modified as {score_mods.lookup(call['score_mod']).description}")
    for name in ("mask", "bias"):
        if call[name] is not None:
            kinds.append(f"reads a {name} {_shape(call.value(name))}")
    if call["rel_bias"] is not None:
        kinds.append(f"reads a bias by key - query position {_shape(call.value('rel_bias'))}")
    if call["doc_q"] is not None:
        kinds.append(
            "compares document ids (skipping blocks where no query shares a key's document,"
            " which depends on the ids)"
        )
    if not kinds:
        return None
    head_dim, device = concrete(q.shape[-1]), q.device.type
    dropout = call["p"] > 0
    tiles = dict(configs.space("attention_fwd", head_dim, q.dtype, device, dropout)[0].blocks)
    lq, lk = concrete(q.shape[-2]), concrete(k.shape[-2])
    visited, total = key_blocks(lq, lk, call["causal"], call["window"], **tiles)
    tile = f"{tiles['BLOCK_M']}x{tiles['BLOCK_N']}"
    blocks = f"the forward visits {visited} of {total} {tile} blocks per head"
    if call["prefix"] is not None:
        blocks += " besides the prefix's (as many as its lengths reach past the diagonal)"
    return f"{', '.join(kinds)}; {blocks}"


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(concrete(n) for n in t.shape)


def key_blocks(
    lq: int, lk: int, causal: bool, window: int, BLOCK_M: int, BLOCK_N: int, **_: int
) -> tuple[int, int]:
    """Key blocks the forward kernel visits over all query blocks of one head, and all there
    are, with the bounds its loops take from `causal` and `window`."""
    visited = 0
    for start_m in range(0, lq, BLOCK_M):
        end = min(lk, start_m + BLOCK_M) if causal else lk
        start = max(start_m - window + 1, 0) // BLOCK_N * BLOCK_N if window else 0
        visited += max(0, -(-(end - start) // BLOCK_N))
    return visited, -(-lq // BLOCK_M) * -(-lk // BLOCK_N)


def backward_workspace(call: Call) -> int:
    """Each query row's delta, the float32 bias gradient at the scores' full size before it is
    summed to the bias's shape (when the bias needs one), and the relative bias's per (batch,
    head) (when it needs one)."""
    q, k = call.value("q"), call.value("k")
    lq, lk = concrete(q.shape[-2]), concrete(k.shape[-2])
    rows = concrete(q.numel()) // concrete(q.shape[-1])
    bias = rows * lk if call["bias_grad"] else 0
    relative = rows // max(lq, 1) * (lq + lk - 1) if call["rel_grad"] else 0
    return 4 * (rows + bias + relative)


# --------------------------------------------------------------------------------------------
# forward


@torch.library.custom_op("seqfast::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    mask: Tensor | None,
    seed: Tensor | None,
    stream: int,
    p: float,
    scale: float,
    causal: bool,
    masked_value: float,
    window: int = 0,
    score_mod: str = "",
    doc_q: Tensor | None = None,
    doc_kv: Tensor | None = None,
    rel_bias: Tensor | None = None,
    prefix: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    arguments = dict(locals())  # the schema's arguments by name (before any other local)
    impl = forward_kernels if runtime.use_kernels(q) else reference.forward
    return _forward_through(impl, arguments)


def _forward_through(impl, arguments: Mapping[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
    """The forward through `impl` (the kernels' launcher or the reference) on the 4-D views."""
    layout = _checked_layout(**arguments)
    out, row_max, log_sum = impl(**_in4(layout, arguments))
    return out.view(*layout.result_batch, *out.shape[-2:]), row_max, log_sum


def lower_forward(**arguments: Any) -> tuple[Tensor, Tensor, Tensor]:
    """The forward on CPU in plain ATen (the registry's lowering): the reference."""
    return _forward_through(reference.forward, arguments)


def vendor_forward(**arguments: Any) -> tuple[Tensor, Tensor, Tensor]:
    """The forward through SDPA's flash kernels (for the calls `vendor.refusal` accepts)."""
    return _forward_through(vendor.forward, arguments)


@attention.register_fake
@named(torch.ops.seqfast.attention.default)
def _(call: Call):
    q, k, v = (call[name] for name in "qkv")
    layout = Layout.of(q, k, v)
    rows = (layout.batch, layout.heads, q.shape[-2])
    return (
        v.new_empty((*layout.result_batch, q.shape[-2], v.shape[-1])),
        q.new_empty(rows, dtype=torch.float32),
        q.new_empty(rows, dtype=torch.float32),
    )


VIEWED = dict(
    grad_out="heads", q="heads", k="kv_heads", v="kv_heads", out="heads",
    bias=None, mask=None, doc_q=None, doc_kv=None, rel_bias=None, prefix=None,
)  # fmt: skip
"""The tensor arguments the implementations take as 4-D views, and the layout's heads each spans
(None: its own, broadcast to the scores')."""


def _in4(layout: Layout, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """An attention op's arguments, by name, as its implementations take them: tensors as 4-D
    views, the masked value and the window as the kernels can hold them."""
    views = {
        name: layout.to4(t, name, None if heads is None else getattr(layout, heads))
        for name, heads in VIEWED.items()
        if (t := arguments.get(name)) is not None
    }
    masked_value = _finite(arguments["masked_value"])
    window = _hiding(arguments["window"], arguments["q"], arguments["k"])
    return {**arguments, **views, "masked_value": masked_value, "window": window}


def _checked_layout(*, q, k, v, bias, mask, seed, p, window, **more) -> Layout:
    """The operands' layout; errors a caller can act on, raised before any kernel runs (`more`:
    the op's other arguments, by name)."""
    layout = Layout.of(q, k, v)
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"seqfast::attention: head dim {q.shape[-1]} > {MAX_HEAD_DIM}")
    scores = layout.scores_shape(q, k)
    for name, t in (("bias", bias), ("mask", mask)):
        if t is not None and not broadcasts_to(t.shape, scores):
            raise ValueError(
                f"seqfast::attention: {name} of shape {tuple(t.shape)} does not broadcast to the "
                f"scores {scores}"
            )
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(f"seqfast::attention: mask must be bool, got {mask.dtype}")
    if bias is not None and not bias.is_floating_point():
        raise ValueError(f"seqfast::attention: bias must be floating point, got {bias.dtype}")
    if p > 0 and seed is None:
        raise ValueError("seqfast::attention: dropout p > 0 needs a seed tensor")
    if window < 0:
        raise ValueError(f"seqfast::attention: window must be >= 0 (0: none), got {window}")
    _check_by_position(scores, window=window, **more)
    return layout


def _check_by_position(scores, *, doc_q, doc_kv, rel_bias, prefix, causal, window, **_) -> None:
    """Errors in the arguments read by the query's and key's positions (documents, relative
    bias, prefix), for scores of shape `scores`."""
    if (doc_q is None) != (doc_kv is None):
        raise ValueError("seqfast::attention: doc_q and doc_kv go together")
    if doc_q is not None:
        q_ok = doc_q.dim() >= 2 and doc_q.shape[-1] == 1 and broadcasts_to(doc_q.shape, scores)
        kv_ok = doc_kv.dim() >= 2 and doc_kv.shape[-2] == 1 and broadcasts_to(doc_kv.shape, scores)
        if not (q_ok and kv_ok):
            raise ValueError(
                f"seqfast::attention: document ids of shapes {tuple(doc_q.shape)} and"
                f" {tuple(doc_kv.shape)} must broadcast to the scores {scores} as (..., Lq, 1)"
                " and (..., 1, Lk)"
            )
    if rel_bias is not None:
        diagonals = (*scores[:-2], 1, scores[-2] + scores[-1] - 1)
        if not rel_bias.is_floating_point() or not broadcasts_to(rel_bias.shape, diagonals):
            raise ValueError(
                f"seqfast::attention: rel_bias must be floating point and broadcast to"
                f" {diagonals} (one value per key - query diagonal); got {rel_bias.dtype}"
                f" {tuple(rel_bias.shape)}"
            )
    if prefix is not None:
        one = (*scores[:-2], 1, 1)
        if prefix.is_floating_point() or prefix.dtype == torch.bool or prefix.dim() < 2:
            raise ValueError(f"seqfast::attention: prefix must be integers, got {prefix.dtype}")
        if not broadcasts_to(prefix.shape, one):
            raise ValueError(
                f"seqfast::attention: prefix of shape {tuple(prefix.shape)} does not broadcast"
                f" to {one} (one length per batch and head)"
            )
        if not causal or window:
            raise ValueError("seqfast::attention: a prefix widens causal (without a window)")


def _scores_shape(q: Tensor, k: Tensor) -> tuple[int, int, int, int]:
    return (q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _strides4(t: Tensor | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of `t` broadcast to the 4-D `shape` (zero along broadcast dimensions)."""
    return tuple(t.expand(shape).stride()) if t is not None else ()


def _launch(spec: KernelSpec, q: Tensor, k: Tensor, grid_of, launch, repeatable=True) -> None:
    """Launch the kernel of `spec` at the configuration chosen for q's dtype and sizes:
    `launch(config, grid)`, the grid from `grid_of(config)`."""
    b, h, lq, d = q.shape
    sizes = (q.dtype, d, *(triton.next_power_of_2(n) for n in (lq, k.shape[2], b * h)))
    dropout = dict(spec.key)["dropout"]
    space = configs.space(spec.template, d, q.dtype, q.device.type, dropout)
    tuning.launch(
        spec, sizes, space, lambda c: launch(c, grid_of(c)), q.device, repeatable=repeatable
    )


def _dot_precision(q: Tensor, v: Tensor) -> str:
    fp32 = torch.float32 in (q.dtype, v.dtype)
    if fp32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _common_args(
    *, q, k, v, bias, mask, masked_value, scale, window, doc_q, doc_kv, rel_bias, prefix, **_
) -> tuple[list, list]:
    """Pointer arguments after q, k, v and the scalar arguments shared by the three kernels (of
    the launcher's arguments, by the schema's names)."""
    shape = _scores_shape(q, k)
    pointers = [t for t in (bias, mask, doc_q, doc_kv, rel_bias, prefix) if t is not None]
    strides = [*q.stride(), *k.stride(), *v.stride(), *_strides4(bias, shape)]
    strides += [*_strides4(mask, shape)] + ([masked_value] if mask is not None else [])
    if doc_q is not None:  # (b, h, m) of the query ids, (b, h, n) of the key ids
        q_ids, kv_ids = (_strides4(t, shape) for t in (doc_q, doc_kv))
        strides += [*q_ids[:3], *kv_ids[:2], kv_ids[3]]
    if rel_bias is not None:  # (b, h, diagonal)
        rel = _strides4(rel_bias, (*shape[:2], 1, rel_bias.shape[-1]))
        strides += [*rel[:2], rel[3]]
    if prefix is not None:  # (b, h)
        strides += [*_strides4(prefix, (*shape[:2], 1, 1))[:2]]
    scalars = strides + [q.shape[1], q.shape[1] // k.shape[1], q.shape[2], k.shape[2], scale]
    return pointers, scalars + ([window] if window > 0 else [])


def _hiding(window: int, q: Tensor, k: Tensor) -> int:
    """A window at most as wide as the scores' diagonals (a wider one hides nothing), so the
    kernels' bounds from it stay in 32 bits."""
    return min(window, q.shape[-2] + k.shape[-2]) if window > 0 else window


def _finite(value: float) -> float:
    """A masked value the kernel can hold: -inf stays, finite values clamp to float32's range."""
    if value == -math.inf:
        return value
    limit = torch.finfo(torch.float32).max
    return max(-limit, min(limit, value))


def forward_kernels(
    *, q, k, v, bias, mask, seed, stream, p, scale, causal, masked_value, window=0, score_mod="",
    doc_q=None, doc_kv=None, rel_bias=None, prefix=None,
):  # fmt: skip
    k = _as_dtype(k, q.dtype)  # q @ k^T runs in q's dtype, probs @ v in v's (eager's result)
    arguments = dict(locals())  # by the schema's names (k in q's dtype)
    b, h, lq, d = q.shape
    out = runtime.empty((b, h, lq, d), v.dtype, q.device)
    row_max = runtime.empty((b, h, lq), torch.float32, q.device)
    log_sum = runtime.empty((b, h, lq), torch.float32, q.device)
    if out.numel() == 0:
        return out, row_max, log_sum
    if k.shape[2] == 0:  # no keys: every row is empty
        return out.zero_(), row_max.zero_(), log_sum.fill_(math.inf)
    (spec,) = forward_kernels_of(arguments)
    pointers, scalars = _common_args(**arguments)
    _launch(
        spec, q, k, lambda c: (triton.cdiv(lq, c["BLOCK_M"]) * b * h,),
        lambda c, grid: kernel_function(spec)[grid](
            q, k, v, *pointers, *([seed] if p > 0 else []), out, row_max, log_sum,
            *scalars, *((p, stream) if p > 0 else ()),
            HEAD_DIM=d, DOT_PRECISION=_dot_precision(q, v), **c.launch_options(),
        ),
    )  # fmt: skip
    return out, row_max, log_sum


# --------------------------------------------------------------------------------------------
# backward


@torch.library.custom_op("seqfast::attention_backward", mutates_args=())
def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    row_max: Tensor,
    log_sum: Tensor,
    bias: Tensor | None,
    mask: Tensor | None,
    seed: Tensor | None,
    stream: int,
    p: float,
    scale: float,
    causal: bool,
    masked_value: float,
    bias_grad: bool,
    window: int = 0,
    score_mod: str = "",
    doc_q: Tensor | None = None,
    doc_kv: Tensor | None = None,
    rel_bias: Tensor | None = None,
    rel_grad: bool = False,
    prefix: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dbias, drel) shaped as q, k, v, bias and rel_bias; dbias is empty
    unless `bias_grad`, drel unless `rel_grad`."""
    arguments = dict(locals())  # the schema's arguments by name (before any other local)
    impl = backward_kernels if runtime.use_kernels(q) else reference.backward
    return _backward_through(impl, arguments)


def _backward_through(impl, arguments: Mapping[str, Any]) -> tuple[Tensor, ...]:
    """The backward through `impl` on the 4-D views, gradients summed back to the operands'."""
    q, k, v, bias, rel_bias = (arguments[name] for name in ("q", "k", "v", "bias", "rel_bias"))
    layout = Layout.of(q, k, v)
    dq, dk, dv, dbias, drel = impl(**_in4(layout, arguments))
    grads = tuple(layout.from4(g, like) for g, like in ((dq, q), (dk, k), (dv, v)))
    return (
        *grads,
        layout.from4(dbias, bias) if arguments["bias_grad"] else dbias,
        layout.from4(drel, rel_bias) if arguments["rel_grad"] else drel,
    )


def lower_backward(**arguments: Any) -> tuple[Tensor, ...]:
    """The backward on CPU in plain ATen (the registry's lowering): the reference."""
    return _backward_through(reference.backward, arguments)


def vendor_backward(**arguments: Any) -> tuple[Tensor, ...]:
    """The backward through SDPA's flash kernels (for the calls `vendor.refusal` accepts)."""
    return _backward_through(vendor.backward, arguments)


@attention_backward.register_fake
@named(torch.ops.seqfast.attention_backward.default)
def _(call: Call):
    q, k, v, bias, rel_bias = (call[name] for name in ("q", "k", "v", "bias", "rel_bias"))
    dbias = bias.new_empty(bias.shape) if call["bias_grad"] else reference.no_bias_grad(q, bias)
    drel = (
        rel_bias.new_empty(rel_bias.shape)
        if call["rel_grad"]
        else reference.no_bias_grad(q, rel_bias)
    )
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, drel


def backward_kernels(
    *, grad_out, q, k, v, out, row_max, log_sum, bias, mask, seed, stream, p, scale, causal,
    masked_value, bias_grad, window=0, score_mod="", doc_q=None, doc_kv=None, rel_bias=None,
    rel_grad=False, prefix=None,
):  # fmt: skip
    arguments = dict(locals())  # by the schema's names, as the kernels read them:
    arguments.update(  # k in q's dtype, grad_out in v's, grad_out and out contiguous
        k=_as_dtype(k, q.dtype),
        grad_out=copies.for_kernel(_as_dtype(grad_out, v.dtype), "attention_backward", "grad_out"),
        out=copies.for_kernel(out, "attention_backward", "out"),
    )
    dq = runtime.empty(q.shape, q.dtype, q.device)
    dk = runtime.empty(k.shape, q.dtype, q.device)
    dv = runtime.empty(v.shape, v.dtype, q.device)
    dbias_full, drel_full = _bias_grads(**arguments)
    if q.numel() == 0 or k.shape[2] == 0:
        for t in (dq, dk, dv, dbias_full):
            if t is not None:
                t.zero_()
    else:
        _launch_backward(arguments, dq, dk, dv, dbias_full, drel_full)
    if bias_grad:
        dbias = dbias_full.sum_to_size(bias.shape).to(bias.dtype).contiguous()
    else:
        dbias = reference.no_bias_grad(q, bias)
    if rel_grad:
        drel = drel_full.unsqueeze(2).sum_to_size(rel_bias.shape).to(rel_bias.dtype)
    else:
        drel = reference.no_bias_grad(q, rel_bias)
    return dq, _as_dtype(dk, k.dtype), dv, dbias, drel


def _bias_grads(
    *, q, k, causal, window, doc_q, bias_grad, rel_grad, **_
) -> tuple[Tensor | None, Tensor | None]:
    """The float32 gradients the dq kernel writes where asked for (None elsewhere): the bias's at
    the scores' size, the relative bias's per (batch, head, diagonal)."""
    dbias_full = None
    if bias_grad:
        skips = causal or window > 0 or doc_q is not None  # (a prefix is causal's)
        make = torch.zeros if skips else runtime.empty  # skipped blocks stay 0
        dbias_full = make(_scores_shape(q, k), dtype=torch.float32, device=q.device)
    drel_full = None  # (with lq = lk = 0 there are no diagonals, and no relative bias)
    if rel_grad:
        diagonals = q.shape[2] + k.shape[2] - 1
        drel_full = torch.zeros((*q.shape[:2], diagonals), dtype=torch.float32, device=q.device)
    return dbias_full, drel_full


def _launch_backward(
    call: Mapping[str, Any], dq: Tensor, dk: Tensor, dv: Tensor, *bias_grads: Tensor | None
) -> None:
    """The row deltas, then dk and dv, then dq and the float32 bias gradients, for the
    launcher's arguments `call` by the schema's names."""
    q, k, v, grad_out, p = (call[name] for name in ("q", "k", "v", "grad_out", "p"))
    b, h, lq, d = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    delta = runtime.empty((b, h, lq), torch.float32, q.device)
    block_r = 64 if q.device.type == "cuda" else 16
    kernel_function(DELTA)[(triton.cdiv(b * h * lq, block_r),)](
        grad_out, call["out"], delta, b * h * lq,
        HEAD_DIM=d, BLOCK_D=configs.block_d(d), BLOCK_R=block_r,
    )  # fmt: skip
    _delta, dkdv_spec, dq_spec = backward_kernels_of(call)
    pointers, scalars = _common_args(**call)
    seed_args = [call["seed"]] if p > 0 else []
    dropout_args = (p, call["stream"]) if p > 0 else ()
    rows = (grad_out, call["row_max"], call["log_sum"], delta)
    constants = dict(HEAD_DIM=d, DOT_PRECISION=_dot_precision(q, v))
    _launch(
        dkdv_spec, q, k, lambda c: (triton.cdiv(lk, c["BLOCK_N"]) * b * kv_heads,),
        lambda c, grid: kernel_function(dkdv_spec)[grid](
            q, k, v, *pointers, *seed_args, *rows, dk, dv, *scalars, *dropout_args,
            **constants, **c.launch_options(),
        ),
    )  # fmt: skip
    _launch(
        dq_spec, q, k, lambda c: (triton.cdiv(lq, c["BLOCK_M"]) * b * h,),
        lambda c, grid: kernel_function(dq_spec)[grid](
            q, k, v, *pointers, *seed_args, *rows, dq, *(t for t in bias_grads if t is not None),
            *scalars, *dropout_args, **constants, **c.launch_options(),
        ),
        repeatable=bias_grads[-1] is None,  # the relative bias's gradient is added atomically
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# autograd


FORWARD = torch.ops.seqfast.attention.default
SAVED = ("q", "k", "v", "bias", "mask", "seed", "doc_q", "doc_kv", "rel_bias", "prefix")
"""The forward's arguments its backward reads as tensors (with the output and the row
statistics); the others it takes as they were given."""


def _setup_context(ctx, inputs, output):
    call = Call(FORWARD, inputs, {})
    out, row_max, log_sum = output
    ctx.mark_non_differentiable(row_max, log_sum)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*(call[name] for name in SAVED), out, row_max, log_sum)
    ctx.config = {name: value for name, value in call.items() if name not in SAVED}


def _backward(ctx, grad_out, _grad_row_max, _grad_log_sum):
    if grad_out is None:
        return gradients(FORWARD)
    *tensors, out, row_max, log_sum = ctx.saved_tensors
    saved = dict(zip(SAVED, tensors, strict=True))
    bias_grad = saved["bias"] is not None and needs_grad(ctx, FORWARD, "bias")
    rel_grad = saved["rel_bias"] is not None and needs_grad(ctx, FORWARD, "rel_bias")
    dq, dk, dv, dbias, drel = torch.ops.seqfast.attention_backward(
        grad_out, out=out, row_max=row_max, log_sum=log_sum, bias_grad=bias_grad,
        rel_grad=rel_grad, **saved, **ctx.config,
    )  # fmt: skip
    return gradients(
        FORWARD, q=dq, k=dk, v=dv, bias=dbias if bias_grad else None,
        rel_bias=drel if rel_grad else None,
    )  # fmt: skip


attention.register_autograd(_backward, setup_context=_setup_context)


ENTRY = FusedOp(
    name="attention",
    family="attention",
    forward=torch.ops.seqfast.attention.default,
    backward=(torch.ops.seqfast.attention_backward.default,),
    reference=reference.forward,
    lowering={
        torch.ops.seqfast.attention.default: lower_forward,
        torch.ops.seqfast.attention_backward.default: lower_backward,
    },
    kernels={
        torch.ops.seqfast.attention.default: forward_kernels_of,
        torch.ops.seqfast.attention_backward.default: backward_kernels_of,
    },
    sharding={
        torch.ops.seqfast.attention.default: sharding_rules.attention_forward,
        torch.ops.seqfast.attention_backward.default: sharding_rules.attention_backward,
    },
    saves="q, k, v, the output, two per-row statistics (row max, log-sum) and the biases and mask"
    " as given, never the probabilities; the dropout mask is regenerated from the seed",
    flops={
        torch.ops.seqfast.attention.default: forward_flops,
        torch.ops.seqfast.attention_backward.default: backward_flops,
    },
    workspace={torch.ops.seqfast.attention_backward.default: backward_workspace},
    describe=describe,
    vendor=Vendor(
        bodies={
            torch.ops.seqfast.attention.default: vendor_forward,
            torch.ops.seqfast.attention_backward.default: vendor_backward,
        },
        refusal=vendor.refusal,
    ),
    compared={torch.ops.seqfast.attention.default: vendor.compared},
    samples=samples_attention.samples,
    benchmark="benchmarks.attention",
)
