"""Whether the fused attention op can take a site as read: its operands' dtypes, devices, head dims
and layout, its biases' and masks' shapes, its dropout, and the graph between its nodes."""

from __future__ import annotations

import math

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import barrier_between, node_order, tensor_val
from seqcompile.ops.attention import op as attention_op
from seqcompile.ops.attention.layout import Layout, broadcasts_to
from seqcompile.patterns.attention.links import same_batch
from seqcompile.patterns.attention.readings import Site
from seqcompile.patterns.engine import Reject
from seqcompile.run import runtime

Tensor = torch.Tensor


def check(site: Site) -> Reject | None:
    """Why the fused op cannot take `site`, or None where it can."""
    operands = _operands(site)
    if isinstance(operands, Reject):
        return operands
    q, k, v = operands
    refused = _supported(q, k, v)
    if refused is not None:
        return refused
    try:
        layout = Layout.of(q, k, v)
    except ValueError as why:
        return Reject("{}", why)
    refused = _broadcast(site, layout.scores_shape(q, k))
    if refused is not None:
        return refused
    if site.p >= 1:
        return Reject("dropout p={} drops every probability", site.p)
    refused = _sink(site, layout.scores_shape(q, k))
    if refused is not None:
        return refused
    order = node_order(site.out.graph)
    if site.nodes and barrier_between(min(site.nodes, key=order.__getitem__), site.out):
        return Reject("grad mode, autocast or an in-place op changes inside the attention")
    return None


def _operands(site: Site) -> tuple[Tensor, Tensor, Tensor] | Reject:
    """q, k (..., Lk, D) and v as the op takes them, in the batch dimensions it runs in."""
    q, k, v = (tensor_val(n) for n in (site.q, site.k, site.v))
    if site.k_transposed:
        if k.dim() < 2:
            return Reject("the key operand of q @ k^T is 1-D")
        k = k.transpose(-1, -2)
    for factor in site.factors:
        shape = _factor_on_rows(tensor_val(factor.tensor).shape, factor.side)
        if not broadcasts_to(shape, (q if factor.side == "q" else k).shape):
            return Reject(
                "a factor {} of the scores would enlarge {} (its batch)", shape, factor.side
            )
    if site.batch_of is None:
        return q, k, v
    batch = tuple(tensor_val(site.batch_of).shape[:-2])
    if not all(_same_count(t.shape[:-2], batch) for t in (q, k, v)):
        return Reject(
            "the scores' batch dimensions are reshaped to {}, and q, k, v's cannot be shown to"
            " hold as many",
            batch,
        )
    if not same_batch(site.v, site.out):
        return Reject("the values broadcast over the probabilities' batch dimensions")
    return tuple(t.reshape(*batch, *t.shape[-2:]) for t in (q, k, v))


def _supported(q: Tensor, k: Tensor, v: Tensor) -> Reject | None:
    """Dtypes, devices and head dims the op takes."""
    for t in (q, k, v):
        if t.dtype not in attention_op.DTYPES:
            return Reject("dtype {} is not supported (float32, float16, bfloat16)", t.dtype)
        if not runtime.runs_fused_ops(t.device):
            return Reject("device {} has neither kernels nor a reference here", t.device)
    head_dim = q.shape[-1]
    if not isinstance(head_dim, int):
        return Reject("head dim {} is dynamic; the kernel needs it fixed", head_dim)
    if head_dim > attention_op.MAX_HEAD_DIM:
        return Reject("head dim {} > {}", head_dim, attention_op.MAX_HEAD_DIM)
    if v.shape[-1] != head_dim:
        return Reject("value head dim {} differs from the key head dim {}", v.shape[-1], head_dim)
    return None


def _broadcast(site: Site, scores: torch.Size) -> Reject | None:
    """Every bias, mask, document id and prefix length broadcasts to the scores where it applies."""
    documents = [site.documents.q, site.documents.kv] if site.documents is not None else []
    lengths = [site.prefix.length] if site.prefix is not None and site.prefix.length else []
    biases = [b for b, _ in site.biases] + [r.bias for r, _ in site.relative]
    for node in biases + [m for m, _ in site.keep] + documents + lengths:
        shape = tensor_val(node).shape
        frame = site.frames.get(node)
        where = scores if frame is None else (*tensor_val(frame).shape[:-2], *scores[-2:])
        if not broadcasts_to(shape, where):
            return Reject(
                "mask or bias of shape {} does not broadcast to the scores {}", shape, scores
            )
    return None


def _sink(site: Site, scores: torch.Size) -> Reject | None:
    """A sink is one floating-point logit per row of the scores, in the softmax's batch."""
    if site.sink is None:
        return None
    sink = tensor_val(site.sink)
    if site.batch_of is not None:
        return Reject("a sink's logits with the batch reshaped around the softmax")
    if not sink.is_floating_point() or not broadcasts_to(sink.shape, (*scores[:-1], 1)):
        return Reject(
            "a sink of {} {} is not one logit per row of the scores", sink.dtype, sink.shape
        )
    return None


def _factor_on_rows(shape: torch.Size, side: str) -> tuple:
    """A factor of the scores (constant along the keys for q, the queries for k) as a factor of
    the rows of q or k."""
    padded = (1,) * max(0, 2 - len(shape)) + tuple(shape)
    return padded if side == "q" else (*padded[:-2], padded[-1], padded[-2])


def _same_count(dims: tuple, other: tuple) -> bool:
    return statically_known_true(math.prod(dims) == math.prod(other))
