"""`seqfast::linear_row_loss` declared once: its schema, with the fake implementation, backward op
and autograd every linear + loss op shares (`ops/linear_head.py`)."""

from __future__ import annotations

import torch

from seqcompile.ops import linear_head as head
from seqcompile.ops.fused_op import Call, define, schema
from seqcompile.ops.linear_row_loss import reference

Tensor = torch.Tensor
ARGUMENTS = """Tensor hidden, Tensor weight, Tensor? bias, Tensor[] rows, Tensor[] consts,
    Tensor[] post, str program, int chunk, ScalarType compute_dtype, bool[] needs_grad"""
"""`needs_grad`: whether hidden, weight and bias need gradients (absent ones come back empty)."""


def _forward(call: Call) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return reference.chunked(True, **call)


linear_row_loss = define(
    "seqfast::linear_row_loss",
    schema(ARGUMENTS, returns="(Tensor, Tensor, Tensor, Tensor)"),
    _forward,
)
FORWARD = torch.ops.seqfast.linear_row_loss.default
BACKWARD = head.define_backward(linear_row_loss, FORWARD, "linear_row_loss")
