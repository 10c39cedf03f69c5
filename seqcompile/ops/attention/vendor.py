"""`seqfast::attention`'s vendor implementation: the calls SDPA's fused kernels can express (no
mask, bias or position rule beyond causal, no dropout, every operand in one dtype) run through
`aten._scaled_dot_product_flash_attention` and its backward on CUDA (FlashAttention-2), and the
CPU flash kernels of ATen on CPU. Each body is plain ATen that the executor compiles as it
compiles a lowering (`lower/inline.py`), taking the op's arguments by name with the operands as
their 4-D views.

The row statistics travel as the op defines them: only `row_max + log_sum` (the log-sum-exp of
each row) is read by any backward, so the vendor's forward returns its log-sum-exp as `row_max`
and zeros as `log_sum`, and its backward reads the sum; a forward of one implementation and a
backward of another agree. Dropout is refused: the vendor draws its own random stream, so its
answer would depend on which implementation the measurement chose."""

from __future__ import annotations

import torch

from seqcompile.fx.nodes import concrete
from seqcompile.ops.attention.reference import expand_heads, no_bias_grad, sum_heads
from seqcompile.ops.fused_op import Call

Tensor = torch.Tensor
aten = torch.ops.aten

CUDA_DTYPES = (torch.float16, torch.bfloat16)
"""What FlashAttention-2 computes in."""
CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256

_POSITION_RULES = (
    ("mask", "a boolean mask"),
    ("bias", "an additive bias"),
    ("rel_bias", "a bias by key - query position"),
    ("doc_q", "document ids"),
    ("prefix", "a prefix"),
    ("sink", "an attention sink's logit"),
)


def refusal(call: Call) -> str | None:
    """Why SDPA's fused kernels cannot compute the attention (or attention backward) call
    `call` as the op defines it; None where they can."""
    for name, what in _POSITION_RULES:
        if call[name] is not None:
            return f"it reads {what}, which SDPA's flash kernels do not take"
    if call["score_mod"]:
        return "it modifies the scores, which SDPA's flash kernels do not"
    if call["window"]:
        return "it has a sliding window, which SDPA's flash kernels do not"
    if call["p"] > 0:
        return (
            "it drops scores out, and SDPA draws another random stream than the op's, so the"
            " answer would depend on the implementation chosen"
        )
    q, k, v = (call.value(name) for name in "qkv")
    if not q.dtype == k.dtype == v.dtype:
        return f"its operands mix dtypes ({q.dtype}, {k.dtype}, {v.dtype})"
    lq, lk, head_dim = (concrete(n) for n in (q.shape[-2], k.shape[-2], q.shape[-1]))
    if min(lq, lk, concrete(q.numel())) == 0:
        return "it is empty"
    if call["causal"] and lq != lk:
        return f"it is causal with {lq} queries and {lk} keys (SDPA's flash kernels: square only)"
    return _device_refusal(q.device, q.dtype, head_dim)


def _device_refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if device.type == "cuda":
        if dtype not in CUDA_DTYPES:
            return f"FlashAttention computes in float16 or bfloat16, not {dtype}"
        if head_dim % 8 or head_dim > MAX_HEAD_DIM:
            return f"FlashAttention takes head dims, multiples of 8, up to 256; not {head_dim}"
        return None
    if device.type == "cpu":
        return None if dtype in CPU_DTYPES else f"ATen's CPU flash kernel does not take {dtype}"
    return f"no vendor kernel on the {device.type} device"


def forward(*, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, **_: object):
    """(out, log-sum-exp as the row max, zeros as the log-sum) on the 4-D views; the op's other
    arguments are those `refusal` accepts."""
    k, v = (_unit_last(expand_heads(t, q.shape[1])) for t in (k, v))
    q = _unit_last(q)
    if q.device.type == "cuda":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
    lse = lse.float().contiguous()
    return out.contiguous(), lse, torch.zeros_like(lse)


def backward(
    *, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, row_max: Tensor,
    log_sum: Tensor, bias: Tensor | None, rel_bias: Tensor | None, sink: Tensor | None,
    scale: float, causal: bool, **_: object,
):  # fmt: skip
    """(dq, dk, dv, and the empty bias gradients) on the 4-D views, from any forward's row
    statistics."""
    kv_heads = k.shape[1]
    k, v = (_unit_last(expand_heads(t, q.shape[1])) for t in (k, v))
    q, out = _unit_last(q), _unit_last(out)
    grad_out = _unit_last(grad_out.to(v.dtype))
    lse = row_max + log_sum
    if q.device.type == "cuda":
        seed, offset = (  # (read only with dropout)
            torch.zeros(shape, dtype=torch.int64, device=q.device) for shape in ((2,), ())
        )
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed,
            offset, scale=scale,
        )  # fmt: skip
    else:
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    return (
        dq.contiguous(),
        sum_heads(dk, kv_heads).contiguous(),
        sum_heads(dv, kv_heads).contiguous(),
        no_bias_grad(q, bias),
        no_bias_grad(q, rel_bias),
        no_bias_grad(q, sink),
    )


def _unit_last(t: Tensor) -> Tensor:
    """`t`, copied where its last dimension is not contiguous (the flash kernels' one demand)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def compared(outputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The forward's results as two implementations must agree on them: the output, and each
    row's log-sum-exp (`row_max + log_sum`, the one statistic a backward reads)."""
    out, row_max, log_sum = outputs
    return out, row_max + log_sum
