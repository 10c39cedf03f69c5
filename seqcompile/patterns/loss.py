"""The loss family: `aten.cross_entropy_loss` (every spelling of it, after normalization) becomes
`seqfast::cross_entropy` plus its reduction; when the logits come straight from a linear layer (an
LM head, an output projection, a tied embedding) and nothing else reads them, the linear joins the
loss in `seqfast::linear_cross_entropy`, which never builds the full logits. Against probability
targets (soft labels, mixup, a teacher's probabilities) of (rows, classes) logits it becomes
`seqfast::soft_cross_entropy` plus its reduction.

An upcast of the logits to float32 before the loss is absorbed: the kernels read the logits in
their own dtype and compute in float32 either way. Logits with the classes on dim 1 of three or
more dims (`(B, V, T)`, often a transpose of `(B, T, V)`) are read as `(rows, classes)` rows when
that is a view with contiguous classes, and refused with the reason otherwise. An `nll_loss`, or a
sum spelled like the label-smoothed loss written out, that normalization left alone is reported
with the reason.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import (
    RESHAPES,
    arg,
    erase_unused,
    insert_getitem,
    is_barrier,
    is_call,
    only_user,
    rank_of,
    site_name,
    tensor_val,
)
from seqcompile.normalize import loss as normalize_loss
from seqcompile.ops import cross_entropy, linear_cross_entropy, soft_cross_entropy
from seqcompile.patterns.engine import FuseContext, Reject, Rewrite
from seqcompile.patterns.pointwise_ops import element_wise
from seqcompile.report import Missed

aten = torch.ops.aten
FAMILY = cross_entropy.ENTRY.family
_NONE, _MEAN, _SUM = 0, 1, 2
_HALF = (torch.float16, torch.bfloat16)
_TRANSPOSES = (aten.t.default, aten.numpy_T.default)
_PERMUTES = (aten.transpose.int, aten.permute.default)
_AUTOCAST_SWITCHES = (
    torch.amp.autocast_mode._enter_autocast,
    torch.amp.autocast_mode._exit_autocast,
)


@dataclasses.dataclass
class Loss:
    node: Node
    logits: Node
    """What the kernels read: the loss's input with an upcast and transposes stripped."""
    order: list[int] | None
    """The permutation that puts the classes of `logits` last (None: they are last)."""
    target: Node
    reduction: int
    ignore_index: int
    smoothing: float
    absorbed: list[Node]
    """Nodes between `logits` and the loss that the fused op replaces (upcast, transposes)."""
    soft: bool = False
    """The targets are probabilities of the logits' shape, not class indices."""
    weight: Node | None = None
    """Class weights: each row's loss is scaled by its target's weight (outside the kernel), and
    the mean divides by the sum of the weights of the counted targets, as torch does."""


@dataclasses.dataclass
class Linear:
    node: Node
    hidden: Node
    weight: Node
    bias: Node | None
    views: list[Node]
    """Reshapes from the linear's output to the (rows, classes) logits."""


def _read_loss(node: Node) -> Loss | Reject | None:
    if is_call(node, *normalize_loss.NLL):
        why = normalize_loss.nll_log_probs(node)
        return Reject("nll_loss is not read as a cross-entropy: {}", why)
    smoothed = normalize_loss.read_smoothed_nll(node)
    if isinstance(smoothed, str):
        return Reject("a label-smoothed loss written out is not read as one: {}", smoothed)
    if not is_call(node, aten.cross_entropy_loss.default):
        return None
    x, target = node.args[0], node.args[1]
    weight = arg(node, 2, "weight")
    reduction, ignore_index = arg(node, 3, "reduction", _MEAN), arg(node, 4, "ignore_index", -100)
    smoothing = float(arg(node, 5, "label_smoothing", 0.0))
    xv, tv = tensor_val(x), tensor_val(target)
    if xv is None or xv.dim() < 2:
        rank = "not a tensor" if xv is None else f"of rank {xv.dim()}"
        return Reject("logits {} (the fused loss takes classes on dim 1)", rank)
    soft = tv is not None and tv.dtype.is_floating_point
    if soft:
        why = _why_not_soft(xv, tv)
        if why is not None:
            return Reject(why)
    elif tv is None or tv.dim() != xv.dim() - 1:
        return Reject(
            "targets must be class indices (one per row) or probabilities (one per logit)"
        )
    elif tv.dtype != torch.int64:
        return Reject(eager_raises(node))
    if xv.dtype not in (torch.float32, *_HALF):
        return Reject("logits dtype {} is not supported (float32, float16, bfloat16)", xv.dtype)
    if not 0.0 <= smoothing <= 1.0:
        return Reject("label_smoothing {} is outside [0, 1]", smoothing)
    if weight is not None and (soft or smoothing):
        kind = "probability targets" if soft else "label smoothing"
        return Reject("class weights with {} are not fused (the kernel weighs no class)", kind)
    logits, order, absorbed = _classes_last(x, node) if xv.dim() > 2 else (x, None, [])
    reader = absorbed[-1] if absorbed else node
    source = logits.args[0] if is_call(logits, aten.to.dtype, aten._to_copy.default) else None
    if source is not None and only_user(logits) is reader and tensor_val(source).dtype in _HALF:
        logits, absorbed = source, [*absorbed, logits]
    why = _why_not_rows(tensor_val(logits), order) if xv.dim() > 2 else None
    if why is not None:
        return Reject(why)
    return Loss(
        node, logits, order, target, reduction, ignore_index, smoothing, absorbed, soft, weight
    )


