"""The loss family's reading of a cross-entropy node: its logits, targets, reduction, ignored
index, label smoothing and class weights (`Loss`), or why it is not fused.

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

from seqcompile.fx.nodes import arg, is_call, only_user, tensor_val
from seqcompile.normalize import loss as normalize_loss
from seqcompile.patterns.engine import Reject

aten = torch.ops.aten
NONE, MEAN, SUM = 0, 1, 2
"""The reductions, as `cross_entropy_loss` numbers them."""
_HALF = (torch.float16, torch.bfloat16)
_PERMUTES = (aten.transpose.int, aten.permute.default)


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


def read_loss(node: Node) -> Loss | Reject | None:
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
    reduction, ignore_index = arg(node, 3, "reduction", MEAN), arg(node, 4, "ignore_index", -100)
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
