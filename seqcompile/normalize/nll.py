"""Normalization rules that read the cross-entropy written out per row, and its reductions:

- `-log_softmax(x).gather(-1, t[..., None])` and `logsumexp(x, -1) - x.gather(-1, t[..., None])`
  (the trailing 1 squeezed, selected, or kept) are `cross_entropy_loss(x, t, reduction='none')`;
- `-(p * log_softmax(x)).sum(-1)` is the loss against probability targets p (mixup's, a
  teacher's);
- `a * nll + b * smooth`, smooth the mean of `-log_softmax(x)` over the classes (as timm writes
  label smoothing), is `(a + b) * cross_entropy_loss(x, t, label_smoothing=b / (a + b))`;
- negations and scales by numbers are read through, inside or outside a mean or sum;
- the mean and the sum of such rows are the loss with that reduction; the sum of the rows times
  `t != p` over the sum of that mask is the mean ignoring index p.

These follow from the ops' definitions (normalize reads softmax and logsumexp written out first,
see `written_out.py`). A target eager's gather would refuse (out of range, negative) is refused
by the loss too: the rows' loss ignores no index (`NO_INDEX`), so no row is dropped that eager
computes. An expression is read where it is largest: a part whose reader extends it is left to
that reader.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import arg, is_call, only_user, rank_of, same_shape, tensor_val
from seqcompile.normalize.context import RuleContext

aten = torch.ops.aten
NO_INDEX = -(2**62)
"""The ignore index of a loss read from rows that ignore nothing: no class index equals it."""
_NONE, _MEAN, _SUM = 0, 1, 2
_SQUEEZES = (aten.squeeze.dim, aten.squeeze.dims)


@dataclasses.dataclass(frozen=True)
class Rows:
    """`scale * cross_entropy_loss(logits, target, reduction='none', label_smoothing=smoothing)`
    per row, or (`smooth`) `scale` times the mean of `-log_softmax(logits)` over the classes."""

    logits: Node
    target: Node | None
    scale: float
    smoothing: float = 0.0
    smooth: bool = False
    reads: frozenset[Node] = frozenset()
    """The nodes that read the log-probabilities (where the rows read them)."""
    log_probs: Node | None = None


def _last_dim(dims: Any, rank: int) -> bool:
    dims = [dims] if isinstance(dims, int) else dims
    return isinstance(dims, list | tuple) and [d % rank for d in dims] == [rank - 1]


def _log_probs(node: Any) -> Node | None:
    """x where `node` is `log_softmax(x)` over the last dim."""
    if not is_call(node, aten.log_softmax.int) or arg(node, 2, "dtype") is not None:
        return None
    rank = rank_of(node)
    return node.args[0] if rank and _last_dim(node.args[1], rank) else None


def _squeezes_last(node: Any) -> bool:
    """`node` drops the trailing 1 of its input (`squeeze(-1)`, `[..., 0]`)."""
    if not is_call(node, *_SQUEEZES, aten.select.int) or not rank_of(node.args[0]):
        return False
    rank = rank_of(node.args[0])
    if is_call(node, aten.select.int):
        return node.args[1] % rank == rank - 1 and node.args[2] == 0
    return len(node.args) > 1 and _last_dim(node.args[1], rank)


def _gathered(node: Any) -> tuple[Node, Node, Node] | None:
    """(source, target, gather) where `node` is `source.gather(-1, target[..., None])` with its
    trailing 1 squeezed (or selected), or kept where the target kept it too."""
    squeezed = _squeezes_last(node)
    if squeezed:
        node = node.args[0]
    if not is_call(node, aten.gather.default) or arg(node, 3, "sparse_grad", False):
        return None
    source, dim, index = node.args[:3]
    rank = rank_of(source)
    if not rank or rank_of(index) != rank or dim % rank != rank - 1:
        return None
    if not statically_known_true(tensor_val(index).shape[-1] == 1):
        return None
    if is_call(index, aten.unsqueeze.default) and index.args[1] % rank == rank - 1:
        target = index.args[0]
    elif not squeezed:
        target = index
    else:
        return None
    value = tensor_val(target)
    if value.dtype not in (torch.int64, torch.int32) or not all(
        statically_known_true(a == b)
        for a, b in zip(tensor_val(source).shape[:-1], value.shape[: rank - 1], strict=False)
    ):
        return None
    return source, target, node


def _read(node: Any, sign: float = 1.0, depth: int = 6) -> Rows | None:
    """What `sign * node` computes as a loss of each row (None: no such loss)."""
    if not isinstance(node, Node) or depth == 0:
        return None
    if is_call(node, aten.neg.default):
        return _read(node.args[0], -sign, depth - 1)
    if is_call(node, aten.mul.Tensor) and isinstance(node.args[1], int | float):
        return _read(node.args[0], sign * node.args[1], depth - 1)
    if is_call(node, aten.add.Tensor) and arg(node, 2, "alpha", 1) == 1:
        parts = [_read(a, sign, depth - 1) for a in node.args[:2]]
        return None if None in parts else _smoothed(*parts)
    gathered = _gathered(node)
    if gathered is not None:
        x = _log_probs(gathered[0])
        return None if x is None else Rows(x, gathered[1], -sign, reads=frozenset([gathered[2]]),
                                           log_probs=gathered[0])  # fmt: skip
    if is_call(node, aten.mean.dim) and not arg(node, 2, "keepdim", False):
        x = _log_probs(node.args[0])
        rank = rank_of(node.args[0])
        if x is not None and _last_dim(node.args[1], rank):
            return Rows(
                x, None, -sign, smooth=True, reads=frozenset([node]), log_probs=node.args[0]
            )
    if is_call(node, aten.sum.dim_IntList) and not arg(node, 2, "keepdim", False):
        return _soft(node, sign)
    if is_call(node, aten.sub.Tensor) and arg(node, 2, "alpha", 1) == 1:
        return _log_sum_exp_minus_picked(node, sign)
    return None


def _soft(node: Node, sign: float) -> Rows | None:
    """`sign * (p * log_softmax(x)).sum(-1)`: the loss against probability targets p."""
    product, rank = node.args[0], rank_of(node.args[0])
    if not rank or not _last_dim(node.args[1], rank) or arg(node, 3, "dtype") is not None:
        return None
    if not is_call(product, aten.mul.Tensor):
        return None
    for lp, p in (product.args[:2], product.args[1::-1]):
        x = _log_probs(lp)
        if is_call(p, aten.neg.default):
            p, sign = p.args[0], -sign
        value = tensor_val(p) if isinstance(p, Node) else None
        if x is not None and value is not None and value.is_floating_point():
            if same_shape(value, tensor_val(lp)):
                return Rows(x, p, -sign, reads=frozenset([product]), log_probs=lp)
    return None


def _log_sum_exp_minus_picked(node: Node, sign: float) -> Rows | None:
    lse, picked = node.args[:2]
    found = _gathered(picked)
    if found is None or not is_call(lse, aten.logsumexp.default) or lse.args[0] is not found[0]:
        return None
    rank = rank_of(found[0])
    if not same_shape(tensor_val(lse), tensor_val(picked)) or not _last_dim(lse.args[1], rank):
        return None
    return Rows(found[0], found[1], sign)


def _smoothed(a: Rows, b: Rows) -> Rows | None:
    """The sum of a cross-entropy's rows and of the smoothing term over the same log-probs."""
    nll, smooth = (a, b) if b.smooth else (b, a)
    if nll.smooth or not smooth.smooth or nll.smoothing or nll.log_probs is not smooth.log_probs:
        return None
    if nll.log_probs is None or tensor_val(nll.target).dtype not in (torch.int64, torch.int32):
        return None
    k = nll.scale + smooth.scale
    if k <= 0 or not 0 <= smooth.scale / k <= 1:
        return None
    return dataclasses.replace(
        nll, scale=k, smoothing=smooth.scale / k, reads=nll.reads | smooth.reads
    )


