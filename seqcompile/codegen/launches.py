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
    """Launches per kernel (a template and its specialization key), counted while open."""

    def __init__(self) -> None:
        self.by_spec: collections.Counter[KernelSpec] = collections.Counter()

    def of(self, name: str) -> int:
        """Launches of the kernels called `name`: a template (`"add_norm_fwd"`), or a template and
        the `mode` of its key (`"cross_entropy:backward"`, `"pointwise:forward"`)."""
        return sum(n for spec, n in self.by_spec.items() if name in (spec.template, spec.name))

    def names(self) -> dict[str, int]:
        """Launches by kernel name (`KernelSpec.name`)."""
        totals: collections.Counter[str] = collections.Counter()
        for spec, n in self.by_spec.items():
            totals[spec.name] += n
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

    def __init__(self, spec: KernelSpec, jit: Any) -> None:
        self.spec = spec
        self.jit = jit

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launch = self.jit[grid]

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = launch(*args, **kwargs)
            if _open:
                with _lock:
                    for count in _open:
                        count.by_spec[self.spec] += 1
            return result

        return counted
