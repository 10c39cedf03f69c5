"""`seqfast::linear_cross_entropy` as it runs on every device: the chunked loop, each chunk's logits
formed by a matmul and turned into their gradient by the cross-entropy kernel (its reference on
CPU), taking the op's arguments by name."""

from __future__ import annotations

import torch

from seqcompile.ops import linear_head as head
from seqcompile.ops.cross_entropy import kernels as ce_kernels
from seqcompile.ops.linear_cross_entropy.cost import padded_classes

Tensor = torch.Tensor


def _logits(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """h @ w^T (+ b), its rows 16 bytes apart (the padding is never read), so that the
    cross-entropy kernel reads each row in 16-byte vectors whatever the number of classes."""
    rows = h.new_empty((h.shape[0], padded_classes(w.shape[0], h.dtype)))[:, : w.shape[0]]
    return torch.mm(h, w.t(), out=rows) if b is None else torch.addmm(b, h, w.t(), out=rows)


def forward(
    *, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, **how
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op on its arguments by name (`how`: how the loss is taken, and which gradients)."""
    ignore_index, smoothing, mean, chunk = (
        how[name] for name in ("ignore_index", "smoothing", "mean", "chunk")
    )
    compute_dtype, needs_grad = how["compute_dtype"], how["needs_grad"]
    m, vocab = hidden.shape[0], weight.shape[0]
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
        loss, _ = ce_kernels.loss_and_grad_in_place(
            logits, target[rows], scale, ignore_index, smoothing
        )
        total += loss.sum()
        if want_h:
            dh[rows] = torch.mm(logits, w)
        if want_w:
            head.add_product(dw, logits.t(), h[rows])
        if want_b:
            db += logits.sum(0, dtype=torch.float32)
    loss = total * scale if mean else total
    return loss, dh, *head.finished(weight, bias, dw, db)
