"""seqcompile: the `seqfast` torch.compile backend for training transformers.

`torch.compile(model, backend="seqfast")` needs no import of this package; import it for
`explain`, `plan_batch`, `memory_timeline`, `register_pattern` and `Options`.
"""

from seqcompile.run import runtime as _runtime

_runtime.request_interpreter_if_asked()  # before anything below imports Triton

import importlib  # noqa: E402
from typing import Any  # noqa: E402

from seqcompile.explain import explain  # noqa: E402
from seqcompile.options import Options  # noqa: E402
from seqcompile.report import CompileReport  # noqa: E402

_LATER = {
    "BatchPlan": "seqcompile.memory.batch_plan",
    "plan_batch": "seqcompile.memory.batch_plan",
    "register_pattern": "seqcompile.patterns.user",
    "unregister_pattern": "seqcompile.patterns.user",
    "MemoryTimelines": "seqcompile.memory.timeline",
    "memory_timeline": "seqcompile.memory.timeline",
}
"""Public names whose modules load the compiler's stages (and Triton), imported on first use, so
that importing one stage (`seqcompile.capture`) loads no other."""


def __getattr__(name: str) -> Any:
    if name not in _LATER:
        raise AttributeError(f"module 'seqcompile' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LATER[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LATER])


__version__ = "0.1.0"
__all__ = [
    "BatchPlan",
    "CompileReport",
    "MemoryTimelines",
    "Options",
    "__version__",
    "explain",
    "memory_timeline",
    "plan_batch",
    "register_pattern",
    "unregister_pattern",
]
