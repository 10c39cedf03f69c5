"""Counts of generated-kernel launches while a `counting_launches()` block is open: how a test
proves that the generated kernels ran rather than the reference implementation. While a
`recording_launches()` block is open, each launch is also kept with what it passed, typed as
Triton types it: what compiling that launch ahead of time for a GPU needs.

While a `tracing_launches()` block is open, a launch is not run but traced (`wrap_triton`): a fused
call's implementation traced at fake values becomes graph nodes that the executor launches from
its own code. Under Triton's interpreter the traced kernel is a `JITFunction` that launches the
interpreted one, counted as any other launch."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from triton.runtime.jit import JITFunction

from seqcompile.codegen.spec import KernelSpec

_lock = threading.Lock()
_open: list[LaunchCount | LaunchRecord] = []
_tracing = threading.local()
_Listener = TypeVar("_Listener", "LaunchCount", "LaunchRecord")


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

    def add(self, kernel: CountedKernel, args: tuple, kwargs: dict[str, Any]) -> None:
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
    with _opened(LaunchCount()) as count:
        yield count


@contextlib.contextmanager
def _opened(listener: _Listener) -> Iterator[_Listener]:
    with _lock:
        _open.append(listener)
    try:
        yield listener
    finally:
        with _lock:
            _open[:] = [o for o in _open if o is not listener]  # equal counts differ


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a generated kernel, as Triton's launcher specializes it: `signature` types
    each argument of the function (`"*fp32"` for a float32 tensor, `"i32"`/`"i64"` for an int by
    its value, `"fp32"` for a float, `"u1"` for a bool, `"constexpr"`), `constexprs` gives the
    values compiled in (the `tl.constexpr` parameters, None, and ints equal to 1, which Triton
    turns into constants), `aligned` names the arguments Triton assumes divisible by 16 (pointers
    and ints), and `options` the compile options passed (`num_warps`, `num_stages`)."""

    spec: KernelSpec
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    aligned: tuple[str, ...]
    options: tuple[tuple[str, Any], ...]
    arguments: dict[str, Any] = dataclasses.field(compare=False, repr=False)
    """The values passed, by parameter name (tensors kept alive while the record is)."""

    @classmethod
    def of(
        cls, spec: KernelSpec, arguments: dict[str, tuple[Any, bool]], options: dict[str, Any]
    ) -> Launch:
        """The launch of `spec` with `arguments` (each value with whether its parameter is a
        `tl.constexpr`, as `CountedKernel.bind` gives them) and compile `options`."""
        from triton._C.libtriton import native_specialize_impl  # Triton's own launcher's typing
        from triton.backends.compiler import BaseBackend

        signature, constexprs, aligned = {}, {}, []
        for name, (value, constexpr) in arguments.items():
            kind, attribute = (
                ("constexpr", None)
                if constexpr
                else native_specialize_impl(BaseBackend, value, False, True, True)[:2]
            )
            signature[name] = kind
            if kind == "constexpr":
                constexprs[name] = value
            elif attribute == "D":
                aligned.append(name)
        values = {name: value for name, (value, _) in arguments.items()}
        return cls(
            spec, tuple(signature.items()), tuple(constexprs.items()), tuple(aligned),
            tuple(sorted(options.items())), values,
        )  # fmt: skip


class LaunchRecord(list[Launch]):
    """The launches made while open, in order (on any thread)."""

    def add(self, kernel: CountedKernel, args: tuple, kwargs: dict[str, Any]) -> None:
        launch = Launch.of(kernel.spec, *kernel.bind(args, kwargs))
        with _lock:
            self.append(launch)


@contextlib.contextmanager
def recording_launches() -> Iterator[LaunchRecord]:
    """Record every generated kernel launched in this block, with its arguments and their Triton
    types (`Launch`), as a list."""
    with _opened(LaunchRecord()) as record:
        yield record


@contextlib.contextmanager
def tracing_launches() -> Iterator[None]:
    """Trace the generated-kernel launches of this block (on this thread) instead of running them:
    each becomes a `triton_kernel_wrapper` node of the graph `make_fx` is tracing."""
    before = launches_traced()
    _tracing.on = True
    try:
        yield
    finally:
        _tracing.on = before


def launches_traced() -> bool:
    """Whether a `tracing_launches()` block is open on this thread."""
    return getattr(_tracing, "on", False)


class CountedKernel:
    """A generated `@triton.jit` function, launched as one is (`kernel[grid](...)`), with each
    launch added to the open counts. `jit` is the function itself, for Triton's own tools."""

    def __init__(self, spec: KernelSpec, stem: str, jit: Any) -> None:
        self.spec = spec
        self.stem = stem
        """The generated file's stem, also the function's name."""
        self.jit = jit
        self._traceable: JITFunction | None = None

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        if launches_traced():
            from torch.library import wrap_triton

            return wrap_triton(self.traceable())[grid]
        launch = self.jit[grid]
        if not _open:  # nothing is counting: Triton's own launcher, at its own cost
            return launch

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = launch(*args, **kwargs)
            for count in list(_open):
                count.add(self, args, kwargs)
            return result

        return counted

    def traceable(self) -> JITFunction:
        """The function a traced launch names: `jit` itself, or under the interpreter (whose
        functions `wrap_triton` does not trace) a `JITFunction` that launches it."""
        if self._traceable is None:
            self._traceable = self.jit if isinstance(self.jit, JITFunction) else _Interpreted(self)
            _BY_TRACEABLE[id(self._traceable)] = self
        return self._traceable

    def bind(
        self, args: tuple, kwargs: dict[str, Any]
    ) -> tuple[dict[str, tuple[Any, bool]], dict[str, Any]]:
        """A launch's arguments by parameter name, each with whether it is a `tl.constexpr`, and
        the keywords that are not parameters (Triton's compile options)."""
        parameters = inspect.signature(self.jit.fn).parameters
        named = {k: v for k, v in kwargs.items() if k in parameters}
        bound = inspect.Signature(list(parameters.values())).bind(*args, **named)
        bound.apply_defaults()
        arguments = {
            name: (value, "constexpr" in str(parameters[name].annotation))
            for name, value in bound.arguments.items()
        }
        return arguments, {k: v for k, v in kwargs.items() if k not in parameters}


_BY_TRACEABLE: dict[int, CountedKernel] = {}
"""Each kernel by the function its traced launches name (both live as long as the process's
kernel caches)."""


def counted_kernel(traceable: Any) -> CountedKernel | None:
    """The kernel whose traced launches name `traceable`; None for any other function."""
    return _BY_TRACEABLE.get(id(traceable))


class _Interpreted(JITFunction):
    """A `JITFunction` of an interpreted kernel's source, for tracing: where a traced graph
    launches it (`kernel[grid](...)`, or `run` from the autotuner `wrap_triton` wraps a launch's
    options in), the interpreted kernel runs, counted."""

    def __init__(self, kernel: CountedKernel) -> None:
        super().__init__(kernel.jit.fn)
        self._kernel = kernel

    @property
    def cache_key(self) -> str:
        """The generated file's stem, which names its text by hash (Triton's own key would walk
        the interpreted functions the kernel calls, which it cannot hash)."""
        return self._kernel.stem

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self._kernel[grid]

    def run(self, *args: Any, grid: Any, warmup: bool = False, **kwargs: Any) -> Any:
        return self._kernel[grid](*args, **kwargs)