def _loss_rows(node: Node) -> Rows | None:
    """The rows `node` computes, where they are a loss and read all the log-probs' readers."""
    rows = _read(node)
    if rows is None or rows.smooth or rows.scale <= 0:
        return None
    if rows.log_probs is not None and set(rows.log_probs.users) != set(rows.reads):
        return None  # the log-probabilities are read elsewhere too (fairseq's loss, returned)
    return rows


def rows_written_out(node: Node, ctx: RuleContext) -> Node | None:
    """The cross-entropy of each row written out, as `k * cross_entropy_loss(reduction='none')`,
    read from the largest expression that is one."""
    if not node.users or tensor_val(node) is None:
        return None
    rows = _loss_rows(node)
    if rows is None or _loss_rows(only_user(node)) is not None:
        return None
    x, target = rows.logits, rows.target
    rank = rank_of(x)
    classes = ctx.size(x, rank - 1)
    logits = ctx.call(aten.reshape.default, x, [-1, classes])
    soft = tensor_val(target).is_floating_point()
    target = ctx.call(aten.reshape.default, target, [-1, classes] if soft else [-1])
    if not soft and tensor_val(target).dtype != torch.int64:
        target = ctx.call(aten.to.dtype, target, torch.int64)
    loss = ctx.call(
        aten.cross_entropy_loss.default, logits, target, None, _NONE, NO_INDEX, rows.smoothing
    )
    what = "the cross-entropy of each row" + (" against probability targets" if soft else "")
    if rows.smoothing:
        what += f", label smoothing {rows.smoothing:g}"
    if rows.scale != 1:
        what += f", times {rows.scale:g}"
        loss = ctx.call(aten.mul.Tensor, loss, rows.scale)
    ctx.note("rewritten", "cross_entropy", node, f"read as {what}")
    rows = [ctx.size(x, d) for d in range(rank - 1)]
    return ctx.call(aten.reshape.default, loss, rows + [1] * (rank_of(node) - len(rows)))