def eager_raises(node: Node) -> str | None:
    """Why eager's `node` raises where its decomposition would not (None: it does not): a
    cross-entropy or NLL loss over class indices of any integer type but int64. (Eager raises for
    int32 and the others; uint8, which it takes, Dynamo's tracing refuses first.) Left in the
    graph, the loss raises eager's error when the rest runs eagerly; Inductor's decomposition
    takes int32, as it does without seqfast."""
    if not is_call(node, aten.cross_entropy_loss.default, *normalize_loss.NLL):
        return None
    target = tensor_val(node.args[1])
    if target is None or target.dtype.is_floating_point or target.dtype == torch.int64:
        return None
    return (
        f"targets of dtype {target.dtype} are left to eager, whose cross-entropy raises for any"
        " integer type but int64 and uint8; pass int64 targets (target.long()) to fuse the loss"
    )


def _why_not_soft(logits: torch.Tensor, target: torch.Tensor) -> str | None:
    """Why probability targets `target` of `logits` are not read by the fused loss (None: they
    are)."""
    if logits.dim() != 2:
        return (
            f"probability targets over logits of rank {logits.dim()} are not fused (the fused"
            " loss takes (rows, classes); flatten both)"
        )
    if target.shape != logits.shape:
        return (
            f"probability targets of shape {tuple(target.shape)} for logits {tuple(logits.shape)}"
        )
    if target.dtype not in (torch.float32, *_HALF):
        return f"probability targets of dtype {target.dtype} (float32, float16, bfloat16)"
    return None


def _classes_last(x: Node, loss: Node) -> tuple[Node, list[int] | None, list[Node]]:
    """(source, order, transposes): `x` (classes on dim 1) is `source` seen through
    `transposes`, and `source.permute(order)` has the classes last (order None: `source` has)."""
    rank = tensor_val(x).dim()
    order = [0, *range(2, rank), 1]
    transposes, reader = [], loss
    while is_call(x, *_PERMUTES) and only_user(x) is reader:
        if is_call(x, aten.transpose.int):
            a, b = (d % rank for d in x.args[1:3])
            inner = list(range(rank))
            inner[a], inner[b] = b, a
        else:
            inner = [d % rank for d in x.args[1]]
        order = [inner[d] for d in order]
        transposes.append(x)
        reader, x = x, x.args[0]
    return x, None if order == sorted(order) else order, transposes


def _why_not_rows(value: torch.Tensor, order: list[int] | None) -> str | None:
    """Why `value.permute(order)` (classes last) is not (rows, classes) rows of one stride with
    contiguous classes, which the kernels read without a copy (None: it is)."""
    order = order or list(range(value.dim()))
    sizes = [value.shape[d] for d in order]
    strides = [value.stride(d) for d in order]
    rows_merge = all(
        statically_known_true(sizes[i + 1] == 1)
        or statically_known_true(strides[i] == strides[i + 1] * sizes[i + 1])
        for i in range(len(sizes) - 2)
    )
    if statically_known_true(strides[-1] == 1) and rows_merge:
        return None
    return (
        f"the logits' classes (size {sizes[-1]}) and rows (sizes {sizes[:-1]}) lie at strides"
        f" {strides[-1]} and {strides[:-1]}: the fused loss reads rows of contiguous classes, so"
        " they would be copied (compute the logits with the classes last, e.g. (B, T, V), and"
        " pass logits.flatten(0, 1) and target.flatten())"
    )


