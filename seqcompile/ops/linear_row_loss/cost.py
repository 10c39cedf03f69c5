"""What a call of `seqfast::linear_row_loss` allocates while it runs, and what the report says of
it."""

from __future__ import annotations

import torch

from seqcompile.fx.nodes import concrete
from seqcompile.ops import linear_head as head
from seqcompile.ops.fused_op import Call
from seqcompile.ops.linear_row_loss import program


def workspace_bytes(call: Call) -> int:
    """Bytes a call allocates and frees while it runs, beyond its outputs, at the traced sizes:
    per chunk, the logits and the chunk-sized values of the program's joint live at once and
    `dlogits @ weight`, and the casts `head.cast_bytes` counts."""
    hidden, weight = call.value("hidden"), call.value("weight")
    d, vocab = concrete(hidden.shape[1]), concrete(weight.shape[0])
    size = torch.empty((), dtype=call["compute_dtype"]).element_size()
    chunk_tensors = 1 + program.lookup(call["program"]).chunk_tensors
    hidden_part = d if head.wanted(call)["hidden"] else 0
    return head.chunk_rows(call) * (chunk_tensors * vocab + hidden_part) * size + head.cast_bytes(
        call
    )


def describe(call: Call) -> str:
    loss_program = program.lookup(call["program"])
    return (
        f"{loss_program.num_terms} sum(s) over the rows, {loss_program.num_rows} per-row"
        f" input(s), chunks of {head.chunk_rows(call)} rows"
    )
