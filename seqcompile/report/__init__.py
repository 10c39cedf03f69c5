"""The compile report: its data (`data`: plain dataclasses any stage may write, and the
collecting of reports) and, above it, its text (`text`), which `str(report)` gives."""

from seqcompile.report.data import (
    CompileReport,
    ImplementationUse,
    KernelUse,
    MemoryPlan,
    Missed,
    collecting,
    publish,
)
from seqcompile.report.text import format_bytes, render

CompileReport.__str__ = render  # the report's text, from the floor above its data

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
