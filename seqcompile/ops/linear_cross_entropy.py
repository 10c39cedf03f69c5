"""The fused linear + cross-entropy operator `seqfast::linear_cross_entropy`, which never builds the
full logits, and its backward `seqfast::linear_cross_entropy_backward`.

    linear_cross_entropy(hidden (M, D), weight (V, D), bias (V,)?, target (M,), ignore_index,
                         smoothing, mean, chunk, compute_dtype, needs_grad)
        -> (loss (), dhidden, dweight, dbias)

walks the tokens in chunks of `chunk` rows. Per chunk it forms the logits in `compute_dtype` (the
linear's dtype, autocast's included), computes each row's loss and overwrites the logits with their
gradient (one kernel), then adds the chunk's share of the gradients: `dlogits @ weight` into
`dhidden`, `dlogits^T @ hidden` into a float32 weight gradient, and column sums into a float32 bias
gradient. The loss is the sum over non-ignored rows, divided by their count (kept on the device)
when `mean`. The gradients are those of this loss; the backward only multiplies them by the
incoming gradient, so the loss can be scaled, summed with other terms or divided for gradient
accumulation. Peak extra memory is one chunk of logits.
"""

from __future__ import annotations

import torch

from seqcompile.fx_utils import concrete
from seqcompile.ops import cross_entropy as ce
from seqcompile.ops import linear_head as head
from seqcompile.ops import samples_loss, sharding_rules
from seqcompile.ops.fused_op import Call, FusedOp

Tensor = torch.Tensor


def workspace_bytes(call: Call) -> int:
    """Bytes a call allocates and frees while it runs, beyond its outputs, at the traced sizes (for
    the memory model): one chunk of logits (rows padded to 16 bytes) and of `dlogits @ weight`
    (where the hidden states need a gradient), and the casts `head.cast_bytes` counts."""
    hidden, weight = call.value("hidden"), call.value("weight")
    d, vocab = concrete(hidden.shape[1]), concrete(weight.shape[0])
    size = torch.empty((), dtype=call["compute_dtype"]).element_size()
    width = padded_classes(vocab, call["compute_dtype"])
    step = head.chunk_rows(call)
    hidden_part = d if head.wanted(call)["hidden"] else 0
    return step * (width + hidden_part) * size + head.cast_bytes(call)


def padded_classes(classes: int, dtype: torch.dtype) -> int:
    """The row length of a chunk of logits: the classes, padded to a multiple of 16 bytes."""
    per_vector = 16 // torch.empty((), dtype=dtype).element_size()
    return -(-classes // per_vector) * per_vector


def _logits(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """h @ w^T (+ b), its rows 16 bytes apart (the padding is never read), so that the
    cross-entropy kernel reads each row in 16-byte vectors whatever the number of classes."""
    rows = h.new_empty((h.shape[0], padded_classes(w.shape[0], h.dtype)))[:, : w.shape[0]]
    return torch.mm(h, w.t(), out=rows) if b is None else torch.addmm(b, h, w.t(), out=rows)


@torch.library.custom_op("seqfast::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    smoothing: float,
    mean: bool,
    chunk: int,
    compute_dtype: torch.dtype,
    needs_grad: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`needs_grad`: whether hidden, weight and bias need gradients (absent ones come back
    empty)."""
    m, vocab = hidden.shape[0], weight.shape[0]
    if hidden.dim() != 2 or weight.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(
            "seqfast::linear_cross_entropy: hidden must be (rows, features), weight (classes,"
            f" features) and target (rows,); got {tuple(hidden.shape)}, {tuple(weight.shape)}"
            f" and {tuple(target.shape)}"
        )
    ce.check_targets(target, vocab, ignore_index)
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    want_h, want_w, want_b = needs_grad
    count = (target != ignore_index).sum()
    scale = (1.0 / count).float() if mean else torch.ones((), device=hidden.device)
    dh, dw, db = head.gradient_buffers(hidden, weight, needs_grad)
    total = torch.zeros((), device=hidden.device)
    for start, end in head.chunks(m, vocab, chunk):
        rows = slice(start, end)
        logits = _logits(h[rows], w, b)
        loss, _ = ce.loss_and_grad_in_place(logits, target[rows], scale, ignore_index, smoothing)
        total += loss.sum()
        if want_h:
            dh[rows] = torch.mm(logits, w)
        if want_w:
            head.add_product(dw, logits.t(), h[rows])
        if want_b:
            db += logits.sum(0, dtype=torch.float32)
    loss = total * scale if mean else total
    return loss, dh, *head.finished(weight, bias, dw, db)


def lower_forward(
    hidden, weight, bias, target, ignore_index, smoothing, mean, chunk, compute_dtype, needs_grad
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`linear_cross_entropy` on CPU in plain ATen (the registry's lowering): the op's chunks,
    unrolled at the traced sizes, written functionally (the gradients of the hidden states
    joined, the weight's and bias's summed), the targets checked by an op in the graph."""
    m, d = hidden.shape
    target = ce.checked_targets(target, weight.shape[0], ignore_index)
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    want_h, want_w, want_b = needs_grad
    count = (target != ignore_index).sum()
    scale = (1.0 / count).float() if mean else torch.ones((), device=hidden.device)
    dw = torch.zeros(weight.shape if want_w else (0,), device=weight.device)
    db = torch.zeros((weight.shape[0],) if want_b else (0,), device=weight.device)
    total = torch.zeros((), device=hidden.device)
    dhs = []
    for start, end in head.chunks(m, weight.shape[0], chunk):
        rows = h[start:end]
        logits = torch.mm(rows, w.t()) if b is None else torch.addmm(b, rows, w.t())
        if weight.shape[0] == 0:  # no classes: every target is ignored, no gradient to write
            loss, _ = ce.over_no_classes(end - start, smoothing, logits.device)
            dlogits = logits
        else:
            loss, lse = ce.reference_rows(logits, target[start:end], ignore_index, smoothing)
            dlogits = ce.reference_grad(
                logits, target[start:end], lse, scale.expand(end - start), ignore_index, smoothing
            )
        total = total + loss.sum()
        if want_h:
            dhs.append(torch.mm(dlogits, w))
        if want_w:
            dw = torch.addmm(dw, dlogits.t().float(), rows.float())
        if want_b:
            db = db + dlogits.sum(0, dtype=torch.float32)
    if want_h:
        dh = torch.cat(dhs).to(hidden.dtype) if dhs else hidden.new_empty((m, d))
    else:
        dh = hidden.new_empty((0,))
    loss = total * scale if mean else total
    return loss, dh, *head.finished(weight, bias, dw, db)


FORWARD = torch.ops.seqfast.linear_cross_entropy.default
BACKWARD = head.define_backward(linear_cross_entropy, FORWARD, "linear_cross_entropy")


ENTRY = FusedOp(
    name="linear_cross_entropy",
    family="loss",
    forward=FORWARD,
    backward=(BACKWARD,),
    reference=linear_cross_entropy,
    lowering={
        FORWARD: lower_forward,
        BACKWARD: head.scaled,
    },
    kernels={
        FORWARD: lambda call: [ce.spec("forward_grad", call["smoothing"])],
        BACKWARD: lambda call: [],
    },
    sharding={
        FORWARD: sharding_rules.linear_loss_forward,
        BACKWARD: sharding_rules.linear_loss_backward,
    },
    saves=head.SAVES,
    flops={FORWARD: head.flops},
    workspace={FORWARD: workspace_bytes},
    accumulate=head.accumulate,
    samples=samples_loss.linear_cross_entropy_samples,
    benchmark="benchmarks.loss",
)
