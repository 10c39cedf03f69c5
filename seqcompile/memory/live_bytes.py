"""Live bytes of a step as it runs, op by op, on any device: every storage an op creates is
counted from that op until it is freed. Storages that exist before the step (parameters, the
batch) are left out, as the memory model leaves them out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from seqcompile.memory.liveness import Timeline


def measure_step(forward: Callable[[], torch.Tensor], lasting: list[torch.Tensor]) -> Timeline:
    """Run `forward()` (which returns the loss) and the loss's backward, counting the live bytes
    of what they create; `lasting` are the tensors that exist regardless (parameters, inputs)."""
    with _Counting(lasting) as counting:
        loss = forward()
        counting.sample()  # after the forward's temporaries are freed
        forward_steps = len(counting.values)
        loss.backward()
        del loss
        counting.sample()  # after the backward's graph, and what it saved, is freed
    return Timeline(tuple(counting.values), forward_steps)


class _Counting(TorchDispatchMode):
    def __init__(self, lasting: list[torch.Tensor]) -> None:
        super().__init__()
        self.lasting = {StorageWeakRef(t.untyped_storage()) for t in lasting}
        self.live: dict[StorageWeakRef, int] = {}
        self.values: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._forget_freed()
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                key = StorageWeakRef(storage)
                if key not in self.lasting:
                    self.live.setdefault(key, storage.nbytes())
        self.sample()
        return out

    def sample(self) -> None:
        """Record the bytes live now."""
        self._forget_freed()
        self.values.append(sum(self.live.values()))

    def _forget_freed(self) -> None:
        for key in [key for key in self.live if key.expired()]:
            del self.live[key]
