"""Compile options for the `seqfast` backend.

Each option comes from `torch.compile(..., options={...})`, else from the environment variable
`SEQFAST_<NAME>` (an empty one counts as unset), else from its default; names and values are
validated with errors that name where the value came from (`options["rest"]` or `SEQFAST_REST`) and
list the valid choices. Dynamo calls a backend only when the compiled function first runs, so that
is when they are checked (`Options.resolve(options)` checks them at any time).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from seqcompile.run.settings import FALSE_WORDS, TRUE_WORDS, OptionError

REST_CHOICES = ("inductor", "eager")
PARTITION_CHOICES = ("auto", "min_cut", "default")
LOG_CHOICES = ("debug", "info", "warning", "error")
CHECKPOINT_CHOICES = ("auto", "none", "torch")
IMPLEMENTATION_CHOICES = ("auto", "kernel", "lowering", "vendor")
"""What `implementations` may ask of a fused operator: "auto" (chosen per call, by measurement on
CUDA), or one implementation the operator offers (`FusedOp.implementations`)."""
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def size_with_unit(text: str) -> int | None:
    """Bytes in a size such as "6GiB", "512 MB" or "100B" (None if `text` is not one)."""
    match = re.fullmatch(
        r"(\d+(?:\.\d+)?)(B|KB|MB|GB|KIB|MIB|GIB)", text.strip().upper().replace(" ", "")
    )
    return int(float(match[1]) * _UNITS[match[2]]) if match else None


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a value came from, as an error names it: `options["rest"]` or `SEQFAST_REST`."""

    name: str
    environment: bool = False

    def __str__(self) -> str:
        return f"SEQFAST_{self.name.upper()}" if self.environment else f'options["{self.name}"]'

    @property
    def none(self) -> str:
        """How this origin spells "no value": None in options, unset (or empty) in the
        environment."""
        return "unset" if self.environment else "None"


