"""Compile options for the `seqfast` backend.

Each option comes from `torch.compile(..., options={...})`, else from the environment variable
`SEQFAST_<NAME>`, else from its default; names and values are validated with errors that list the
valid choices.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
REST_CHOICES = ("inductor", "eager")
PARTITION_CHOICES = ("auto", "min_cut", "default")
LOG_CHOICES = ("debug", "info", "warning", "error")
CHECKPOINT_CHOICES = ("auto", "none", "torch")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def size_with_unit(text: str) -> int | None:
    """Bytes in a size such as "6GiB", "512 MB" or "100B" (None if `text` is not one)."""
    match = re.fullmatch(
        r"(\d+(?:\.\d+)?)(B|KB|MB|GB|KIB|MIB|GIB)", text.strip().upper().replace(" ", "")
    )
    return int(float(match[1]) * _UNITS[match[2]]) if match else None


class OptionError(ValueError):
    """An unknown option name or an invalid value."""


def _parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise OptionError(
        f'options["{name}"] must be a bool or one of {", ".join(map(repr, _TRUE + _FALSE[:-1]))};'
        f" got {value!r}"
    )


def _parse_choice(choices: tuple[str, ...], allow_none: bool) -> Callable[[str, Any], Any]:
    def parse(name: str, value: Any) -> Any:
        if value is None and allow_none:
            return None
        if isinstance(value, str) and value.strip().lower() in choices:
            return value.strip().lower()
        extra = " or None" if allow_none else ""
        valid = ", ".join(map(repr, choices))
        raise OptionError(f'options["{name}"] must be one of {valid}{extra}; got {value!r}')

    return parse


def _parse_count(name: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise OptionError(f'options["{name}"] must be a whole number >= 0; got {value!r}')


def _parse_path(name: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, str | os.PathLike):
        return os.fspath(value)
    raise OptionError(f'options["{name}"] must be a directory path or None; got {value!r}')


@dataclasses.dataclass(frozen=True)
class Budget:
    """How much the forward may keep for the backward: a fraction of the save-everything plan, or
    a size in bytes (per compiled graph)."""

    fraction: float | None = None
    size: int | None = None

    @classmethod
    def parse(cls, value: float | int | str) -> Budget:
        """`0.5` (a fraction in (0, 1]), `"6GiB"`, `"512 MB"` or a whole number of bytes; raises
        ValueError otherwise."""
        if isinstance(value, str):
            text = value.strip().upper().replace(" ", "")
            size = size_with_unit(text)
            if size is not None:
                return cls(size=size)
            try:
                value = int(text) if text.isdigit() else float(text)
            except ValueError:
                raise ValueError(f"not a fraction or a size: {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"not a fraction or a size: {value!r}")
        if 0 < value <= 1:
            return cls(fraction=float(value))
        if isinstance(value, int) and value > 1:
            return cls(size=value)
        raise ValueError(f"a fraction must be in (0, 1] and a size a whole number > 1: {value!r}")

    @property
    def unlimited(self) -> bool:
        return self.fraction == 1.0

    def target(self, baseline_bytes: int) -> int:
        if self.size is not None:
            return self.size
        return int(self.fraction * baseline_bytes)

    def __str__(self) -> str:
        return f"{self.fraction:g}" if self.size is None else f"{self.size} bytes"


def _parse_budget(name: str, value: Any) -> Budget:
    if isinstance(value, Budget):
        return value
    try:
        return Budget.parse(value)
    except ValueError as error:
        raise OptionError(
            f'options["{name}"] must be a fraction of the save-everything plan in (0, 1] or a'
            f' size such as "6GiB" or "512MB"; {error}'
        ) from None


@dataclasses.dataclass(frozen=True)
class Options:
    """Resolved options of one compile. Build with `Options.resolve(user_options)`."""

    rest: str | None = None
    """Executor for what no pattern covers: "inductor", "eager", or None (inductor on CUDA,
    eager on CPU)."""
    dump_dir: str | None = None
    """Directory that receives, per compiled graph, every stage's graph, kernel sources and
    report.txt."""
    disable: bool = False
    """Compile nothing: the captured graph runs as Dynamo handed it over."""
    partition: str = "auto"
    """How the backward's saved values are chosen: "min_cut" (recompute cheap ops), "default"
    (save what eager saves), or "auto" (min_cut with inductor, default with eager)."""
    log: str | None = None
    """Level of the "seqcompile" logger; None leaves it as configured (e.g. by TORCH_LOGS)."""
    loss_chunk: int = 0
    """Tokens per chunk of the fused linear + cross-entropy (its extra memory is one chunk of
    logits); 0 picks an eighth of the tokens."""
    reuse_saved: bool = True
    """The backward writes a result over a saved tensor it reads last (the cross-entropy gradient
    over the logits). A second backward through the same graph (`retain_graph=True`) then fails
    with autograd's "modified by an inplace operation" error; False keeps saved tensors intact."""
    memory_budget: Budget = Budget(fraction=1.0)
    """What the forward may keep for the backward: a fraction of the save-everything plan, or a
    size per compiled graph."""
    accumulate_grads: bool = False
    """The backward adds parameters' gradients straight into their existing `.grad` (the
    weight-gradient matmul accumulates into it) instead of handing them to autograd."""
    checkpoint: str = "auto"
    """Who meets `memory_budget`: "auto" (seqfast's planner), "torch" (torch's min-cut with its
    `activation_memory_budget`, fractions only) or "none" (nothing recomputed beyond the
    partitioner's choice and the user's checkpoints)."""

    verify: bool = False
    """Run each compiled graph beside the captured one (eager) on the inputs it was compiled for,
    forward and backward, and compare; a fused site that makes them differ is found by bisection
    and left unfused, with a warning, a reproduction script in the dump folder and a line in the
    report."""

    @classmethod
    def resolve(
        cls, options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Options:
        """Merge explicit options over `SEQFAST_*` environment variables over defaults."""
        environ = os.environ if environ is None else environ
        options = dict(options or {})
        unknown = sorted(set(options) - set(_PARSERS))
        if unknown:
            raise OptionError(
                f"unknown seqfast option(s) {', '.join(map(repr, unknown))};"
                f" valid options are {', '.join(map(repr, _PARSERS))}"
            )
        values = {}
        for name, parse in _PARSERS.items():
            env_name = f"SEQFAST_{name.upper()}"
            if name in options:
                values[name] = parse(name, options[name])
            elif env_name in environ:
                values[name] = parse(name, environ[env_name])
        resolved = cls(**values)
        resolved._check_budget()
        return resolved

    def _check_budget(self) -> None:
        if self.memory_budget.unlimited:
            return
        if self.checkpoint == "none":
            raise OptionError(
                f'options["memory_budget"] = {self.memory_budget} needs options["checkpoint"]'
                ' "auto" or "torch" to recompute anything; got "none"'
            )
        if self.checkpoint == "torch" and self.memory_budget.size is not None:
            raise OptionError(
                'options["checkpoint"] = "torch" takes a fractional options["memory_budget"]'
                f" (torch's activation_memory_budget); got {self.memory_budget}"
            )


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "rest": _parse_choice(REST_CHOICES, allow_none=True),
    "dump_dir": _parse_path,
    "disable": _parse_bool,
    "partition": _parse_choice(PARTITION_CHOICES, allow_none=False),
    "log": _parse_choice(LOG_CHOICES, allow_none=True),
    "loss_chunk": _parse_count,
    "reuse_saved": _parse_bool,
    "memory_budget": _parse_budget,
    "checkpoint": _parse_choice(CHECKPOINT_CHOICES, allow_none=False),
    "accumulate_grads": _parse_bool,
    "verify": _parse_bool,
}
assert set(_PARSERS) == {f.name for f in dataclasses.fields(Options)}
