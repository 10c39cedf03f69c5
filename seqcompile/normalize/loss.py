"""Normalization rules that bring the spellings of the cross-entropy loss to one:
`aten.cross_entropy_loss(logits, target, weight, reduction, ignore_index, label_smoothing)`.

- `nll_loss(log_softmax(x, classes), ...)` is `cross_entropy_loss(x, ...)`, also when views lie
  between the two: reshapes that merge or split the rows (`view(-1, V)`, `flatten(0, 1)`) and
  transposes that move the classes (`transpose(1, 2)` to nll_loss's class dim 1) are applied to
  `x` instead.
- The label-smoothed loss written out as fairseq and LightSeq write it,

      lprobs = log_softmax(x, -1);  nll = -lprobs.gather(-1, target);  smooth = -lprobs.sum(-1)
      nll, smooth = masked_fill(pad, 0) of each;  loss = a * nll.sum() + b * smooth.sum()

  (with the same views allowed between `log_softmax` and its readers; without an ignore index
  fairseq squeezes the trailing 1 of each term instead of masking it) is
  `k * cross_entropy_loss(x, target, reduction=sum, ignore_index=pad, label_smoothing=s)`
  with k = a + b V and s = b V / k (torch's smoothing spreads s / V over every class), its
  target cast to int64 (gather takes int32 indices, cross_entropy_loss does not). When the
  summed nll is read elsewhere too (fairseq logs it), it becomes a second loss without smoothing.
  `read_smoothed_nll` also says why a sum spelled like this loss is not one, for the report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import RESHAPES, arg, is_call, same_shape, tensor_val
from seqcompile.normalize.context import RuleContext

aten = torch.ops.aten
_REDUCTION_SUM = 2
NLL = (aten.nll_loss_nd.default, aten.nll_loss.default)
_PERMUTES = (aten.transpose.int, aten.permute.default, aten.t.default)
_COPYING_VIEWS = {aten.view.default, aten._unsafe_view.default}
"""Replayed on the log-softmax's input as `reshape`: that input may be strided where the
log-softmax's fresh output was not."""
_SQUEEZES = (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
_WRAPPERS = (aten.neg.default, aten.masked_fill.Scalar, *_SQUEEZES)
_NO_PAD = -100
"""The ignore index of a label-smoothed loss that masks no padding: a negative index, which the
gather it replaces refuses."""


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


@dataclasses.dataclass
class _Term:
    """One term of the label-smoothed loss: `total` is `core` (the gather of the target, or the
    sum over the classes) negated, with its padding rows filled with 0 (with an ignore index) or
    its trailing 1 squeezed (without one), summed, and maybe negated again."""

    core: Node
    wrappers: list[Node]
    """From the total down to the core (which they leave out)."""

    @property
    def total(self) -> Node:
        return self.wrappers[0]

    @property
    def sign(self) -> float:
        """`total` over the sum of `core`: the wrappers negate or keep it."""
        return (-1.0) ** sum(is_call(w, aten.neg.default) for w in self.wrappers)

    @property
    def fills(self) -> list[Node]:
        return [w for w in self.wrappers if is_call(w, aten.masked_fill.Scalar)]


def _term(total: Any) -> _Term | None:
    """The term whose total is `total` (None: it is no sum of a gather or of a sum over a dim)."""
    wrappers, node = [], total
    while is_call(node, aten.neg.default):
        wrappers.append(node)
        node = node.args[0]
    if not is_call(node, aten.sum.default) or arg(node, 1, "dtype") is not None:
        return None
    wrappers.append(node)
    node = node.args[0]
    while is_call(node, *_WRAPPERS):
        wrappers.append(node)
        node = node.args[0]
    if not is_call(node, aten.gather.default, aten.sum.dim_IntList):
        return None
    return _Term(node, wrappers)


@dataclasses.dataclass
class SmoothedNll:
    """The label-smoothed loss written out, read as
    `k * cross_entropy_loss(x, target, reduction=sum, ignore_index=pad, label_smoothing=s)`."""

    log_probs: LogProbs
    target: Node
    """The gathered index, one per row (shape (..., 1))."""
    pad: int | None
    """The index whose rows both terms mask (None: no term masks)."""
    nll: _Term
    """Its total may be read elsewhere too (fairseq logs it)."""
    k: float
    smoothing: float


def read_smoothed_nll(node: Node) -> SmoothedNll | str | None:
    """`node` as the label-smoothed loss written out, or why it cannot be read as one when it is
    spelled like one (a weighted sum of the totals of a gather from a tensor and of that tensor's
    sum over a dim); None when it is not spelled like one."""
    if not is_call(node, aten.add.Tensor) or node.kwargs:
        return None
    scaled = [_scaled(t) for t in node.args]
    if None in scaled:
        return None
    for i in (0, 1):
        (nll_sum, a), (smooth_sum, b) = scaled[i], scaled[1 - i]
        nll, smooth = _term(nll_sum), _term(smooth_sum)
        if nll is not None and smooth is not None and _gather_and_sum(nll.core, smooth.core):
            break
    else:
        return None
    gathered = nll.core
    why = _why_not_terms(node, nll, smooth)
    if why is not None:
        return why
    pad = _padding(nll, smooth)
    if isinstance(pad, str):
        return pad
    found = read_log_probs(gathered.args[0], -1, readers=2)
    if isinstance(found, str):
        return found
    vocab = tensor_val(found.read).shape[-1]
    if not isinstance(vocab, int):
        return f"the number of classes {vocab} is symbolic"
    # the loss weighs nll = -sum(gather) and smooth = -sum(sum); each total is sign * sum(core)
    a, b = -a * nll.sign, -b * smooth.sign
    k = a + b * vocab
    if k == 0 or not 0 <= b * vocab / k <= 1:
        return (
            f"weights {a:g} of the nll and {b:g} of the smoothing term over {vocab} classes"
            " are no label smoothing in [0, 1]"
        )
    return SmoothedNll(found, gathered.args[2], pad, nll, k, b * vocab / k)


def _gather_and_sum(gathered: Node, summed: Node) -> bool:
    """A gather from a tensor and a sum over dims of the same tensor."""
    return (
        is_call(gathered, aten.gather.default)
        and is_call(summed, aten.sum.dim_IntList)
        and gathered.args[0] is summed.args[0]
    )


def _why_not_terms(node: Node, nll: _Term, smooth: _Term) -> str | None:
    """Why the terms added by `node` are not a gather of one index per row and a sum over the
    classes, read only on the way to `node` (the nll total may be read elsewhere)."""
    chain = [*node.args, *nll.wrappers[1:], *smooth.wrappers, nll.core, smooth.core]
    for n in chain:
        if len(n.users) != 1:
            users = ", ".join(sorted(u.name for u in n.users))
            return f"{n.name} of the label-smoothed loss is read elsewhere too ({users})"
    lprobs, index = tensor_val(nll.core.args[0]).shape, tensor_val(nll.core.args[2]).shape
    rank = len(lprobs)
    summed = arg(smooth.core, 1, "dim") or range(rank)
    dims = sorted({nll.core.args[1] % rank, *(d % rank for d in summed)})
    if dims != [rank - 1]:
        return f"the gather and the sum run over dims {dims}, not over the classes (dim {rank - 1})"
    rows = lprobs[:-1]
    if not (
        len(index) == rank
        and statically_known_true(index[-1] == 1)
        and all(statically_known_true(i == r) for i, r in zip(index[:-1], rows, strict=True))
    ):
        return f"the gathered index has shape {list(index)}, not one per row of {list(rows)}"
    return None


def _padding(nll: _Term, smooth: _Term) -> int | None | str:
    """The index whose rows both terms fill with 0 (None: neither fills), or why they do not
    mask the same rows."""
    if not nll.fills and not smooth.fills:
        return None
    if len(nll.fills) != 1 or len(smooth.fills) != 1:
        return (
            f"the nll term masks padding {len(nll.fills)} times and the smoothing term"
            f" {len(smooth.fills)} times (both once, or neither, is the loss)"
        )
    target, mask = nll.core.args[2], nll.fills[0].args[1]
    if smooth.fills[0].args[1] is not mask:
        return "the nll and the smoothing term mask padding with different masks"
    if not (
        is_call(mask, aten.eq.Scalar)
        and mask.args[0] is target
        and isinstance(mask.args[1], int)
        and not isinstance(mask.args[1], bool)
    ):
        return f"the padding mask {mask.name} is no `target.eq(index)` of the gathered target"
    for fill in (*nll.fills, *smooth.fills):
        if fill.args[2] != 0:
            return f"{fill.name} fills the padding with {fill.args[2]}, not 0"
        filled = tensor_val(fill.args[0])
        if not same_shape(filled, tensor_val(mask)):
            return (
                f"{fill.name} broadcasts its mask of shape {list(tensor_val(mask).shape)}"
                f" over a term of shape {list(filled.shape)}"
            )
    return mask.args[1]


def smoothed_nll_written_out(node: Node, ctx: RuleContext) -> Node | None:
    found = read_smoothed_nll(node)
    if not isinstance(found, SmoothedNll):
        return None
    vocab = tensor_val(found.log_probs.read).shape[-1]
    x = _logits(ctx, found.log_probs)
    if tensor_val(x).dim() != 2:
        x = ctx.call(aten.reshape.default, x, [-1, vocab])
    target = ctx.call(aten.reshape.default, found.target, [-1])
    if tensor_val(target).dtype != torch.int64:
        # gather takes int32 indices where cross_entropy_loss raises for them
        target = ctx.call(aten.to.dtype, target, torch.int64)
    pad = _NO_PAD if found.pad is None else found.pad
    loss = ctx.call(
        aten.cross_entropy_loss.default, x, target, None, _REDUCTION_SUM, pad, found.smoothing
    )
    nll_sum = found.nll.total
    if len(nll_sum.users) > 1:
        plain = ctx.call(aten.cross_entropy_loss.default, x, target, None, _REDUCTION_SUM, pad, 0.0)
        if found.nll.sign > 0:
            plain = ctx.call(aten.neg.default, plain)
        nll_sum.replace_all_uses_with(plain, delete_user_cb=lambda u: u not in node.args)
    return ctx.call(aten.mul.Tensor, loss, found.k)
