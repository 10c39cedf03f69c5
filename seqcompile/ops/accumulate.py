"""In-place ops that add a gradient into a parameter's `.grad` (option `accumulate_grads`, see
`memory/accumulate.py`): inside a matmul's epilogue, scaled, by embedding rows, or plainly.
`LOWERINGS` holds each one's body in plain ATen, for a CPU graph to trace in its place."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _matmul(grad: Tensor, a: Tensor, b: Tensor) -> None:
    grad.addmm_(a, b)


def _scaled(grad: Tensor, update: Tensor, scale: Tensor) -> None:
    grad.addcmul_(update, scale.to(update.dtype))


def _rows(grad: Tensor, rows: Tensor, indices: Tensor, padding_idx: int) -> None:
    rows = rows.reshape(-1, grad.shape[-1])
    indices = indices.reshape(-1)
    if padding_idx >= 0:  # the padding's rows add zeros (no boolean indexing: static shapes)
        rows = torch.where((indices != padding_idx)[:, None], rows, 0)
    grad.index_put_((indices,), rows.to(grad.dtype), accumulate=True)


def _plain(grad: Tensor, update: Tensor) -> None:
    grad.add_(update)


@torch.library.custom_op("seqfast::accumulate_matmul_", mutates_args=("grad",))
def accumulate_matmul_(grad: Tensor, a: Tensor, b: Tensor) -> None:
    """grad += a @ b, in the matmul's epilogue."""
    _matmul(grad, a, b)


@torch.library.custom_op("seqfast::accumulate_scaled_", mutates_args=("grad",))
def accumulate_scaled_(grad: Tensor, update: Tensor, scale: Tensor) -> None:
    """grad += update * scale (a 0-d scale), with no temporary."""
    _scaled(grad, update, scale)


@torch.library.custom_op("seqfast::accumulate_rows_", mutates_args=("grad",))
def accumulate_rows_(grad: Tensor, rows: Tensor, indices: Tensor, padding_idx: int) -> None:
    """grad[indices] += rows, as an embedding's backward would build them (padding left out)."""
    _rows(grad, rows, indices, padding_idx)


@torch.library.custom_op("seqfast::accumulate_", mutates_args=("grad",))
def accumulate_(grad: Tensor, update: Tensor) -> None:
    """grad += update."""
    _plain(grad, update)


for _op in (accumulate_matmul_, accumulate_scaled_, accumulate_rows_, accumulate_):
    _op.register_fake(lambda grad, *args: None)

LOWERINGS: dict[torch._ops.OpOverload, Callable[..., None]] = {
    torch.ops.seqfast.accumulate_matmul_.default: _matmul,
    torch.ops.seqfast.accumulate_scaled_.default: _scaled,
    torch.ops.seqfast.accumulate_rows_.default: _rows,
    torch.ops.seqfast.accumulate_.default: _plain,
}
"""Each op's body in plain ATen, by its arguments' names: what a CPU graph traces in its place
(these ops belong to no registry entry: `memory/accumulate.py` inserts them)."""
