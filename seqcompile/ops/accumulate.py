"""In-place ops that add a gradient into a parameter's `.grad` (option `accumulate_grads`, see
`memory/accumulate.py`): inside a matmul's epilogue, scaled, by embedding rows, or plainly."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("seqfast::accumulate_matmul_", mutates_args=("grad",))
def accumulate_matmul_(grad: Tensor, a: Tensor, b: Tensor) -> None:
    """grad += a @ b, in the matmul's epilogue."""
    grad.addmm_(a, b)


@torch.library.custom_op("seqfast::accumulate_scaled_", mutates_args=("grad",))
def accumulate_scaled_(grad: Tensor, update: Tensor, scale: Tensor) -> None:
    """grad += update * scale (a 0-d scale), with no temporary."""
    grad.addcmul_(update, scale.to(update.dtype))


@torch.library.custom_op("seqfast::accumulate_rows_", mutates_args=("grad",))
def accumulate_rows_(grad: Tensor, rows: Tensor, indices: Tensor, padding_idx: int) -> None:
    """grad[indices] += rows, as an embedding's backward would build them (padding left out)."""
    rows = rows.reshape(-1, grad.shape[-1])
    indices = indices.reshape(-1)
    if padding_idx >= 0:
        keep = indices != padding_idx
        rows, indices = rows[keep], indices[keep]
    grad.index_put_((indices,), rows.to(grad.dtype), accumulate=True)


@torch.library.custom_op("seqfast::accumulate_", mutates_args=("grad",))
def accumulate_(grad: Tensor, update: Tensor) -> None:
    """grad += update."""
    grad.add_(update)


for _op in (accumulate_matmul_, accumulate_scaled_, accumulate_rows_, accumulate_):
    _op.register_fake(lambda grad, *args: None)
