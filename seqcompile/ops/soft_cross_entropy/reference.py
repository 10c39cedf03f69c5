"""The definition of `seqfast::soft_cross_entropy` and its backward in plain ATen: the test oracle,
what runs on CPU tensors, and the lowerings."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _smoothed(target: Tensor, smoothing: float) -> Tensor:
    return (1.0 - smoothing) * target.float() + smoothing / max(target.shape[-1], 1)


def forward(logits: Tensor, target: Tensor, smoothing: float) -> tuple[Tensor, ...]:
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    # eager's log_softmax subtracts the row's maximum, so a +inf logit makes the row NaN
    lse = lse.masked_fill(lse == float("inf"), float("nan"))
    t = _smoothed(target, smoothing)
    loss = (t * (lse.unsqueeze(1) - x)).sum(-1)
    return loss, lse, t.sum(-1)


def grads(
    *, grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, mass: Tensor, **how
) -> tuple[Tensor, Tensor]:
    """The gradients of the logits and of the targets (empty unless `target_grad`), from the
    backward's arguments by name (`how`: the smoothing and whether the targets want one)."""
    smoothing, target_grad = how["smoothing"], how["target_grad"]
    x, g = logits.float(), grad.float().unsqueeze(1)
    shift = lse.unsqueeze(1)
    dlogits = g * (mass.unsqueeze(1) * torch.exp(x - shift) - _smoothed(target, smoothing))
    dtarget = g * (1.0 - smoothing) * (shift - x) if target_grad else x.new_empty(0)
    return dlogits.to(logits.dtype), dtarget.to(target.dtype)


def lower_backward(**arguments) -> tuple[Tensor, Tensor]:
    """`soft_cross_entropy_backward` on CPU in plain ATen (the registry's lowering, and the op's
    own CPU path): the reference's gradients, contiguous as the fake implementation makes them."""
    dlogits, dtarget = grads(**arguments)
    return dlogits.contiguous(), dtarget.contiguous()
