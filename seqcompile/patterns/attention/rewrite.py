"""Building the fused call for a site: q and k times the factors they take, everything reshaped to
the softmax's batch dimensions, the biases and masks combined, and `seqfast::attention` in place."""

from __future__ import annotations

import logging
import math

import torch
from torch.fx import Node

from seqcompile.fx.evaluate import MAX_ELEMENTS, Evaluator, traced_sizes
from seqcompile.fx.nodes import concrete, erase_unused, insert_getitem, is_call, tensor_val
from seqcompile.ops import attention as attention_op
from seqcompile.ops.attention import block_lists, cost
from seqcompile.ops.fused_op import Call
from seqcompile.patterns.attention.readings import Site
from seqcompile.patterns.attention.relative_bias import per_diagonal
from seqcompile.patterns.engine import FuseContext, Rewrite

aten = torch.ops.aten
log = logging.getLogger("seqcompile")


def rewrite(site: Site) -> Rewrite:
    def apply(ctx: FuseContext) -> Node:
        out_val = tensor_val(site.out)
        with ctx.gm.graph.inserting_before(site.out):
            fused = ctx.call_fused(
                attention_op.ENTRY.forward, **_arguments(ctx, site, out_val.device)
            )
            _note_listed_blocks(ctx, fused)
            out = insert_getitem(ctx.gm.graph, fused, 0)
            if site.batch_of is not None:  # back to the values' batch dimensions (checked equal)
                sizes = ctx.sizes(site.v, _batch_dims(site.v)) + ctx.sizes(out, (-2, -1))
                out = ctx.call(aten.reshape.default, out, sizes)
            if tensor_val(out).dtype != out_val.dtype:
                out = ctx.call(aten.to.dtype, out, out_val.dtype)
        out = ctx.in_layout_of(out, out_val)
        site.out.replace_all_uses_with(out)
        erase_unused([site.out, *site.nodes])
        return fused

    return apply


def _note_listed_blocks(ctx: FuseContext, fused: Node) -> None:
    """Where the tensor the kernels' block lists classify is computed from the model's parameters
    and buffers alone (nanoGPT's triangle in a buffer), what the forward's lists hold at its
    compile-time value, for the report (`cost.LISTED`); the lists are still made on each call."""
    call = Call.of(fused)
    if not ctx.static_values or not block_lists.walked(call):
        return
    listed = call["bias"] if block_lists.of_bias(call) else call["mask"]
    if concrete(tensor_val(listed).numel()) > MAX_ELEMENTS:
        return
    value = Evaluator(given=ctx.static_values).value(listed, traced_sizes([listed]))
    if not isinstance(value, torch.Tensor):
        return
    try:
        counted = cost.listed_blocks(call, value.cpu())
    except (RuntimeError, ValueError) as error:  # (a note of the report: never a failed fusion)
        log.debug("seqfast: the block lists of %s are not counted: %s", fused.name, error)
        return
    fused.meta["custom"] = {**fused.meta.get("custom", {}), cost.LISTED: counted}


def _arguments(ctx: FuseContext, site: Site, device: torch.device) -> dict[str, object]:
    """The fused op's arguments, their nodes inserted at the graph's insertion point."""
    q, k, v = _scaled(ctx, site, site.q, "q"), _scaled(ctx, site, site.k, "k"), site.v
    if site.batch_of is not None:
        q, k, v = (_in_batch(ctx, n, site.batch_of) for n in (q, k, v))
    k = ctx.call(aten.transpose.int, k, -2, -1) if site.k_transposed else k
    bias, mask = _combined_bias(ctx, site), _combined_mask(ctx, site)
    seed = ctx.seed(device) if site.p > 0 else None
    stream = ctx.next_stream() if site.p > 0 else 0
    masked_value = site.masked_value if site.masked_value is not None else -math.inf
    return dict(
        q=q,
        k=k,
        v=v,
        bias=bias,
        mask=mask,
        seed=seed,
        stream=stream,
        p=site.p,
        scale=site.scale,
        causal=site.causal,
        masked_value=masked_value,
        window=site.window,
        score_mod=site.score_mod,
        doc_q=site.documents.q if site.documents else None,
        doc_kv=site.documents.kv if site.documents else None,
        rel_bias=_relative_bias(ctx, site),
        prefix=_prefix_length(ctx, site, device),
        sink=site.sink,
    )