def negation_inside(node: Node, ctx: RuleContext) -> Node | None:
    """`-(rows).mean()` (a negation of the mean, as `-(lp.gather(...)).mean()` parses): the mean
    (or sum) of the negated rows, so they read as the loss."""
    if not is_call(node, aten.neg.default):
        return None
    reduced = node.args[0]
    if not is_call(reduced, aten.mean.default, aten.sum.default) or len(reduced.users) != 1:
        return None
    rows = _read(reduced.args[0], -1.0)
    if arg(reduced, 1, "dtype") is not None or rows is None or rows.smooth or rows.scale <= 0:
        return None
    return ctx.call(reduced.target, ctx.call(aten.neg.default, reduced.args[0]))


def _rows_loss(node: Any) -> tuple[Node, float] | None:
    """(the `reduction='none'` loss, its scale) `node` is, seen through a reshape and a scale,
    read only by it."""
    scale = 1.0
    if is_call(node, aten.reshape.default, aten.view.default) and len(node.users) == 1:
        node = node.args[0]
    if is_call(node, aten.mul.Tensor) and isinstance(node.args[1], float) and len(node.users) == 1:
        node, scale = node.args[0], node.args[1]
    if (
        is_call(node, aten.cross_entropy_loss.default)
        and arg(node, 3, "reduction", _MEAN) == _NONE
        and arg(node, 4, "ignore_index", -100) == NO_INDEX
        and len(node.users) == 1
    ):
        return node, scale
    return None


def reduced_rows(node: Node, ctx: RuleContext) -> Node | None:
    """The mean or sum of a loss's rows as the loss with that reduction; the sum of the rows
    times `t != p` over the sum of that mask, as the mean ignoring index p."""
    if is_call(node, aten.mean.default, aten.sum.default) and arg(node, 1, "dtype") is None:
        found = _rows_loss(node.args[0])
        if found is None:
            return None
        reduction = _MEAN if is_call(node, aten.mean.default) else _SUM
        return _with(ctx, *found, reduction, NO_INDEX)
    if is_call(node, aten.div.Tensor):
        found = _masked_sum(*node.args[:2])
        return None if found is None else _with(ctx, *found[0], _MEAN, found[1])
    return None


def _masked_sum(total: Any, count: Any) -> tuple[tuple[Node, float], int] | None:
    """((loss, scale), p) where `total` is `(rows * m).sum()` and `count` is `m.sum()`, m
    `t != p` of the loss's class-index targets."""
    if not is_call(total, aten.sum.default) or not is_call(count, aten.sum.default):
        return None
    product, mask = total.args[0], _ne_mask(count.args[0])
    if not is_call(product, aten.mul.Tensor) or mask is None:
        return None
    for rows, factor in (product.args[:2], product.args[1::-1]):
        found, factor_mask = _rows_loss(rows), _ne_mask(factor)
        if found is None or factor_mask is None or factor_mask[1] != mask[1]:
            continue
        target = found[0].args[1]
        if tensor_val(target).is_floating_point():
            continue
        if _same_target(factor_mask[0], target) and _same_target(mask[0], target):
            return found, mask[1]
    return None


def _ne_mask(node: Any) -> tuple[Node, int] | None:
    """(t, p) where `node` is `t != p`, maybe cast to a float."""
    if is_call(node, aten.to.dtype):
        node = node.args[0]
    if is_call(node, aten.ne.Scalar) and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    return None


def _same_target(mask_target: Node, loss_target: Node) -> bool:
    """The loss reads `mask_target` (reshaped to rows, maybe cast to int64)."""
    while is_call(loss_target, aten.reshape.default, aten.view.default, aten.to.dtype):
        loss_target = loss_target.args[0]
    return loss_target is mask_target


def _with(ctx: RuleContext, loss: Node, scale: float, reduction: int, index: int) -> Node:
    logits, target = loss.args[:2]
    smoothing = arg(loss, 5, "label_smoothing", 0.0)
    reduced = ctx.call(
        aten.cross_entropy_loss.default, logits, target, None, reduction, index, smoothing
    )
    return reduced if scale == 1 else ctx.call(aten.mul.Tensor, reduced, scale)