def _read_linear(logits: Node) -> Linear | None:
    """The linear that produced `logits` through reshapes that keep the rows in order."""
    views, node = [], logits
    while is_call(node, *RESHAPES):
        views.append(node)
        node = node.args[0]
    linear = linear_at(node)
    if linear is None or tensor_val(node).shape[-1] != tensor_val(logits).shape[-1]:
        return None
    return dataclasses.replace(linear, views=views)


def linear_at(node: Node) -> Linear | None:
    """`node` read as a linear layer: `aten.linear` or `x @ W.t()`, W of rank 2."""
    if is_call(node, aten.linear.default):
        hidden, weight, bias = node.args[0], node.args[1], arg(node, 2, "bias")
    elif is_call(node, aten.matmul.default) and is_call(node.args[1], *_TRANSPOSES):
        hidden, weight, bias = node.args[0], node.args[1].args[0], None
    else:
        return None
    if rank_of(weight) != 2:
        return None
    return Linear(node, hidden, weight, bias, [])


def _linear_up(logits: Node) -> tuple[Node, str] | None:
    """A linear that computes `logits` through other ops (a scale, a soft cap), found a few
    element-wise ops up, and why they are built whole: what lies between."""
    node, between = logits, []
    for _ in range(8):
        operands = [a for a in node.all_input_nodes if _same_elements(a, logits)]
        if node.op != "call_function" or len(operands) != 1:
            return None
        if not (is_call(node, *RESHAPES) or element_wise(node.target)):
            return None
        between.append(str(node.target).removeprefix("aten."))
        node = operands[0]
        linear = _read_linear(node)
        if linear is not None:
            ops = ", ".join(reversed(between))
            return linear.node, (
                f"the logits come from a linear through {ops}, which the fused linear +"
                " cross-entropy does not compute, so they are built"
            )
    return None


def _same_elements(a: Node, b: Node) -> bool:
    x, y = tensor_val(a), tensor_val(b)
    return x is not None and y is not None and statically_known_true(x.numel() == y.numel())


def _why_logits_stay(loss: Loss, linear: Linear) -> str | None:
    """Why the linear feeding the loss cannot join it (None when it can)."""
    chain = {loss.node, *loss.absorbed, *linear.views}
    readers = [u for n in (linear.node, *linear.views) for u in n.users if u not in chain]
    if readers:
        names = ", ".join(sorted(r.name for r in readers))
        return f"the logits are read elsewhere ({names}), so they are built"
    if loss.reduction == _NONE:
        return "reduction 'none' needs per-token gradients, so the logits are built"
    if loss.soft:
        return "it takes class indices; against probability targets the logits are built"
    if loss.weight is not None:
        return "it weighs no class; with class weights the logits are built"
    if not only_autocast_between(linear.node, loss.node):
        return "grad mode or an in-place op changes between the linear and the loss"
    return None


def only_autocast_between(first: Node, last: Node) -> bool:
    """No barrier but autocast switches lies between: the fused op names its compute dtype, so
    it may move out of an autocast region, not across a grad-mode change or a mutation."""
    node = first.next
    while node is not last:
        if is_barrier(node) and node.target not in _AUTOCAST_SWITCHES:
            return False
        node = node.next
    return True


def joins_linear(node: Node) -> bool:
    """Whether `node` is a cross-entropy this family fuses with the linear before it
    (`seqfast::linear_cross_entropy`)."""
    loss = _read_loss(node)
    if not isinstance(loss, Loss) or loss.order is not None:
        return False
    linear = _read_linear(loss.logits)
    return linear is not None and _why_logits_stay(loss, linear) is None


def _reduce(ctx: FuseContext, loss: Loss, rows: Node) -> Node:
    if loss.soft:  # the mean is over the rows: probability targets ignore none
        reduce = {_NONE: None, _SUM: aten.sum.default, _MEAN: aten.mean.default}[loss.reduction]
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
    if loss.reduction == _NONE:
        if tensor_val(loss.target).dim() == 1:
            return rows
        return ctx.call(aten.view_as.default, rows, loss.target)
    total = ctx.call(aten.sum.default, rows)
    if loss.reduction == _SUM:
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
                mean=loss.reduction == _MEAN,
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
        loss = _read_loss(node)
        if loss is None or isinstance(loss, Reject):
            return loss
        linear = _read_linear(loss.logits) if loss.order is None else None
        if linear is not None:
            why = _why_logits_stay(loss, linear)
            apart = (linear.node, why) if why is not None else None
        else:
            apart = _linear_up(loss.logits)
        if apart is not None:
            if not said_at(ctx, apart[0]):
                missed = Missed(site_name(node), linear_cross_entropy.ENTRY.name, apart[1])
                ctx.report.missed.append(missed)
            linear = None
        return _rewrite(loss, linear)
