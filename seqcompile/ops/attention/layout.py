"""How `seqfast::attention` sees its operands: any batch dimensions that broadcast (heads, the third
dimension from the end, may also group as SDPA's `enable_gqa`) become the 4-D
(batch, heads, length, head_dim) views the kernels and the reference work on, and gradients go back
to the operands' own shapes by summing over what was broadcast."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.run import copies

Tensor = torch.Tensor


def broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether `shape` broadcasts to exactly `target` (symbolic sizes only when provably so)."""
    if len(shape) > len(target):
        return False
    return all(
        statically_known_true(s == 1) or statically_known_true(s == t)
        for s, t in zip(reversed(shape), reversed(target), strict=False)
    )


def _padded(t: Tensor, dims: int) -> Tensor:
    return t.view((1,) * (dims - t.dim()) + tuple(t.shape)) if t.dim() < dims else t


@dataclasses.dataclass(frozen=True)
class Layout:
    dims: int
    """Rank every operand is padded to (at least 4)."""
    outer: tuple[int, ...]
    """Broadcast batch dimensions before the heads; flattened into the 4-D batch."""
    heads: int
    kv_heads: int
    result_batch: tuple[int, ...]
    """Batch dimensions of the eager result (before its last two)."""

    @classmethod
    def of(cls, q: Tensor, k: Tensor, v: Tensor) -> Layout:
        if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
            raise ValueError(
                f"seqfast::attention needs (..., length, head_dim) operands; got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        same_dim = q.shape[-1] == k.shape[-1] == v.shape[-1]
        if k.shape[-2] != v.shape[-2] or not same_dim:
            raise ValueError(
                f"seqfast::attention: k and v must have the same length, and q, k, v the same "
                f"head dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        batch_dims = max(q.dim(), k.dim(), v.dim()) - 2
        dims = max(batch_dims, 2) + 2
        qp, kp, vp = (_padded(t, dims) for t in (q, k, v))
        kv_batch = torch.broadcast_shapes(kp.shape[:-2], vp.shape[:-2])
        q_heads, kv_heads = qp.shape[-3], kv_batch[-1]
        heads = kv_heads if q_heads == 1 else q_heads
        # no key/value heads: only no query heads (an empty result, as eager's) group over them
        if (kv_heads == 0 and heads != 0) or (kv_heads != 0 and heads % kv_heads):
            raise ValueError(
                f"seqfast::attention: query heads ({q_heads}) must be a multiple of key/value "
                f"heads ({kv_heads})"
            )
        outer = tuple(torch.broadcast_shapes(qp.shape[:-3], kv_batch[:-1]))
        full = (*outer, heads)
        return cls(dims, outer, heads, kv_heads, full[len(full) - batch_dims :])

    @property
    def batch(self) -> int:
        return math.prod(self.outer)

    def scores_shape(self, q: Tensor, k: Tensor) -> tuple[int, ...]:
        return (*self.result_batch, q.shape[-2], k.shape[-2])

    def to4(self, t: Tensor, name: str, heads: int | None = None) -> Tensor:
        """`t` (the argument `name`) as a 4-D view (batch, heads, rows, cols); `heads` expands a
        single head. Where batch dims broadcast over several of the outer dims, the merge copies,
        and the copy is counted."""
        t = _padded(t, self.dims)
        own_heads = t.shape[-3] if heads is None else heads
        t = t.expand(*self.outer, own_heads, *t.shape[-2:])
        return copies.for_kernel(
            t, "attention", name, lambda t: t.reshape(self.batch, *t.shape[-3:])
        )

    def from4(self, grad: Tensor, like: Tensor) -> Tensor:
        """A 4-D gradient summed back to the shape of the operand `like`."""
        grad = grad.reshape(*self.outer, *grad.shape[1:])
        return grad.sum_to_size(_padded(like, self.dims).shape).reshape(like.shape)


def scores_shape4(q: Tensor, k: Tensor) -> tuple[int, int, int, int]:
    """The scores' shape for 4-D q and k: (batch, heads, queries, keys)."""
    return (q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def strides4(t: Tensor | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of `t` broadcast to the 4-D `shape` (zero along broadcast dimensions); none for
    no tensor."""
    return tuple(t.expand(shape).stride()) if t is not None else ()
