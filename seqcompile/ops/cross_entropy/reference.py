"""The definition of `seqfast::cross_entropy` and its backward in plain ATen: the test oracle, what
runs on CPU tensors, and the lowerings. A target outside [0, classes) that is not the ignored index
is an error, as in eager."""

from __future__ import annotations

import torch

from seqcompile.ops.index_check import check_range, checked_index

Tensor = torch.Tensor

TARGETS = "cross-entropy targets"


def check_targets(target: Tensor, vocab: int, ignore_index: int) -> None:
    """A target outside [0, vocab) that is not `ignore_index` is an error, as in eager: an
    IndexError on CPU, a device-side assert on CUDA (no host synchronization)."""
    check_range(target, 0, vocab, ignore_index, TARGETS)


def checked_targets(target: Tensor, vocab: int, ignore_index: int) -> Tensor:
    """`check_targets` as an op in the graph, for the lowering: the targets, which what indexes
    with them reads, once checked on the host (`ops/index_check.py`)."""
    return checked_index(target, 0, vocab, ignore_index, TARGETS)


def over_no_classes(rows: int, smoothing: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """Each row's loss and log-sum-exp when there are no classes (every target is then ignored;
    nothing is launched): 0, or NaN with smoothing, as eager divides each row's smoothing term,
    masked or not, by the number of classes (0 / 0)."""
    fill = float("nan") if smoothing > 0 else 0.0
    loss = torch.full((rows,), fill, dtype=torch.float32, device=device)
    return loss, torch.full((rows,), float("-inf"), dtype=torch.float32, device=device)


def forward(
    logits: Tensor, target: Tensor, ignore_index: int, smoothing: float
) -> tuple[Tensor, Tensor]:
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    # eager's log_softmax subtracts the row's maximum, so a +inf logit makes the row NaN (inf -
    # inf); logsumexp alone would give an infinite loss
    lse = lse.masked_fill(lse == float("inf"), float("nan"))
    ignored = target == ignore_index
    picked = x.gather(1, torch.where(ignored, 0, target).unsqueeze(1)).squeeze(1)
    loss = (1.0 - smoothing) * (lse - picked)
    if smoothing > 0:  # as eager: without smoothing a -inf logit's 0 * (-inf) would be NaN
        loss = loss + smoothing * (lse - x.sum(-1) / x.shape[-1])
    return loss.masked_fill(ignored, 0.0), lse


def logits_grad(
    logits: Tensor, target: Tensor, lse: Tensor, grad: Tensor, ignore_index: int, smoothing: float
) -> Tensor:
    x = logits.float()
    ignored = target == ignore_index
    d = torch.exp(x - lse.unsqueeze(1)) - smoothing / x.shape[-1]
    # the target's column less 1 - smoothing, as a one-hot select rather than an index_put (the
    # same subtraction where it hits, d - 0 elsewhere): pointwise given lse, no scatter
    hit = torch.arange(x.shape[-1], device=x.device) == torch.where(ignored, 0, target)[:, None]
    d = d - torch.where(hit, torch.where(ignored, 0.0, 1.0 - smoothing)[:, None], 0.0)
    g = torch.where(ignored, 0.0, grad.float())
    return (d * g.unsqueeze(1)).to(logits.dtype)


def lower_forward(*, logits: Tensor, target: Tensor, **others) -> tuple[Tensor, Tensor]:
    """`cross_entropy` on CPU in plain ATen (the registry's lowering): the reference, the
    targets checked by an op in the graph (`others`: the forward's other arguments by name)."""
    target = checked_targets(target, logits.shape[1], others["ignore_index"])
    if logits.shape[1] == 0:
        return over_no_classes(logits.shape[0], others["smoothing"], logits.device)
    return forward(logits=logits, target=target, **others)


def lower_backward(**arguments) -> Tensor:
    """`cross_entropy_backward` on CPU in plain ATen: the reference's gradient, contiguous."""
    logits = arguments["logits"]
    if logits.numel() == 0:  # no rows or no classes: no gradient to compute
        return torch.empty_like(logits, memory_format=torch.contiguous_format)
    return logits_grad(**arguments).contiguous()


def lower_backward_in_place(**arguments) -> None:
    """`cross_entropy_backward_in_place` on CPU: the gradient copied over the logits."""
    arguments["logits"].copy_(lower_backward(**arguments))
