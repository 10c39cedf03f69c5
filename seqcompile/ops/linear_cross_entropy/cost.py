"""What a call of `seqfast::linear_cross_entropy` allocates while it runs, and what the report says
of it."""

from __future__ import annotations

import torch

from seqcompile.fx.nodes import concrete
from seqcompile.ops import linear_head as head
from seqcompile.ops.fused_op import Call


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


def describe(call: Call) -> str:
    """The chunks a call walks, at the traced sizes."""
    return f"chunks of {head.chunk_rows(call)} rows"
