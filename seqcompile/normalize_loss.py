"""Normalization rules that bring the spellings of the cross-entropy loss to one:
`aten.cross_entropy_loss(logits, target, weight, reduction, ignore_index, label_smoothing)`.

- `nll_loss(log_softmax(x, classes), ...)` is `cross_entropy_loss(x, ...)`.
- The label-smoothed loss written out as fairseq and LightSeq write it,

      lprobs = log_softmax(x, -1);  nll = -lprobs.gather(-1, target);  smooth = -lprobs.sum(-1)
      nll, smooth = masked_fill(pad, 0) of each;  loss = a * nll.sum() + b * smooth.sum()

  is `k * cross_entropy_loss(x, target, reduction=sum, ignore_index=pad, label_smoothing=s)`
  with k = a + b V and s = b V / k (torch's smoothing spreads s / V over every class). When the
  summed nll is read elsewhere too (fairseq logs it), it becomes a second loss without smoothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from seqcompile.fx_utils import arg, is_call, only_user, tensor_val

if TYPE_CHECKING:
    from seqcompile.normalize import RuleContext

aten = torch.ops.aten
_REDUCTION_SUM = 2
_NLL = (aten.nll_loss_nd.default, aten.nll_loss.default)


def _class_dim(node: Node, dim: int) -> int:
    return dim % tensor_val(node).dim()


def _log_softmax_input(node: Any, readers: int = 1) -> Node | None:
    """`x` when `node` is `log_softmax(x, -1)` (cast first when it names a dtype), read only by
    `readers` nodes."""
    if not is_call(node, aten.log_softmax.int) or len(node.users) != readers:
        return None
    x, dim = node.args[0], node.args[1]
    if tensor_val(x).dim() != 2 or _class_dim(x, dim) != 1:
        return None
    return x


def nll_of_log_softmax(node: Node, ctx: RuleContext) -> Node | None:
    if not is_call(node, *_NLL):
        return None
    lprobs = node.args[0]
    x = _log_softmax_input(lprobs)
    if x is None:
        return None
    dtype = arg(lprobs, 2, "dtype")
    if dtype is not None:
        x = ctx.call(aten.to.dtype, x, dtype)
    weight = arg(node, 2, "weight")
    reduction, ignore_index = arg(node, 3, "reduction", 1), arg(node, 4, "ignore_index", -100)
    return ctx.call(
        aten.cross_entropy_loss.default, x, node.args[1], weight, reduction, ignore_index, 0.0
    )


def _scaled(node: Any) -> tuple[Node, float] | None:
    """(t, c) when `node` is `t * c` for a Python number c."""
    if is_call(node, aten.mul.Tensor) and isinstance(node.args[1], int | float):
        return node.args[0], float(node.args[1])
    return None


def _masked_sum(node: Any, allow_readers: bool) -> tuple[Node, Node] | None:
    """(term, pad mask) when `node` is `masked_fill(term, pad, 0).sum()`."""
    if not is_call(node, aten.sum.default):
        return None
    if not allow_readers and len(node.users) != 1:
        return None
    fill = node.args[0]
    if not is_call(fill, aten.masked_fill.Scalar) or fill.args[2] != 0 or only_user(fill) is None:
        return None
    return fill.args[0], fill.args[1]


def _negated(node: Any) -> Node | None:
    if is_call(node, aten.neg.default) and only_user(node) is not None:
        return node.args[0]
    return None


def smoothed_nll_written_out(node: Node, ctx: RuleContext) -> Node | None:
    if not is_call(node, aten.add.Tensor) or node.kwargs:
        return None
    terms = [_scaled(t) for t in node.args]
    if None in terms:
        return None
    for i in (0, 1):
        (nll_sum, a), (smooth_sum, b) = terms[i], terms[1 - i]
        found = _smoothed(nll_sum, smooth_sum)
        if found is not None:
            x, target, pad = found
            scaled_nll = node.args[i]
            break
    else:
        return None
    vocab = tensor_val(x).shape[1]
    if not isinstance(vocab, int) or a + b * vocab == 0:
        return None
    k = a + b * vocab
    flat_target = ctx.call(aten.view.default, target, [-1])
    loss = ctx.call(
        aten.cross_entropy_loss.default, x, flat_target, None, _REDUCTION_SUM, pad, b * vocab / k
    )
    if len(nll_sum.users) > 1:
        plain = ctx.call(
            aten.cross_entropy_loss.default, x, flat_target, None, _REDUCTION_SUM, pad, 0.0
        )
        nll_sum.replace_all_uses_with(plain, delete_user_cb=lambda u: u is not scaled_nll)
    return ctx.call(aten.mul.Tensor, loss, k)


def _smoothed(nll_sum: Node, smooth_sum: Node) -> tuple[Node, Node, int] | None:
    """(logits, target (rows, 1), pad index) when the two sums are fairseq's masked terms."""
    nll, smooth = _masked_sum(nll_sum, True), _masked_sum(smooth_sum, False)
    if nll is None or smooth is None:
        return None
    (nll_term, pad), (smooth_term, smooth_pad) = nll, smooth
    gathered, summed = _negated(nll_term), _negated(smooth_term)
    if pad is not smooth_pad or not is_call(pad, aten.eq.Scalar):
        return None
    if not is_call(gathered, aten.gather.default) or not is_call(summed, aten.sum.dim_IntList):
        return None
    lprobs, target = gathered.args[0], gathered.args[2]
    if summed.args[0] is not lprobs or len(summed.args[1]) != 1 or not arg(summed, 2, "keepdim"):
        return None
    if pad.args[0] is not target or not isinstance(pad.args[1], int):
        return None
    x = _log_softmax_input(lprobs, readers=2)
    if x is None or _class_dim(x, gathered.args[1]) != 1 or _class_dim(x, summed.args[1][0]) != 1:
        return None
    if arg(lprobs, 2, "dtype") is not None or tensor_val(target).shape[-1] != 1:
        return None
    return x, target, pad.args[1]