def _parse_bool(where: Origin, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise OptionError(
        f"{where} must be {'' if where.environment else 'a bool or '}one of"
        f" {', '.join(map(repr, TRUE_WORDS + FALSE_WORDS))}; got {value!r}"
    )


def _parse_choice(choices: tuple[str, ...], allow_none: bool) -> Callable[[Origin, Any], Any]:
    def parse(where: Origin, value: Any) -> Any:
        if value is None and allow_none:
            return None
        if isinstance(value, str) and value.strip().lower() in choices:
            return value.strip().lower()
        extra = f" or {where.none}" if allow_none else ""
        valid = ", ".join(map(repr, choices))
        raise OptionError(f"{where} must be one of {valid}{extra}; got {value!r}")

    return parse


def _parse_count(where: Origin, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise OptionError(f"{where} must be a whole number >= 0; got {value!r}")


def _parse_path(where: Origin, value: Any) -> str | None:
    """A folder the dump can be written to: checked now, so a bad path is refused with the option
    named instead of failing with a bare OS error in the middle of a compile. Nothing is created
    here (that happens at the first dump)."""
    if value is None and not where.environment:
        return None
    if not isinstance(value, str | os.PathLike) or not os.fspath(value).strip():
        raise OptionError(
            f"{where} must be a folder path (the dump's destination), or {where.none} for no"
            f" dump; got {value!r}"
        )
    path = os.path.abspath(os.fspath(value))
    existing = path
    while not os.path.exists(existing):  # the nearest folder that exists: where it would be made
        existing = os.path.dirname(existing)
    if existing != path and not os.path.isdir(existing):
        problem = f"{existing} is a file, so no folder can be made under it"
    elif existing == path and not os.path.isdir(path):
        problem = "it is a file, not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable"
    else:
        return os.fspath(value)
    raise OptionError(
        f"{where} = {os.fspath(value)!r} cannot hold the dump: {problem}; give a folder that can"
        " be created and written"
    )


def _parse_implementations(where: Origin, value: Any) -> Mapping[str, str]:
    """A fused operator's (or a family's) name to "auto" or an implementation it offers: a dict,
    or in the environment "attention=lowering,add_norm=kernel"."""
    if isinstance(value, str) and where.environment:
        pairs = [p.split("=", 1) for p in re.split(r"[,;\s]+", value.strip()) if p]
        if not all(len(p) == 2 for p in pairs):
            raise OptionError(
                f'{where} must be "name=implementation" pairs separated by commas, such as'
                f' "attention=lowering,add_norm=kernel"; got {value!r}'
            )
        value = {name.strip(): choice.strip() for name, choice in pairs}
    if not isinstance(value, Mapping):
        raise OptionError(
            f"{where} must be a dict of fused operator names to one of"
            f" {', '.join(map(repr, IMPLEMENTATION_CHOICES))}, such as"
            f' {{"attention": "lowering"}}; got {value!r}'
        )
    from seqcompile.ops.registry import implementations_offered  # the registry is the truth

    offered = implementations_offered()
    chosen = {}
    for name, choice in value.items():
        if name not in offered:
            raise OptionError(
                f"{where} names {name!r}, which is no fused operator or family; the names are"
                f" {', '.join(map(repr, offered))}"
            )
        valid = ("auto", *offered[name])
        text = choice.strip().lower() if isinstance(choice, str) else choice
        if text not in valid:
            raise OptionError(
                f"{where} asks {choice!r} of {name!r}, which takes one of"
                f" {', '.join(map(repr, valid))}"
            )
        chosen[name] = text
    return chosen


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


def _parse_budget(where: Origin, value: Any) -> Budget:
    if isinstance(value, Budget):
        return value
    try:
        return Budget.parse(value)
    except ValueError as error:
        raise OptionError(
            f"{where} must be a fraction of the save-everything plan in (0, 1] or a"
            f' size such as "6GiB" or "512MB"; {error}'
        ) from None


@dataclasses.dataclass(frozen=True)
class Options:
    """Resolved options of one compile. Build with `Options.resolve(user_options)`."""

    rest: str | None = None
    """Executor for what no pattern covers: "inductor", "eager", or None (inductor, or eager on a
    CPU machine where Inductor finds no C++ compiler)."""
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
    logits); 0 picks, on a GPU, as many even chunks as each give the matmuls two waves of tiles
    within the step's planned peak (`memory/loss_chunks.py`), elsewhere an eighth of the tokens,
    or all of them when the logits are under 2^20 elements."""
    reuse_saved: bool = True
    """The backward writes a result over a saved tensor it reads last (the cross-entropy gradient
    over the logits). A backward that keeps the graph for another (`retain_graph=True`) writes
    over a copy instead, so a second backward works; False never writes over saved tensors."""
    memory_budget: Budget = Budget(fraction=1.0)
    """What the forward may keep for the backward: a fraction of the save-everything plan, or a
    size per compiled graph."""
    accumulate_grads: bool = False
    """The backward adds parameters' gradients straight into their existing `.grad` (the
    weight-gradient matmul accumulates into it) instead of handing them to autograd."""
    checkpoint: str = "auto"
    """Who plans what the backward recomputes: "auto" (seqfast's planner: at any budget what is
    cheap, never a matmul or attention; under `memory_budget` whatever else it takes), "torch"
    (torch's min-cut with its `activation_memory_budget`, fractions only) or "none" (nothing
    recomputed beyond the partitioner's choice and the user's checkpoints)."""

    implementations: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Per fused operator (`attention`) or family (`loss`): "auto" (the default: chosen per call,
    by measurement on CUDA) or the implementation every call of it runs: "kernel" (the fused op's
    generated kernels), "lowering" (its ATen lowering compiled by the executor with its
    neighbours) or "vendor" (a vendor library's kernel, where the operator offers one: attention's
    SDPA flash kernels; a call they cannot express runs its kernel). An operator's own name wins
    over its family's."""
    verify: bool = False
    """Run each compiled graph beside the captured one (eager) on the inputs it was compiled for,
    forward and backward, and compare; a fused site that makes them differ is found by bisection
    and left unfused, with a warning, a reproduction script in the dump folder and a line in the
    report."""

    @classmethod
    def resolve(
        cls, options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Options:
        """Merge explicit options over `SEQFAST_*` environment variables over defaults. An empty
        (or blank) environment variable counts as unset; in `options`, leave a name out (or give
        None where the option takes None) for its default."""
        environ = os.environ if environ is None else environ
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise OptionError(_not_a_dict(options))
        unknown = sorted(map(repr, set(options) - set(_PARSERS)))
        if unknown:
            raise OptionError(
                f"unknown seqfast option(s) {', '.join(unknown)};"
                f" valid options are {', '.join(map(repr, _PARSERS))}"
            )
        values, origins = {}, {}
        for name, parse in _PARSERS.items():
            from_env = environ.get(f"SEQFAST_{name.upper()}", "")
            if name in options:
                origins[name] = Origin(name)
                values[name] = parse(origins[name], options[name])
            elif from_env.strip():
                origins[name] = Origin(name, environment=True)
                values[name] = parse(origins[name], from_env)
        resolved = cls(**values)
        resolved._check_budget(
            origins.get("memory_budget", Origin("memory_budget")),
            origins.get("checkpoint", Origin("checkpoint")),
        )
        return resolved

    def _check_budget(self, budget: Origin, checkpoint: Origin) -> None:
        if self.memory_budget.unlimited:
            return
        if self.checkpoint == "none":
            raise OptionError(
                f'{budget} = {self.memory_budget} needs {checkpoint} "auto" or "torch" to'
                ' recompute anything; got "none"'
            )
        if self.checkpoint == "torch" and self.memory_budget.size is not None:
            raise OptionError(
                f'{checkpoint} = "torch" takes a fractional {budget}'
                f" (torch's activation_memory_budget); got {self.memory_budget}"
            )


def _not_a_dict(options: object) -> str:
    """The error for options that are not a dict, with the dict a "name=value" string meant."""
    example = '{"memory_budget": 0.5, "rest": "eager"}'
    if isinstance(options, str):
        pairs = [p.split("=", 1) for p in re.split(r"[,;\s]+", options.strip()) if p]
        if pairs and all(len(p) == 2 and p[0] for p in pairs):
            example = "{" + ", ".join(f"{k.strip()!r}: {v.strip()!r}" for k, v in pairs) + "}"
    return (
        "seqfast options must be a dict of option names to values, such as"
        f' torch.compile(model, backend="seqfast", options={example});'
        f" got the {type(options).__name__} {options!r}"
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
    "implementations": _parse_implementations,
    "verify": _parse_bool,
}
assert set(_PARSERS) == {f.name for f in dataclasses.fields(Options)}