def _scaled(ctx: FuseContext, site: Site, operand: Node, side: str) -> Node:
    """`operand` (`site.q` or `site.k`) times the factors of the scores it takes, in its own
    dtype."""
    dtype = tensor_val(operand).dtype
    for factor in site.factors:
        if factor.side != side:
            continue
        tensor = factor.tensor
        for _ in range(2 - tensor_val(tensor).dim()):
            tensor = ctx.call(aten.unsqueeze.default, tensor, 0)
        if side == "k" and not site.k_transposed:  # k is (..., Lk, D), the factor (..., 1, Lk)
            tensor = ctx.call(aten.transpose.int, tensor, -2, -1)
        product = aten.div.Tensor if factor.divides else aten.mul.Tensor
        operand = ctx.call(product, operand, tensor)
        if tensor_val(operand).dtype != dtype:
            operand = ctx.call(aten.to.dtype, operand, dtype)
    return operand


def _in_batch(ctx: FuseContext, node: Node, batch_of: Node, frame: Node | None = None) -> Node:
    """`node` reshaped to the batch dimensions of `batch_of`: from its own, or, for a bias or
    mask, from those of `frame`, the scores where it applies (over which it is expanded first)."""
    if frame is not None:
        rank = tensor_val(node).dim()
        rows = [1] * max(0, 2 - rank) + ctx.sizes(node, range(max(0, rank - 2), rank))
        node = ctx.call(aten.expand.default, node, [*ctx.sizes(frame, _batch_dims(frame)), *rows])
    return ctx.call(
        aten.reshape.default,
        node,
        [*ctx.sizes(batch_of, _batch_dims(batch_of)), *ctx.sizes(node, (-2, -1))],
    )


def _batch_dims(node: Node) -> range:
    return range(tensor_val(node).dim() - 2)


def _combined_bias(ctx: FuseContext, site: Site) -> Node | None:
    total = None
    for bias, factor in site.biases:
        frame = site.frames.get(bias)
        if not tensor_val(bias).is_floating_point():  # a boolean mask added as 0 and 1
            bias = ctx.call(aten.to.dtype, bias, torch.float32)
        if frame is not None:
            bias = _in_batch(ctx, bias, site.batch_of, frame)
        if factor != 1.0:
            bias = ctx.call(aten.mul.Tensor, bias, factor)
        total = bias if total is None else ctx.call(aten.add.Tensor, total, bias)
    return total


def _combined_mask(ctx: FuseContext, site: Site) -> Node | None:
    """One boolean mask, True where a query may attend."""
    total = None
    for mask, keeps in site.keep:
        if mask in site.frames:
            mask = _in_batch(ctx, mask, site.batch_of, site.frames[mask])
        if not keeps:
            inverted = is_call(mask, aten.bitwise_not.default, aten.logical_not.default)
            mask = mask.args[0] if inverted else ctx.call(aten.logical_not.default, mask)
        total = mask if total is None else ctx.call(aten.logical_and.default, total, mask)
    return total


def _relative_bias(ctx: FuseContext, site: Site) -> Node | None:
    total = None
    for relative, factor in site.relative:
        values = per_diagonal(ctx, relative)
        if not tensor_val(values).is_floating_point():  # integers add as float32, as promoted
            values = ctx.call(aten.to.dtype, values, torch.float32)
        if factor != 1.0:
            values = ctx.call(aten.mul.Tensor, values, factor)
        total = values if total is None else ctx.call(aten.add.Tensor, total, values)
    return total


def _prefix_length(ctx: FuseContext, site: Site, device: torch.device) -> Node | None:
    """The prefix's length as the op takes it, an integer tensor (..., 1, 1)."""
    prefix = site.prefix
    if prefix is None:
        return None
    if prefix.length is None:
        return ctx.call(aten.full.default, [1, 1], prefix.offset, dtype=torch.int64, device=device)
    if prefix.offset:
        return ctx.call(aten.add.Tensor, prefix.length, prefix.offset)
    return prefix.length
