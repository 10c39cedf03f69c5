"""The lowering of `seqfast::linear_cross_entropy` in plain ATen: the op's chunks, unrolled at the
traced sizes and written functionally (the op itself, run on CPU, is the reference)."""

from __future__ import annotations

import torch

from seqcompile.ops import linear_head as head
from seqcompile.ops.cross_entropy import reference as ce

Tensor = torch.Tensor


def lower_forward(
    *, hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, **how
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`linear_cross_entropy` on CPU in plain ATen (the registry's lowering): the op's chunks,
    unrolled at the traced sizes, written functionally (the gradients of the hidden states
    joined, the weight's and bias's summed), the targets checked by an op in the graph."""
    ignore_index, smoothing, mean, chunk = (
        how[name] for name in ("ignore_index", "smoothing", "mean", "chunk")
    )
    compute_dtype, needs_grad = how["compute_dtype"], how["needs_grad"]
    m, d = hidden.shape
    target = ce.checked_targets(target, weight.shape[0], ignore_index)
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    want_h, want_w, want_b = needs_grad
    count = (target != ignore_index).sum()
    scale = (1.0 / count).float() if mean else torch.ones((), device=hidden.device)
    dw = None  # the first chunk's product, then each later one added onto it (no zero fill)
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
            loss, lse = ce.forward(logits, target[start:end], ignore_index, smoothing)
            dlogits = ce.logits_grad(
                logits, target[start:end], lse, scale.expand(end - start), ignore_index, smoothing
            )
        total = total + loss.sum()
        if want_h:
            dhs.append(torch.mm(dlogits, w))
        if want_w:
            a, b_rows = dlogits.t().float(), rows.float()
            dw = torch.mm(a, b_rows) if dw is None else torch.addmm(dw, a, b_rows)
        if want_b:
            db = db + dlogits.sum(0, dtype=torch.float32)
    if want_h:
        dh = torch.cat(dhs).to(hidden.dtype) if dhs else hidden.new_empty((m, d))
    else:
        dh = hidden.new_empty((0,))
    if dw is None:
        dw = torch.zeros(weight.shape if want_w else (0,), device=weight.device)
    loss = total * scale if mean else total
    return loss, dh, *head.finished(weight, bias, dw, db)
