"""The generated kernels of `seqfast::attention` and its backward: which kernels a call launches
(their specialization flags) and the launchers, taking the op's arguments by name as 4-D views."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from seqcompile.codegen import KernelSpec, copies, kernel_function
from seqcompile.ops.attention import configs, reference, score_mods
from seqcompile.run import runtime, tuning

Tensor = torch.Tensor


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


def forward(*, q: Tensor, k: Tensor, v: Tensor, seed, stream, p, **others: Any):
    """The forward's kernel launched on the op's arguments by name (`others`: those only the
    kernel's flags and its scalar arguments read)."""
    k = _as_dtype(k, q.dtype)  # q @ k^T runs in q's dtype, probs @ v in v's (eager's result)
    arguments = dict(others, q=q, k=k, v=v, seed=seed, stream=stream, p=p)
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


def backward(**arguments: Any):
    """The backward's kernels launched on the op's arguments by name."""
    q, k, v, bias, rel_bias = (arguments[name] for name in ("q", "k", "v", "bias", "rel_bias"))
    bias_grad, rel_grad = arguments["bias_grad"], arguments["rel_grad"]
    arguments.update(  # as the kernels read them: k in q's dtype, grad_out in v's, grad_out
        k=_as_dtype(k, q.dtype),  # and out contiguous
        grad_out=copies.for_kernel(
            _as_dtype(arguments["grad_out"], v.dtype), "attention_backward", "grad_out"
        ),
        out=copies.for_kernel(arguments["out"], "attention_backward", "out"),
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
