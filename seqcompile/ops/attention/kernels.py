"""The generated kernels of `seqfast::attention` and its backward: which kernels a call launches
(their specialization flags) and the launchers, taking the op's arguments by name as 4-D views."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton

from seqcompile.codegen import KernelSpec, kernel_function, tuning
from seqcompile.codegen.tuning import Config
from seqcompile.ops.attention import block_lists, configs, reference, score_mods
from seqcompile.ops.attention.block_lists import BLOCKS
from seqcompile.ops.attention.layout import scores_shape4, strides4
from seqcompile.ops.fused_op import Call
from seqcompile.run import copies, runtime

Tensor = torch.Tensor


def forward_spec(*, sink: bool = False, **flags: bool) -> KernelSpec:
    """The forward kernel for the flags `_flags` gives, starting each row from a sink logit with
    `sink` (the backward needs no flag for it: the row statistics hold it)."""
    return KernelSpec.of("attention_fwd", sink=sink, **flags)


def backward_specs(
    *, bias_grad: bool, rel_grad: bool = False, one_launch: bool = False, **flags: bool
) -> list[KernelSpec]:
    """The backward's kernels for the flags `_flags` gives, in launch order: the row deltas, then
    dk, dv and dq in one launch (`one_launch`); or dq, making the row deltas in its prologue,
    then dk and dv."""
    grads = dict(bias_grad=bias_grad, rel_grad=rel_grad)
    if one_launch:
        return [DELTA, KernelSpec.of("attention_bwd_dkdv", mode="with_dq", **grads, **flags)]
    return [
        KernelSpec.of("attention_bwd_dq", **grads, **flags),
        KernelSpec.of("attention_bwd_dkdv", **flags),
    ]


ONE_LAUNCH = Config.of(ONE_LAUNCH=1)
TWO_LAUNCHES = Config.of(ONE_LAUNCH=0)


def backward_variants(q: Tensor) -> list[Config]:
    """How the backward on queries `q` may run, default first: dk, dv and dq in one launch, each
    key block adding its share of dq atomically (FlashAttention-2's way: five matrix products,
    each dropout mask drawn once), or dk and dv, then dq from its own launch (seven products, the
    probabilities made twice); the device measures which is faster, the default by head dim and
    dtype (`configs.one_launch_first`). Under deterministic algorithms only the second: float
    atomics add in any order."""
    if torch.are_deterministic_algorithms_enabled():
        return [TWO_LAUNCHES]
    both = [ONE_LAUNCH, TWO_LAUNCHES]
    return both if configs.one_launch_first(q.shape[-1], q.dtype) else both[::-1]


DELTA = KernelSpec.of("attention_bwd_delta")


def _flags(call: Mapping[str, Any]) -> dict[str, bool]:
    """What the kernels are specialized on."""
    return dict(
        bias=call["bias"] is not None,
        mask=call["mask"] is not None,
        blocks=block_lists.walked(call),
        dropout=call["p"] > 0,
        causal=call["causal"],
        window=call["window"] > 0,
        score_mod=score_mods.lookup(call["score_mod"]).kernel if call["score_mod"] else (),
        documents=call["doc_q"] is not None,
        relative=call["rel_bias"] is not None,
        prefix=call["prefix"] is not None,
    )


def forward_kernels_of(call: Mapping[str, Any]) -> list[KernelSpec]:
    """The kernels an `attention` call launches (`call`: its arguments by name): the block
    lists where the kernels walk them, and the forward."""
    flags = _flags(call)
    return [BLOCKS] * flags["blocks"] + [forward_spec(sink=call["sink"] is not None, **flags)]


def backward_kernels_of(call: Call) -> list[KernelSpec]:
    """The kernels an `attention_backward` call launches by default (`backward_variants`), in
    order (`backward_specs`), each but the row deltas' after its block lists where the kernels
    walk them."""
    flags = _flags(call)
    one_launch = backward_variants(call.value("q"))[0] == ONE_LAUNCH
    specs = backward_specs(
        bias_grad=call["bias_grad"], rel_grad=call["rel_grad"], one_launch=one_launch, **flags
    )
    lists = [BLOCKS] if flags["blocks"] else []
    return [kernel for spec in specs for kernel in ([] if spec == DELTA else lists) + [spec]]


def _sizes(q: Tensor, k: Tensor) -> tuple:
    """The tuning key of a launch on q and k: dtype, head dim, and the sizes rounded up to powers
    of two."""
    b, h, lq, d = q.shape
    return (q.dtype, d, *(triton.next_power_of_2(n) for n in (lq, k.shape[2], b * h)))


def _launch(spec: KernelSpec, q: Tensor, k: Tensor, grid_of, launch, repeatable=True) -> None:
    """Launch the kernel of `spec` at the configuration chosen for q's dtype and sizes:
    `launch(config, grid)`, the grid from `grid_of(config)`."""
    dropout = dict(spec.key)["dropout"]
    space = configs.space(spec.name, q.shape[3], q.dtype, q.device.type, dropout)
    tuning.launch(
        spec, _sizes(q, k), space, lambda c: launch(c, grid_of(c)), q.device, repeatable=repeatable
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
    shape = scores_shape4(q, k)
    pointers = [t for t in (bias, mask, doc_q, doc_kv, rel_bias, prefix) if t is not None]
    strides = [*q.stride(), *k.stride(), *v.stride(), *strides4(bias, shape)]
    strides += [*strides4(mask, shape)] + ([masked_value] if mask is not None else [])
    if doc_q is not None:  # (b, h, m) of the query ids, (b, h, n) of the key ids
        q_ids, kv_ids = (strides4(t, shape) for t in (doc_q, doc_kv))
        strides += [*q_ids[:3], *kv_ids[:2], kv_ids[3]]
    if rel_bias is not None:  # (b, h, diagonal)
        rel = strides4(rel_bias, (*shape[:2], 1, rel_bias.shape[-1]))
        strides += [*rel[:2], rel[3]]
    if prefix is not None:  # (b, h)
        strides += [*strides4(prefix, (*shape[:2], 1, 1))[:2]]
    scalars = strides + [q.shape[1], q.shape[1] // k.shape[1], q.shape[2], k.shape[2], scale]
    return pointers, scalars + ([window] if window > 0 else [])


def forward(*, q: Tensor, k: Tensor, v: Tensor, seed, stream, p, **others: Any):
    """The forward's kernel launched on the op's arguments by name (`others`: those only the
    kernel's flags and its scalar arguments read)."""
    k = _as_dtype(k, q.dtype)  # q @ k^T runs in q's dtype, probs @ v in v's (eager's result)
    arguments = dict(others, q=q, k=k, v=v, seed=seed, stream=stream, p=p)
    _check_plane(arguments)
    b, h, lq, d = q.shape
    out = runtime.empty((b, h, lq, d), v.dtype, q.device)
    row_max = runtime.empty((b, h, lq), torch.float32, q.device)
    log_sum = runtime.empty((b, h, lq), torch.float32, q.device)
    if out.numel() == 0:
        return out, row_max, log_sum
    if k.shape[2] == 0:  # no keys: every row is empty
        return out.zero_(), row_max.zero_(), log_sum.fill_(math.inf)
    spec = forward_kernels_of(arguments)[-1]
    pointers, scalars = _common_args(**arguments)
    sink = arguments.get("sink")
    sinks = [] if sink is None else [sink]  # (b, h, m) strides of each query's logit
    sink_strides = strides4(sink, (b, h, lq, 1))[:3]
    _launch(
        spec, q, k, lambda c: (triton.cdiv(lq, c["BLOCK_M"]) * b * h,),
        lambda c, grid: kernel_function(spec)[grid](
            q, k, v, *pointers, *sinks,
            *block_lists.arguments(arguments, c["BLOCK_M"], c["BLOCK_N"]),
            *([seed] if p > 0 else []), out, row_max, log_sum,
            *scalars, *((p, stream) if p > 0 else ()), *sink_strides,
            HEAD_DIM=d, DOT_PRECISION=_dot_precision(q, v), **c.launch_options(),
        ),
    )  # fmt: skip
    return out, row_max, log_sum


def _check_plane(call: Mapping[str, Any]) -> None:
    """The kernels index the scores of one (batch, head) of a mask, a bias and its gradient in 32
    bits: an error a caller can act on where a plane has 2**31 scores or more."""
    lq, lk = call["q"].shape[2], call["k"].shape[2]
    if (call["bias"] is not None or call["mask"] is not None) and lq * lk >= 2**31:
        raise ValueError(
            f"seqfast::attention: {lq} x {lk} scores per head with a mask or bias; the kernels "
            "take fewer than 2**31 per head (a mask or bias that large is 2**31 elements itself)"
        )


def backward(**arguments: Any):
    """The backward's kernels launched on the op's arguments by name."""
    q, k, v, bias, rel_bias = (arguments[name] for name in ("q", "k", "v", "bias", "rel_bias"))
    bias_grad, rel_grad = arguments["bias_grad"], arguments["rel_grad"]
    _check_plane(arguments)
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
    sink = arguments.get("sink")
    if q.numel() == 0 or k.shape[2] == 0:  # (no values: every output row and delta is 0)
        for t in (dq, dk, dv, dbias_full):
            if t is not None:
                t.zero_()
        dsink = None if sink is None else torch.zeros_like(sink)
    else:
        delta = _launch_backward(arguments, dq, dk, dv, dbias_full, drel_full)
        row_max, log_sum = arguments["row_max"], arguments["log_sum"]
        dsink = None if sink is None else reference.sink_grad(sink, row_max, log_sum, delta)
    if bias_grad:
        dbias = dbias_full.sum_to_size(bias.shape).to(bias.dtype).contiguous()
    else:
        dbias = reference.no_bias_grad(q, bias)
    if rel_grad:
        drel = drel_full.unsqueeze(2).sum_to_size(rel_bias.shape).to(rel_bias.dtype)
    else:
        drel = reference.no_bias_grad(q, rel_bias)
    if not arguments.get("sink_grad"):
        dsink = reference.no_bias_grad(q, sink)
    return dq, _as_dtype(dk, k.dtype), dv, dbias, drel, dsink


def _bias_grads(**call: Any) -> tuple[Tensor | None, Tensor | None]:
    """The float32 gradients the dq kernel writes where asked for (None elsewhere): the bias's at
    the scores' size, the relative bias's per (batch, head, diagonal)."""
    q, k, causal, window, doc_q = (call[n] for n in ("q", "k", "causal", "window", "doc_q"))
    bias_grad, rel_grad = call["bias_grad"], call["rel_grad"]
    dbias_full = None
    if bias_grad:
        skips = causal or window > 0 or doc_q is not None  # (a prefix is causal's)
        skips = skips or block_lists.skip_empty(call)
        make = torch.zeros if skips else runtime.empty  # skipped blocks stay 0
        dbias_full = make(scores_shape4(q, k), dtype=torch.float32, device=q.device)
    drel_full = None  # (with lq = lk = 0 there are no diagonals, and no relative bias)
    if rel_grad:
        diagonals = q.shape[2] + k.shape[2] - 1
        drel_full = torch.zeros((*q.shape[:2], diagonals), dtype=torch.float32, device=q.device)
    return dbias_full, drel_full


def _launch_backward(
    call: Mapping[str, Any], dq: Tensor, dk: Tensor, dv: Tensor, *bias_grads: Tensor | None
) -> Tensor:
    """The row deltas, dk, dv, dq and the float32 bias gradients in the way the device measures
    fastest (`backward_variants`), for the launcher's arguments `call` by the schema's names;
    returns the deltas (grad_out . out per row)."""
    q, k = call["q"], call["k"]
    delta = runtime.empty(q.shape[:3], torch.float32, q.device)
    launches = _BackwardLaunches(call, delta, dq, dk, dv, [t for t in bias_grads if t is not None])
    flags = _flags(call)
    tuning.launch(
        KernelSpec.of("attention_backward", **flags, bias_grad=call["bias_grad"]),
        _sizes(q, k), backward_variants(q),
        lambda variant: launches.one() if variant == ONE_LAUNCH else launches.two(),
        q.device, repeatable=launches.repeatable,
    )  # fmt: skip
    return delta


class _BackwardLaunches:
    """The two ways of launching the backward's kernels, into the row deltas, dq, dk, dv and the
    bias gradients."""

    def __init__(self, call: Mapping[str, Any], delta: Tensor, dq, dk, dv, bias_grads) -> None:
        self.call, self.dq, self.dk, self.dv, self.bias_grads = call, dq, dk, dv, bias_grads
        q, v, p = call["q"], call["v"], call["p"]
        self.pointers, self.scalars = _common_args(**call)
        self.seed = [call["seed"]] if p > 0 else []
        self.dropout = (p, call["stream"]) if p > 0 else ()
        self.delta = delta
        self.rows = (call["grad_out"], call["row_max"], call["log_sum"], delta)
        self.constants = dict(HEAD_DIM=q.shape[3], DOT_PRECISION=_dot_precision(q, v))
        self.repeatable = not call["rel_grad"]  # the relative bias's gradient is added atomically

    def _specs(self, one_launch: bool) -> list[KernelSpec]:
        call = self.call
        return backward_specs(
            bias_grad=call["bias_grad"], rel_grad=call["rel_grad"], one_launch=one_launch,
            **_flags(call),
        )  # fmt: skip

    def _dkdv(self, spec: KernelSpec, *dq_outputs: Tensor) -> None:
        """The dk/dv kernel of `spec`, its outputs followed by `dq_outputs` (the first, dq in
        float32, zeroed before each launch: the kernel adds into it)."""
        q, k, v, call = self.call["q"], self.call["k"], self.call["v"], self.call
        b, kv_heads, lk = k.shape[0], k.shape[1], k.shape[2]

        def launch(c: Config, grid: tuple[int]) -> None:
            if dq_outputs:
                dq_outputs[0].zero_()
            kernel_function(spec)[grid](
                q, k, v, *self.pointers,
                *block_lists.arguments(call, c["BLOCK_N"], c["BLOCK_M"], keys=True),
                *self.seed, *self.rows, self.dk, self.dv, *dq_outputs, *self.scalars,
                *self.dropout, **self.constants, **c.launch_options(),
            )  # fmt: skip

        def grid_of(c: Config) -> tuple[int]:
            return (triton.cdiv(lk, c["BLOCK_N"]) * b * kv_heads,)

        _launch(spec, q, k, grid_of, launch, repeatable=self.repeatable or not dq_outputs)

    def one(self) -> None:
        """The row deltas, then dk, dv and dq in one launch: dq added in float32 (into dq itself
        when it is float32), then rounded to its dtype."""
        delta_spec, spec = self._specs(True)
        grad_out, out = self.call["grad_out"], self.call["out"]
        rows, d = self.delta.numel(), grad_out.shape[3]
        block_r = 64 if grad_out.device.type == "cuda" else 16
        kernel_function(delta_spec)[(triton.cdiv(rows, block_r),)](
            grad_out, out, self.delta, rows, HEAD_DIM=d, BLOCK_D=configs.block_d(d), BLOCK_R=block_r
        )
        dq = self.dq
        total = (
            dq if dq.dtype == torch.float32 else runtime.empty(dq.shape, torch.float32, dq.device)
        )
        self._dkdv(spec, total, *self.bias_grads)
        if total is not dq:
            dq.copy_(total)

    def two(self) -> None:
        """dq, the row deltas and the bias gradients, then dk and dv."""
        dq_spec, dkdv_spec = self._specs(False)
        q, k, v, call = self.call["q"], self.call["k"], self.call["v"], self.call
        b, h, lq = q.shape[:3]
        grad_out, row_max, log_sum = call["grad_out"], call["row_max"], call["log_sum"]
        _launch(
            dq_spec, q, k, lambda c: (triton.cdiv(lq, c["BLOCK_M"]) * b * h,),
            lambda c, grid: kernel_function(dq_spec)[grid](
                q, k, v, *self.pointers, *block_lists.arguments(call, c["BLOCK_M"], c["BLOCK_N"]),
                *self.seed, grad_out, call["out"], row_max, log_sum, self.delta, self.dq,
                *self.bias_grads, *self.scalars, *self.dropout, **self.constants,
                **c.launch_options(),
            ),
            repeatable=self.repeatable,
        )  # fmt: skip
        self._dkdv(dkdv_spec)
