"""Triton source generation: templates rendered with a specialization key into content-hashed
modules that are imported from disk."""

from seqcompile.codegen.cache import KernelSource
from seqcompile.codegen.launches import (
    Launch,
    LaunchCount,
    LaunchRecord,
    counting_launches,
    recording_launches,
)
from seqcompile.codegen.render import kernel_function, prepare_kernel
from seqcompile.codegen.spec import KernelSpec

__all__ = [
    "KernelSource",
    "KernelSpec",
    "Launch",
    "LaunchCount",
    "LaunchRecord",
    "counting_launches",
    "kernel_function",
    "prepare_kernel",
    "recording_launches",
]
