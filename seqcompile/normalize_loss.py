"""Normalization rules that bring the spellings of the cross-entropy loss to one:
`aten.cross_entropy_loss(logits, target, weight, reduction, ignore_index, label_smoothing)`.

- `nll_loss(log_softmax(x, classes), ...)` is `cross_entropy_loss(x, ...)`, also when views lie
  between the two: reshapes that merge or split the rows (`view(-1, V)`, `flatten(0, 1)`) and
  transposes that move the classes (`transpose(1, 2)` to nll_loss's class dim 1) are applied to
  `x` instead.
- The label-smoothed loss written out as fairseq and LightSeq write it,

      lprobs = log_softmax(x, -1);  nll = -lprobs.gather(-1, target);  smooth = -lprobs.sum(-1)
      nll, smooth = masked_fill(pad, 0) of each;  loss = a * nll.sum() + b * smooth.sum()

  (with the same views allowed between `log_softmax` and its readers) is
  `k * cross_entropy_loss(x, target, reduction=sum, ignore_index=pad, label_smoothing=s)`
  with k = a + b V and s = b V / k (torch's smoothing spreads s / V over every class). When the
  summed nll is read elsewhere too (fairseq logs it), it becomes a second loss without smoothing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx_utils import RESHAPES, arg, is_call, only_user, tensor_val

if TYPE_CHECKING:
    from seqcompile.normalize import RuleContext

aten = torch.ops.aten
_REDUCTION_SUM = 2
NLL = (aten.nll_loss_nd.default, aten.nll_loss.default)
_PERMUTES = (aten.transpose.int, aten.permute.default, aten.t.default)
_COPYING_VIEWS = {aten.view.default, aten._unsafe_view.default}
"""Replayed on the log-softmax's input as `reshape`: that input may be strided where the
log-softmax's fresh output was not."""


@dataclasses.dataclass
class LogProbs:
    """A `log_softmax` over the classes, seen by its reader through `views`."""

    log_softmax: Node
    views: list[Node]
    """Reshapes of the rows and transposes, from the log-softmax to what the reader reads."""

    @property
    def read(self) -> Node:
        """The value the reader reads."""
        return self.views[-1] if self.views else self.log_softmax


def _moved_class_dim(view: Node, dim: int) -> int | None:
    """Where the class dim `dim` of a view's input lies in its output (None: the view mixes the
    classes with other dims)."""
    source, out = tensor_val(view.args[0]), tensor_val(view)
    if is_call(view, *RESHAPES):
        last = source.dim() - 1
        if dim != last or not statically_known_true(source.shape[-1] == out.shape[-1]):
            return None
        return out.dim() - 1
    if is_call(view, aten.t.default):
        return source.dim() - 1 - dim
    if is_call(view, aten.transpose.int):
        a, b = (d % source.dim() for d in view.args[1:3])
        return b if dim == a else a if dim == b else dim
    return [d % source.dim() for d in view.args[1]].index(dim)


def read_log_probs(node: Node, class_dim: int, readers: int) -> LogProbs | str:
    """`node` as a `log_softmax` over the classes, which its reader takes along `class_dim`,
    read only through views and only by `readers` nodes; or why it is not one."""
    views = []
    while is_call(node, *RESHAPES, *_PERMUTES):
        views.append(node)
        node = node.args[0]
    if not is_call(node, aten.log_softmax.int):
        return f"the loss reads {node.target}, not a log_softmax"
    views.reverse()
    chain = [node, *views]
    for n, wanted in zip(chain, [1] * len(views) + [readers], strict=True):
        if len(n.users) != wanted:
            users = ", ".join(sorted(u.name for u in n.users))
            return f"the log-probabilities {n.name} are read elsewhere too ({users})"
    dim = node.args[1] % tensor_val(node).dim()
    for view in views:
        dim = _moved_class_dim(view, dim)
        if dim is None:
            return f"{view.target} between log_softmax and the loss mixes the classes with rows"
    wanted = class_dim % tensor_val(chain[-1]).dim()
    if dim != wanted:
        return f"log_softmax runs over dim {dim} of what the loss reads, classes are dim {wanted}"
    return LogProbs(node, views)


def _logits(ctx: RuleContext, found: LogProbs) -> Node:
    """The log-softmax's input (cast as it casts) seen through the same views."""
    x = found.log_softmax.args[0]
    dtype = arg(found.log_softmax, 2, "dtype")
    if dtype is not None:
        x = ctx.call(aten.to.dtype, x, dtype)
    for view in found.views:
        target = aten.reshape.default if view.target in _COPYING_VIEWS else view.target
        x = ctx.call(target, x, *view.args[1:], **view.kwargs)
    return x


def nll_log_probs(node: Node) -> LogProbs | str:
    """The log-softmax that `nll_loss` `node` reads, or why it reads none."""
    lprobs = node.args[0]
    rank = tensor_val(lprobs).dim()
    return read_log_probs(lprobs, 1 if rank >= 2 else 0, readers=1)


def nll_of_log_softmax(node: Node, ctx: RuleContext) -> Node | None:
    if not is_call(node, *NLL):
        return None
    found = nll_log_probs(node)
    if isinstance(found, str):
        return None
    weight = arg(node, 2, "weight")
    reduction, ignore_index = arg(node, 3, "reduction", 1), arg(node, 4, "ignore_index", -100)
    return ctx.call(
        aten.cross_entropy_loss.default,
        _logits(ctx, found), node.args[1], weight, reduction, ignore_index, 0.0,
    )  # fmt: skip


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
            log_probs, target, pad = found
            scaled_nll = node.args[i]
            break
    else:
        return None
    vocab = tensor_val(log_probs.read).shape[-1]
    if not isinstance(vocab, int) or a + b * vocab == 0:
        return None
    k = a + b * vocab
    x = _logits(ctx, log_probs)
    if tensor_val(x).dim() != 2:
        x = ctx.call(aten.reshape.default, x, [-1, vocab])
    flat_target = ctx.call(aten.reshape.default, target, [-1])
    loss = ctx.call(
        aten.cross_entropy_loss.default, x, flat_target, None, _REDUCTION_SUM, pad, b * vocab / k
    )
    if len(nll_sum.users) > 1:
        plain = ctx.call(
            aten.cross_entropy_loss.default, x, flat_target, None, _REDUCTION_SUM, pad, 0.0
        )
        nll_sum.replace_all_uses_with(plain, delete_user_cb=lambda u: u is not scaled_nll)
    return ctx.call(aten.mul.Tensor, loss, k)


def _smoothed(nll_sum: Node, smooth_sum: Node) -> tuple[LogProbs, Node, int] | None:
    """(log-probabilities, target (..., 1), pad index) when the two sums are fairseq's masked
    terms."""
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
    found = read_log_probs(lprobs, -1, readers=2)
    rank = tensor_val(lprobs).dim()
    if isinstance(found, str) or {gathered.args[1] % rank, summed.args[1][0] % rank} != {rank - 1}:
        return None
    rows, index = tensor_val(lprobs).shape, tensor_val(target).shape
    if len(index) != rank or index[-1] != 1:
        return None
    if not all(statically_known_true(i == r) for i, r in zip(index[:-1], rows[:-1], strict=True)):
        return None
    return found, target, pad.args[1]
