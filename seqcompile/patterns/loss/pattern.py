"""The loss family's cross-entropy pattern: `aten.cross_entropy_loss` (every spelling of it, after
normalization, read by `read.py`) becomes `seqfast::cross_entropy` plus its reduction; when the
logits come straight from a linear layer (an LM head, an output projection, a tied embedding,
found by `linear.py`) and nothing else reads them, the linear joins the loss in
`seqfast::linear_cross_entropy`, which never builds the full logits. Against probability targets
(soft labels, mixup, a teacher's probabilities) of (rows, classes) logits it becomes
`seqfast::soft_cross_entropy` plus its reduction.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from seqcompile.fx.nodes import erase_unused, insert_getitem, is_call, site_name, tensor_val
from seqcompile.ops import cross_entropy, linear_cross_entropy, soft_cross_entropy
from seqcompile.patterns.engine import FuseContext, Reject, Rewrite
from seqcompile.patterns.loss.linear import Linear, linear_up, read_linear, why_logits_stay
from seqcompile.patterns.loss.read import MEAN, NONE, SUM, Loss, read_loss
from seqcompile.report import Missed

aten = torch.ops.aten
FAMILY = cross_entropy.ENTRY.family


def _reduce(ctx: FuseContext, loss: Loss, rows: Node) -> Node:
    if loss.soft:  # the mean is over the rows: probability targets ignore none
        reduce = {NONE: None, SUM: aten.sum.default, MEAN: aten.mean.default}[loss.reduction]
        return rows if reduce is None else ctx.call(reduce, rows)
    target = ctx.call(aten.reshape.default, loss.target, [-1])
    kept = ctx.call(aten.ne.Scalar, target, loss.ignore_index)
    counted = kept
    if loss.weight is not None:  # each row's loss times its target's weight (0 where ignored)
        index = ctx.call(aten.where.ScalarOther, kept, target, 0)
        counted = ctx.call(
            aten.mul.Tensor, ctx.call(aten.index_select.default, loss.weight, 0, index), kept
        )
        rows = ctx.call(aten.mul.Tensor, rows, counted)
    if loss.reduction == NONE:
        if tensor_val(loss.target).dim() == 1:
            return rows
        return ctx.call(aten.view_as.default, rows, loss.target)
    total = ctx.call(aten.sum.default, rows)
    if loss.reduction == SUM:
        return total
    return ctx.call(aten.div.Tensor, total, ctx.call(aten.sum.default, counted))


def _rows(ctx: FuseContext, loss: Loss) -> Node:
    """The logits as (rows, classes)."""
    logits = loss.logits
    if loss.order is not None:
        logits = ctx.call(aten.permute.default, logits, loss.order)
    if tensor_val(logits).dim() > 2:
        logits = ctx.call(aten.flatten.using_ints, logits, 0, -2)
    return logits


def _rewrite(loss: Loss, linear: Linear | None) -> Rewrite:
    def apply(ctx: FuseContext) -> Node:
        out_dtype = tensor_val(loss.node).dtype
        target = loss.target
        if tensor_val(target).dim() > 1 and not loss.soft:
            target = ctx.call(aten.reshape.default, target, [-1])
        if loss.soft:
            fused = ctx.call_fused(
                soft_cross_entropy.ENTRY.forward,
                logits=_rows(ctx, loss),
                target=target,
                smoothing=loss.smoothing,
            )
            result = _reduce(ctx, loss, insert_getitem(ctx.gm.graph, fused, 0))
        elif linear is None:
            fused = ctx.call_fused(
                cross_entropy.ENTRY.forward,
                logits=_rows(ctx, loss),
                target=target,
                ignore_index=loss.ignore_index,
                smoothing=loss.smoothing,
            )
            result = _reduce(ctx, loss, insert_getitem(ctx.gm.graph, fused, 0))
        else:
            width = tensor_val(linear.hidden).shape[-1]
            hidden = ctx.call(aten.reshape.default, linear.hidden, [-1, width])
            needs = [ctx.requires_grad(n) for n in (linear.hidden, linear.weight, linear.bias)]
            fused = ctx.call_fused(
                linear_cross_entropy.ENTRY.forward,
                hidden=hidden,
                weight=linear.weight,
                bias=linear.bias,
                target=target,
                ignore_index=loss.ignore_index,
                smoothing=loss.smoothing,
                mean=loss.reduction == MEAN,
                chunk=ctx.options.loss_chunk,
                compute_dtype=tensor_val(linear.node).dtype,
                needs_grad=needs,
            )
            result = insert_getitem(ctx.gm.graph, fused, 0)
        if tensor_val(result).dtype != out_dtype:
            result = ctx.call(aten.to.dtype, result, out_dtype)
        loss.node.replace_all_uses_with(ctx.in_layout_of(result, tensor_val(loss.node)))
        replaced = [loss.node, *loss.absorbed]
        if linear is not None:
            replaced += [*linear.views, linear.node]
            if is_call(linear.node, aten.matmul.default):
                replaced.append(linear.node.args[1])
        erase_unused(replaced)
        return fused

    return apply


def said_at(ctx: FuseContext, linear: Node) -> bool:
    """Whether the report already says why the loss over `linear`'s logits is not chunked (the
    row-wise loss, anchored at the linear, speaks for the site)."""
    site = site_name(linear)
    return any(m.site == site and m.pattern == FAMILY for m in ctx.report.missed)


class LossPattern:
    family = FAMILY

    def find(self, node: Node, ctx: FuseContext) -> Rewrite | Reject | None:
        loss = read_loss(node)
        if loss is None or isinstance(loss, Reject):
            return loss
        linear = read_linear(loss.logits) if loss.order is None else None
        if linear is not None:
            why = why_logits_stay(loss, linear)
            apart = (linear.node, why) if why is not None else None
        else:
            apart = linear_up(loss.logits)
        if apart is not None:
            if not said_at(ctx, apart[0]):
                missed = Missed(site_name(node), linear_cross_entropy.ENTRY.name, apart[1])
                ctx.report.missed.append(missed)
            linear = None
        return _rewrite(loss, linear)
