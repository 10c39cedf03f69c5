"""Where fused operators run: compiled Triton kernels on CUDA tensors; on CPU tensors the reference
implementation, or the generated kernels under Triton's interpreter when `SEQFAST_INTERPRET=1`."""

from __future__ import annotations

import os

import torch

from seqcompile.run.settings import switch_on


def interpreting() -> bool:
    return switch_on("SEQFAST_INTERPRET")


def request_interpreter_if_asked() -> None:
    """Set `TRITON_INTERPRET=1` when `SEQFAST_INTERPRET` asks for it. Triton decides at import
    whether its own library functions are interpreted, so this runs when seqcompile is imported."""
    if interpreting():
        os.environ["TRITON_INTERPRET"] = "1"


FUSED_OP_DEVICES = ("cpu", "cuda", "meta")
"""Devices fused ops run on: CUDA launches the kernels, CPU the interpreter or the reference, and
meta the reference on shapes alone (what `plan_batch` compiles on)."""


def runs_fused_ops(device: torch.device) -> bool:
    """Whether fused ops can take tensors on `device` (patterns refuse the others)."""
    return device.type in FUSED_OP_DEVICES


def use_kernels(tensor: torch.Tensor) -> bool:
    """True when a fused op on `tensor` should launch its generated kernels."""
    if tensor.device.type == "cuda":
        return True
    return tensor.device.type == "cpu" and interpreting()


def prepare_triton() -> None:
    """Check, before a generated kernel module is imported, that Triton can run it here."""
    if not interpreting():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl

    if type(getattr(tl, "sum", None)).__name__ == "JITFunction":
        raise RuntimeError(
            "SEQFAST_INTERPRET=1 needs Triton's interpreter, but Triton was imported before it "
            "was requested (torch.compile imports it). Set TRITON_INTERPRET=1 in the environment "
            "as well, or `import seqcompile` before the first torch.compile call."
        )


def poisoning() -> bool:
    return switch_on("SEQFAST_POISON")


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output. With `SEQFAST_POISON=1` it starts as NaN (an integer output as
    its dtype's largest value, a boolean one as True), so an element a kernel forgets to write
    shows up in tests instead of passing by luck."""
    if poisoning():
        return torch.full(shape, _poison(dtype), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _poison(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return True if dtype == torch.bool else torch.iinfo(dtype).max


def multiprocessors(device: torch.device) -> int | None:
    """The streaming multiprocessors of a CUDA device; None elsewhere (no waves to fill)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def program_cap(tensor: torch.Tensor) -> int:
    """How many programs a persistent-style kernel should start on `tensor`'s device."""
    processors = multiprocessors(tensor.device)
    if processors is not None:
        return 4 * processors
    return 4  # the interpreter runs programs one after another; few programs, fewer partials
