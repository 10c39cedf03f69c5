"""seqcompile: the `seqfast` torch.compile backend for training transformers.

`torch.compile(model, backend="seqfast")` needs no import of this package; import it for
`explain`, `plan_batch`, `memory_timeline`, `register_pattern` and `Options`.
"""

from seqcompile.run import runtime as _runtime

_runtime.request_interpreter_if_asked()  # before anything below imports Triton

from seqcompile.batch_plan import BatchPlan, plan_batch  # noqa: E402
from seqcompile.explain import explain  # noqa: E402
from seqcompile.options import Options  # noqa: E402
from seqcompile.patterns.user import register_pattern, unregister_pattern  # noqa: E402
from seqcompile.report import CompileReport  # noqa: E402
from seqcompile.timeline import MemoryTimelines, memory_timeline  # noqa: E402

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
