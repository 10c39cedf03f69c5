"""Readers of layer_norm and rms_norm written out:

- layer_norm: `(x - mean(x, dims, keepdim=True)) * rsqrt(v + eps)` (any variance v: `var`,
  `((x - mu) ** 2).mean`), then a weight and a bias over the normalized dims;
- rms_norm: `x * rsqrt(v + eps)` (v: `(x ** 2).mean`), then a weight.

Each gives a `Candidate`, a reason it is not one, or None."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import (
    arg,
    is_call,
    only_user,
    rank_of,
    same_shape,
    tensor_val,
)
from seqcompile.normalize.candidate import MAX_DEPTH, Candidate, from_only

aten = torch.ops.aten

_REDUCTIONS = (aten.mean.dim, aten.var.correction, aten.var.dim, aten.sum.dim_IntList)


def _reduced_dims(node: Any, rank: int, depth: int = MAX_DEPTH) -> list[int] | None:
    """The dims of the first reduction found walking up from `node` (the variance's)."""
    if not isinstance(node, Node) or depth == 0:
        return None
    if is_call(node, *_REDUCTIONS):
        dims = arg(node, 1, "dim")
        if isinstance(dims, list | tuple) and all(isinstance(d, int) for d in dims):
            return sorted(d % rank for d in dims)
        return None
    for i in node.all_input_nodes:
        found = _reduced_dims(i, rank, depth - 1)
        if found is not None:
            return found
    return None


def _norm_parts(node: Any) -> tuple[Node, Node | None, Node | None] | None:
    """(core, weight, bias) where `node` is `core * weight + bias` (each optional, a bias only
    after a weight), the core `h * rsqrt(v + eps)`."""
    weight = bias = None
    if is_call(node, aten.add.Tensor) and arg(node, 2, "alpha", 1) == 1:
        node, bias = _vector_operand(node)
    if is_call(node, aten.mul.Tensor) and _rsqrt_operand(node) is None:
        node, weight = _vector_operand(node)
        if weight is None:
            return None
    if bias is not None and weight is None or _rsqrt_operand(node) is None:
        return None
    return node, weight, bias


def _vector_operand(node: Node) -> tuple[Any, Node | None]:
    """(the other operand, the vector) of a binary op one of whose operands is a vector over
    the last dims of the other; (None, None) where neither is."""
    out = tensor_val(node)
    for a, b in (node.args[:2], node.args[1::-1]):
        if rank_of(a) is not None and rank_of(b) is not None and same_shape(tensor_val(a), out):
            value = tensor_val(b)
            if value is not None and value.is_floating_point() and 0 < value.dim() < out.dim():
                if all(
                    statically_known_true(v == o)
                    for v, o in zip(value.shape, out.shape[out.dim() - value.dim() :], strict=True)
                ):
                    return a, b
    return None, None


def _rsqrt_operand(node: Any) -> Node | None:
    """The `rsqrt(v + eps)` factor of a product."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for a in node.args[:2]:
        if is_call(a, aten.rsqrt.default) and is_call(a.args[0], aten.add.Tensor):
            if arg(a.args[0], 2, "alpha", 1) == 1:
                return a
    return None


def norm(node: Node) -> Candidate | str | None:
    """`h * rsqrt(v + eps)`: layer_norm where h is `x - mean(x, dims, keepdim=True)`, rms_norm
    where h is x; then a weight (and for layer_norm a bias) over the normalized dims. A product
    whose only reader extends it by a weight or bias is read from that reader."""
    parts = _norm_parts(node)
    if parts is None:
        return None
    extended = _norm_parts(only_user(node))
    if extended is not None and extended[0] is parts[0]:
        return None
    core, weight, bias = parts
    r = _rsqrt_operand(core)
    h = core.args[1] if core.args[0] is r else core.args[0]
    v, eps = r.args[0].args[:2]
    if isinstance(v, int | float):
        v, eps = eps, v
    if not isinstance(eps, int | float) or isinstance(eps, bool) or not isinstance(v, Node):
        return None
    rank = rank_of(h)
    if rank is None:
        return None
    layer = is_call(h, aten.sub.Tensor) and is_call(h.args[1], aten.mean.dim)
    x = h.args[0] if layer else h
    if rank_of(x) != rank or layer and h.args[1].args[0] is not x or not layer and bias is not None:
        return None
    dims = _reduced_dims(h.args[1] if layer else v, rank)
    if dims is None or not from_only(v, x):
        return None
    if dims != list(range(rank - len(dims), rank)):
        name = "layer_norm" if layer else "rms_norm"
        return f"{name} written out normalizes over dims {dims}; the norms take the last ones"
    shape = list(tensor_val(x).shape[rank - len(dims) :])
    if weight is not None and not all(
        statically_known_true(w == d) for w, d in zip(tensor_val(weight).shape, shape, strict=False)
    ):
        return None
    eps = float(eps)
    operands = tuple(n for n in (x, weight, bias) if n is not None)
    parts_text = f"{x.name}, {shape}" + "".join(f", {n.name}" for n in operands[1:])
    reduced = tuple(range(rank - len(dims), rank))
    if layer:
        return Candidate(
            "layer_norm", node, operands, reduced,
            lambda t, *wb: F.layer_norm(t, t.shape[reduced[0] :], *wb, eps=eps),
            lambda ctx: ctx.call(
                aten.layer_norm.default, x, [ctx.size(x, d) for d in reduced], weight, bias, eps
            ),
            f"layer_norm({parts_text}, eps={eps:g})",
        )  # fmt: skip
    return Candidate(
        "rms_norm", node, operands, reduced,
        lambda t, *w: F.rms_norm(t, t.shape[reduced[0] :], *w, eps=eps),
        lambda ctx: ctx.call(
            aten.rms_norm.default, x, [ctx.size(x, d) for d in reduced], weight, eps
        ),
        f"rms_norm({parts_text}, eps={eps:g})",
    )  # fmt: skip
