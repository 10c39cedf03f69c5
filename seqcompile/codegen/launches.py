"""Counts of generated-kernel launches while a `counting_launches()` block is open: how a test
proves that the generated kernels ran rather than the reference implementation."""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seqcompile.codegen.render import KernelSpec

_lock = threading.Lock()
_open: list[LaunchCount] = []


class LaunchCount:
    """Launches per kernel (a template and its specialization key, which name one generated
    file), counted while open."""

    def __init__(self) -> None:
        self._by_kernel: collections.Counter[CountedKernel] = collections.Counter()

    def of(self, name: str) -> int:
        """Launches of the kernels called `name`: a template (`"add_norm_fwd"`), or a template and
        the `mode` of its key (`"cross_entropy:backward"`, `"pointwise:forward"`)."""
        return sum(n for k, n in self._items() if name in (k.spec.template, k.spec.name))

    def names(self) -> dict[str, int]:
        """Launches by kernel name (`KernelSpec.name`)."""
        return self._total(lambda kernel: kernel.spec.name)

    def files(self) -> dict[str, int]:
        """Launches by generated file (its stem, `<template>_<hash>`)."""
        return self._total(lambda kernel: kernel.stem)

    def add(self, kernel: CountedKernel) -> None:
        with _lock:
            self._by_kernel[kernel] += 1

    def _items(self) -> list[tuple[CountedKernel, int]]:
        with _lock:  # launches on other threads add to the counter meanwhile
            return list(self._by_kernel.items())

    def _total(self, label: Callable[[CountedKernel], str]) -> dict[str, int]:
        totals: collections.Counter[str] = collections.Counter()
        for kernel, n in self._items():
            totals[label(kernel)] += n
        return dict(sorted(totals.items()))

    def __repr__(self) -> str:
        return f"LaunchCount({self.names()})"


@contextlib.contextmanager
def counting_launches() -> Iterator[LaunchCount]:
    """Count every generated kernel launched in this block (on any thread)."""
    count = LaunchCount()
    with _lock:
        _open.append(count)
    try:
        yield count
    finally:
        with _lock:
            _open.remove(count)


class CountedKernel:
    """A generated `@triton.jit` function, launched as one is (`kernel[grid](...)`), with each
    launch added to the open counts. `jit` is the function itself, for Triton's own tools."""

    def __init__(self, spec: KernelSpec, stem: str, jit: Any) -> None:
        self.spec = spec
        self.stem = stem
        """The generated file's stem, also the function's name."""
        self.jit = jit

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.jit[grid]
        if not _open:  # nothing is counting: Triton's own launcher, at its own cost
            return launch

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = launch(*args, **kwargs)
            for count in list(_open):
                count.add(self)
            return result

        return counted
