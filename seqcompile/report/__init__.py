"""The compile report: its data (`data`: plain dataclasses any stage may write, and the
collecting of reports) and its text (`text`)."""

from seqcompile.report.data import (
    CompileReport,
    ImplementationUse,
    KernelUse,
    MemoryPlan,
    Missed,
    collecting,
    publish,
)
from seqcompile.report.text import format_bytes

__all__ = [
    "CompileReport",
    "ImplementationUse",
    "KernelUse",
    "MemoryPlan",
    "Missed",
    "collecting",
    "format_bytes",
    "publish",
]
