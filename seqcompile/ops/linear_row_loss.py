"""The fused linear + row-wise loss operator `seqfast::linear_row_loss`, which never builds the
full logits, and its backward `seqfast::linear_row_loss_backward`.

    linear_row_loss(hidden (M, D), weight (V, D), bias (V,)?, rows [(M, ...)], consts, post,
                    program, chunk, compute_dtype, needs_grad)
        -> (loss (), dhidden, dweight, dbias)

computes any loss the loss pattern reads as math on each row of the logits plus an affine
function of sums over the rows (cross-entropy with a z-loss, soft-capped logits, masked classes,
KL or JSD against a teacher's logits, ...): `program` names its traced graphs (`ops/row_loss.py`).
`rows` are the per-row inputs (targets, a teacher's logits, a mask), sliced with the chunks;
`consts` are read whole by every chunk; `post` are the other inputs of the loss's final affine
step (a count of targets).

Per chunk of `chunk` rows it forms the logits in `compute_dtype`, runs the program's joint (the
chunk's sums and the gradient by the logits of the loss they make), and adds the chunk's share
of the gradients as `seqfast::linear_cross_entropy` does. The loss's gradient by each sum is known
before the first chunk (the loss is affine in them), so each chunk's gradient is final and only
one chunk of logits (and of the joint's temporaries) is ever live. The backward multiplies the
gradients by the incoming gradient of the loss.
"""

from __future__ import annotations

import torch

from seqcompile.fx_utils import concrete
from seqcompile.ops import linear_head as head
from seqcompile.ops import row_loss, samples_row_loss, sharding_rules
from seqcompile.ops.fused_op import Call, FusedOp

Tensor = torch.Tensor


def _check(hidden: Tensor, weight: Tensor, rows: list[Tensor], program: row_loss.RowLoss) -> None:
    shapes_ok = hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1]
    if not shapes_ok or any(r.dim() == 0 or r.shape[0] != hidden.shape[0] for r in rows):
        raise ValueError(
            "seqfast::linear_row_loss: hidden must be (rows, features), weight (classes,"
            " features) and each per-row input (rows, ...); got"
            f" {tuple(hidden.shape)}, {tuple(weight.shape)} and {[tuple(r.shape) for r in rows]}"
        )
    if len(rows) != program.num_rows:
        raise ValueError(
            f"seqfast::linear_row_loss: the program takes {program.num_rows} per-row inputs;"
            f" got {len(rows)}"
        )


def _forward(
    hidden, weight, bias, rows, consts, post, program, chunk, compute_dtype, needs_grad, in_place
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op, writing the hidden-state and weight gradients in place (`in_place`) or, for the
    lowering, functionally."""
    loss_program = row_loss.lookup(program)
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


@torch.library.custom_op("seqfast::linear_row_loss", mutates_args=())
def linear_row_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    rows: list[Tensor],
    consts: list[Tensor],
    post: list[Tensor],
    program: str,
    chunk: int,
    compute_dtype: torch.dtype,
    needs_grad: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`needs_grad`: whether hidden, weight and bias need gradients (absent ones come back
    empty)."""
    return _forward(
        hidden, weight, bias, rows, consts, post, program, chunk, compute_dtype, needs_grad, True
    )


def lower_forward(
    hidden, weight, bias, rows, consts, post, program, chunk, compute_dtype, needs_grad
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`linear_row_loss` on CPU in plain ATen (the registry's lowering): the op's chunks, unrolled
    at the traced sizes, written functionally."""
    return _forward(
        hidden, weight, bias, rows, consts, post, program, chunk, compute_dtype, needs_grad, False
    )


FORWARD = torch.ops.seqfast.linear_row_loss.default
BACKWARD = head.define_backward(linear_row_loss, FORWARD, "linear_row_loss")


def workspace_bytes(call: Call) -> int:
    """Bytes a call allocates and frees while it runs, beyond its outputs, at the traced sizes:
    per chunk, the logits and the chunk-sized values of the program's joint live at once and
    `dlogits @ weight`, and the casts `head.cast_bytes` counts."""
    hidden, weight = call.value("hidden"), call.value("weight")
    d, vocab = concrete(hidden.shape[1]), concrete(weight.shape[0])
    size = torch.empty((), dtype=call["compute_dtype"]).element_size()
    chunk_tensors = 1 + row_loss.lookup(call["program"]).chunk_tensors
    hidden_part = d if head.wanted(call)["hidden"] else 0
    return head.chunk_rows(call) * (chunk_tensors * vocab + hidden_part) * size + head.cast_bytes(
        call
    )


def _describe(call: Call) -> str:
    program = row_loss.lookup(call["program"])
    return (
        f"{program.num_terms} sum(s) over the rows, {program.num_rows} per-row input(s), chunks"
        f" of {head.chunk_rows(call)} rows"
    )


ENTRY = FusedOp(
    name="linear_row_loss",
    family="loss",
    forward=FORWARD,
    backward=(BACKWARD,),
    reference=linear_row_loss,
    lowering={FORWARD: lower_forward, BACKWARD: head.scaled},
    kernels={FORWARD: lambda call: [], BACKWARD: lambda call: []},
    sharding={
        FORWARD: sharding_rules.row_program,
        BACKWARD: sharding_rules.linear_loss_backward,
    },
    saves=head.SAVES,
    flops={FORWARD: head.flops},
    workspace={FORWARD: workspace_bytes},
    accumulate=head.accumulate,
    samples=samples_row_loss.samples,
    benchmark="benchmarks.loss",
    describe=_describe,
)
