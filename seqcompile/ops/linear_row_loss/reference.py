"""`seqfast::linear_row_loss` in plain ATen, as it runs on every device (the loss's program is
traced ATen) and, written functionally, as its lowering: the chunked loop, each chunk's logits
formed by a matmul and handed to the program's joint."""

from __future__ import annotations

import torch

from seqcompile.ops import linear_head as head
from seqcompile.ops.linear_row_loss import program

Tensor = torch.Tensor


def _check(
    hidden: Tensor, weight: Tensor, rows: list[Tensor], loss_program: program.RowLoss
) -> None:
    shapes_ok = hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1]
    if not shapes_ok or any(r.dim() == 0 or r.shape[0] != hidden.shape[0] for r in rows):
        raise ValueError(
            "seqfast::linear_row_loss: hidden must be (rows, features), weight (classes,"
            " features) and each per-row input (rows, ...); got"
            f" {tuple(hidden.shape)}, {tuple(weight.shape)} and {[tuple(r.shape) for r in rows]}"
        )
    if len(rows) != loss_program.num_rows:
        raise ValueError(
            f"seqfast::linear_row_loss: the program takes {loss_program.num_rows} per-row inputs;"
            f" got {len(rows)}"
        )


def chunked(
    in_place: bool, *, hidden: Tensor, weight: Tensor, bias: Tensor | None, rows: list[Tensor],
    **how,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The op on its arguments by name (`how`: the program, its other inputs, the chunks and
    which gradients), writing the hidden-state and weight gradients in place (`in_place`) or,
    for the lowering, functionally."""
    consts, post, chunk = how["consts"], how["post"], how["chunk"]
    compute_dtype, needs_grad = how["compute_dtype"], how["needs_grad"]
    loss_program = program.lookup(how["program"])
    _check(hidden, weight, rows, loss_program)
    m, d = hidden.shape
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    want_h, want_w, want_b = needs_grad
    zeros = torch.zeros(loss_program.num_terms, device=hidden.device)
    weights = loss_program.weights(zeros, *post)
    terms, pieces = zeros, []
    dh, dw, db = head.gradient_buffers(hidden, weight, needs_grad)
    for start, end in head.chunks(m, weight.shape[0], chunk):
        h_rows = h[start:end]
        logits = torch.mm(h_rows, w.t()) if b is None else torch.addmm(b, h_rows, w.t())
        chunk_rows = [r[start:end] for r in rows]
        dlogits, chunk_terms = loss_program.joint(logits, *chunk_rows, *consts, weights)
        terms = terms + chunk_terms
        if want_h and in_place:
            dh[start:end] = torch.mm(dlogits, w)
        elif want_h:
            pieces.append(torch.mm(dlogits, w).to(hidden.dtype))
        if want_w and in_place:
            head.add_product(dw, dlogits.t(), h_rows)
        elif want_w:
            dw = torch.addmm(dw, dlogits.t().float(), h_rows.float())
        if want_b:
            db = db + dlogits.sum(0, dtype=torch.float32)
    if want_h and not in_place:
        dh = torch.cat(pieces) if pieces else hidden.new_empty((m, d))
    loss = loss_program.post(terms, *post).float().reshape(())
    return loss, dh, *head.finished(weight, bias, dw, db)


def lower_forward(**arguments) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`linear_row_loss` on CPU in plain ATen (the registry's lowering): the op's chunks, unrolled
    at the traced sizes, written functionally."""
    return chunked(False, **arguments)
