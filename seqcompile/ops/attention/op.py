"""`seqfast::attention` and `seqfast::attention_backward` declared once: their schema, fake
implementations, the checks every implementation relies on, the 4-D views the implementations
take, and autograd. What they compute is in the package's docstring; the kernels are in
`kernels.py`, the reference in `reference.py`, SDPA's route in `vendor.py`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from seqcompile.ops.attention import kernels, reference, vendor
from seqcompile.ops.attention.layout import Layout, broadcasts_to
from seqcompile.ops.fused_op import Call, define, gradients, named, needs_grad, schema
from seqcompile.run import runtime

Tensor = torch.Tensor
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

ARGUMENTS = """Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor? mask, Tensor? seed, int stream,
    float p, float scale, bool causal, float masked_value, int window=0, str score_mod="",
    Tensor? doc_q=None, Tensor? doc_kv=None, Tensor? rel_bias=None, Tensor? prefix=None,
    Tensor? sink=None"""
"""The forward's arguments, which the backward also takes (see the package's docstring)."""
BACKWARD_ARGUMENTS = """Tensor out, Tensor row_max, Tensor log_sum, bool bias_grad,
    bool rel_grad=False, bool sink_grad=False"""
"""What the backward takes besides the incoming gradient `grad_out` and the forward's arguments:
what the forward returned, and which bias gradients to compute."""


# --------------------------------------------------------------------------------------------
# forward


def _forward(call: Call) -> tuple[Tensor, Tensor, Tensor]:
    impl = kernels.forward if runtime.use_kernels(call["q"]) else reference.forward
    return _forward_through(impl, call)


attention = define(
    "seqfast::attention", schema(ARGUMENTS, returns="(Tensor, Tensor, Tensor)"), _forward
)
FORWARD = torch.ops.seqfast.attention.default


def _forward_through(
    impl: Callable[..., Any], arguments: Mapping[str, Any]
) -> tuple[Tensor, Tensor, Tensor]:
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
@named(FORWARD)
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
    bias=None, mask=None, doc_q=None, doc_kv=None, rel_bias=None, prefix=None, sink=None,
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
    if not 0 <= p <= 1:
        raise ValueError(f"seqfast::attention: dropout p must be in [0, 1], got {p}")
    if p > 0 and seed is None:
        raise ValueError("seqfast::attention: dropout p > 0 needs a seed tensor")
    if window < 0:
        raise ValueError(f"seqfast::attention: window must be >= 0 (0: none), got {window}")
    _check_by_position(scores, window=window, **more)
    return layout


def _check_by_position(
    scores, *, doc_q, doc_kv, rel_bias, prefix, causal, window, sink=None, **_
) -> None:
    """Errors in the arguments read by the query's and key's positions (documents, relative
    bias, prefix) or per query (the sink), for scores of shape `scores`."""
    if sink is not None:
        rows = (*scores[:-1], 1)
        if not sink.is_floating_point() or not broadcasts_to(sink.shape, rows):
            raise ValueError(
                f"seqfast::attention: sink must be floating point and broadcast to {rows} (one"
                f" logit per query); got {sink.dtype} {tuple(sink.shape)}"
            )
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


# --------------------------------------------------------------------------------------------
# backward


def _backward(call: Call) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dbias, drel, dsink) shaped as q, k, v, bias, rel_bias and sink; dbias is
    empty unless `bias_grad`, drel unless `rel_grad`, dsink unless `sink_grad`."""
    impl = kernels.backward if runtime.use_kernels(call["q"]) else reference.backward
    return _backward_through(impl, call)


attention_backward = define(
    "seqfast::attention_backward",
    schema(
        "Tensor grad_out",
        ARGUMENTS,
        BACKWARD_ARGUMENTS,
        returns="(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    ),  # fmt: skip
    _backward,
)
BACKWARD = torch.ops.seqfast.attention_backward.default


def _backward_through(impl: Callable[..., Any], arguments: Mapping[str, Any]) -> tuple[Tensor, ...]:
    """The backward through `impl` on the 4-D views, gradients summed back to the operands'."""
    q, k, v = (arguments[name] for name in "qkv")
    layout = Layout.of(q, k, v)
    dq, dk, dv, *biases = impl(**_in4(layout, arguments))
    grads = tuple(layout.from4(g, like) for g, like in ((dq, q), (dk, k), (dv, v)))
    return *grads, *(
        layout.from4(grad, arguments[name]) if arguments[f"{flag}_grad"] else grad
        for grad, (name, flag) in zip(biases, BIASES, strict=True)
    )


def lower_backward(**arguments: Any) -> tuple[Tensor, ...]:
    """The backward on CPU in plain ATen (the registry's lowering): the reference."""
    return _backward_through(reference.backward, arguments)


def vendor_backward(**arguments: Any) -> tuple[Tensor, ...]:
    """The backward through SDPA's flash kernels (for the calls `vendor.refusal` accepts)."""
    return _backward_through(vendor.backward, arguments)


@attention_backward.register_fake
@named(BACKWARD)
def _(call: Call):
    q, k, v = (call[name] for name in "qkv")
    biases = [
        call[name].new_empty(call[name].shape)
        if call[f"{flag}_grad"]
        else reference.no_bias_grad(q, call[name])
        for name, flag in BIASES
    ]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), *biases


BIASES = (("bias", "bias"), ("rel_bias", "rel"), ("sink", "sink"))
"""The learned terms of the scores whose gradients the backward returns after dq, dk and dv (the
argument, and the prefix of the flag that asks for its gradient)."""


# --------------------------------------------------------------------------------------------
# autograd


SAVED = ("q", "k", "v", "bias", "mask", "seed", "doc_q", "doc_kv", "rel_bias", "prefix", "sink")
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
    asked = {
        f"{flag}_grad": saved[name] is not None and needs_grad(ctx, FORWARD, name)
        for name, flag in BIASES
    }
    dq, dk, dv, *biases = BACKWARD(
        grad_out, out=out, row_max=row_max, log_sum=log_sum, **asked, **saved, **ctx.config
    )
    learned = {
        name: grad if asked[f"{flag}_grad"] else None
        for grad, (name, flag) in zip(biases, BIASES, strict=True)
    }
    return gradients(FORWARD, q=dq, k=dk, v=dv, **learned)


attention.register_autograd(_backward, setup_context=_setup_context)
