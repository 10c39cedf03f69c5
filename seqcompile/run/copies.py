"""Copies a launcher makes of a tensor its kernel does not read through its strides (a strided
row, a transposed gradient), counted while a `counting_copies()` block is open, so the report
can say which fused op copied which argument instead of copying silently."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

_lock = threading.Lock()
_open: list[collections.Counter[str]] = []


def for_kernel(
    t: torch.Tensor,
    op: str,
    argument: str,
    make: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous,
) -> torch.Tensor:
    """`make(t)` (by default `t.contiguous()`), counted as a copy of `op`'s `argument` where it
    made one (it holds other memory than `t`). A trace (fake values: a lowering traced at
    compile time) copies nothing and counts nothing."""
    laid_out = make(t)
    if _open and t.numel() and not is_fake(t) and _storage(laid_out) != _storage(t):
        label = f"{op}: {argument} {tuple(t.shape)} strides {t.stride()}"
        with _lock:
            for count in _open:
                count[label] += 1
    return laid_out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@contextlib.contextmanager
def counting_copies() -> Iterator[collections.Counter[str]]:
    """Count, per fused op, argument, shape and strides, the copies launchers make in this block."""
    count: collections.Counter[str] = collections.Counter()
    with _lock:
        _open.append(count)
    try:
        yield count
    finally:
        with _lock:
            _open[:] = [c for c in _open if c is not count]  # equal counts differ
