"""`seqfast::linear_cross_entropy` declared once: its schema and checks, with the fake
implementation, backward op and autograd every linear + loss op shares (`ops/linear_head.py`)."""

from __future__ import annotations

import torch

from seqcompile.ops import linear_head as head
from seqcompile.ops.cross_entropy import reference as ce
from seqcompile.ops.fused_op import Call, define, schema
from seqcompile.ops.linear_cross_entropy import kernels

Tensor = torch.Tensor
ARGUMENTS = """Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index,
    float smoothing, bool mean, int chunk, ScalarType compute_dtype, bool[] needs_grad"""
"""`needs_grad`: whether hidden, weight and bias need gradients (absent ones come back empty)."""


def _forward(call: Call) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    hidden, weight, target = call["hidden"], call["weight"], call["target"]
    if hidden.dim() != 2 or weight.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(
            "seqfast::linear_cross_entropy: hidden must be (rows, features), weight (classes,"
            f" features) and target (rows,); got {tuple(hidden.shape)}, {tuple(weight.shape)}"
            f" and {tuple(target.shape)}"
        )
    ce.check_targets(target, weight.shape[0], call["ignore_index"])
    return kernels.forward(**call)


linear_cross_entropy = define(
    "seqfast::linear_cross_entropy",
    schema(ARGUMENTS, returns="(Tensor, Tensor, Tensor, Tensor)"),
    _forward,
)
FORWARD = torch.ops.seqfast.linear_cross_entropy.default
BACKWARD = head.define_backward(linear_cross_entropy, FORWARD, "linear_cross_entropy")
