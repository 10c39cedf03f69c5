"""Compile options for the `seqfast` backend.

Each option comes from `torch.compile(..., options={...})`, else from the environment variable
`SEQFAST_<NAME>`, else from its default; names and values are validated with errors that list the
valid choices.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
REST_CHOICES = ("inductor", "eager")
PARTITION_CHOICES = ("auto", "min_cut", "default")
LOG_CHOICES = ("debug", "info", "warning", "error")


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
        return cls(**values)


_PARSERS: dict[str, Callable[[str, Any], Any]] = {
    "rest": _parse_choice(REST_CHOICES, allow_none=True),
    "dump_dir": _parse_path,
    "disable": _parse_bool,
    "partition": _parse_choice(PARTITION_CHOICES, allow_none=False),
    "log": _parse_choice(LOG_CHOICES, allow_none=True),
    "loss_chunk": _parse_count,
    "reuse_saved": _parse_bool,
}
assert set(_PARSERS) == {f.name for f in dataclasses.fields(Options)}
