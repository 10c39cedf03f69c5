"""What autograd keeps for the backward, measured: the distinct storages a training step saves,
seen through saved-tensor hooks. The demo reports it for eager, Inductor and seqfast alike, and the
memory tests compare it with the plan's estimate."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef


def saved_tensors(
    step: Callable[[], torch.Tensor], lasting: Iterable[torch.Tensor]
) -> dict[StorageWeakRef, torch.Tensor]:
    """A tensor per distinct storage autograd saves while `step()` computes a loss and its
    backward runs, leaving out the storages of the tensors in `lasting` (parameters, inputs) and
    the fake tensors a compile inside `step()` traces with (they are never kept)."""
    lasting = {StorageWeakRef(t.untyped_storage()) for t in lasting}
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if is_fake(t):
            return t
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in lasting:
            saved[ref] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return saved


def saved_bytes(step: Callable[[], torch.Tensor], lasting: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages `saved_tensors` finds."""
    return sum(t.untyped_storage().nbytes() for t in saved_tensors(step, lasting).values())
