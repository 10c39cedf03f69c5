"""The dropout streams' Philox blocks on CPU from small C functions (`philox.c`), as ops:
`seqfast::philox_uniforms` (the flat stream's numbers) and `seqfast::philox_grid` (the words of a
grid of counters, attention's stream).

Written out in ATen, a stream is some 150 integer operations per dropout site, and Inductor
generates, fuses and compiles C++ for all of them at every site: most of a CPU compile's time
where the model has dropout. As this op, a traced graph holds one call per site, which Inductor
leaves opaque. The C file is compiled once per machine into the kernel cache folder (named by the
hash of its text and the compiler's command) and loaded with ctypes. Where no C compiler works,
`available()` is False, with the reason logged once, and the stream stays written out: the same
numbers either way."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

from seqcompile.codegen.cache import cache_dir, text_digest

log = logging.getLogger("seqcompile")

COMPILER_ENV = "CC"
"""The C compiler to use, as the usual build variable names it; else the first of `COMPILERS`."""
COMPILERS = ("cc", "gcc", "clang")
FLAGS = ("-O3", "-shared", "-fPIC")


def _compiler() -> tuple[str, ...] | None:
    given = shlex.split(os.environ.get(COMPILER_ENV, ""))
    if given:
        return tuple(given)
    found = next((c for c in COMPILERS if shutil.which(c)), None)
    return (found,) if found else None


def _build(source: str, compiler: tuple[str, ...]) -> Path:
    """The shared library of `source`, compiled by `compiler` unless the cache already holds it."""
    command = (*compiler, *FLAGS)
    library = cache_dir() / f"philox-{text_digest(source + repr(command))}.so"
    if library.exists():
        return library
    with tempfile.TemporaryDirectory(dir=library.parent, prefix=".philox-") as folder:
        c_file = Path(folder) / "philox.c"
        c_file.write_text(source, encoding="utf-8")
        built = Path(folder) / library.name
        subprocess.run(
            [*command, str(c_file), "-o", str(built)], check=True, capture_output=True, text=True
        )
        os.replace(built, library)  # whole or absent for a process loading it at the same time
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        log.info(
            "seqfast: no C compiler (%s, or $%s); the dropout stream is written out",
            COMPILERS,
            COMPILER_ENV,
        )
        return None
    source = resources.files("seqcompile.ops").joinpath("philox.c").read_text(encoding="utf-8")
    try:
        library = ctypes.CDLL(str(_build(source, compiler)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("seqfast: the CPU dropout stream did not compile (%s); written out", detail)
        return None
    pointer, uint32, int64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int64
    library.seqfast_philox_uniforms.argtypes = (pointer, uint32, int64, pointer)
    int32 = ctypes.c_int32
    library.seqfast_philox_grid.argtypes = (pointer, uint32, int32, int64, int64, int64, pointer)
    for function in (library.seqfast_philox_uniforms, library.seqfast_philox_grid):
        function.restype = None
    return library


def available() -> bool:
    """Whether this machine runs the stream's C function (compiled on the first ask)."""
    return _library() is not None


@torch.library.custom_op("seqfast::philox_uniforms", mutates_args=())
def philox_uniforms(seed: torch.Tensor, count: int, stream: int) -> torch.Tensor:
    """The stream's first `count` numbers under the int64 `seed` (a CPU tensor of one element),
    as `ops.random.uniforms` defines them."""
    library, seed = _checked("philox_uniforms", seed)
    out = torch.empty(count, dtype=torch.float32)
    library.seqfast_philox_uniforms(seed.data_ptr(), stream & 0xFFFFFFFF, count, out.data_ptr())
    return out


@philox_uniforms.register_fake
def _(seed: torch.Tensor, count: int, stream: int) -> torch.Tensor:
    return seed.new_empty((count,), dtype=torch.float32)


@torch.library.custom_op("seqfast::philox_grid", mutates_args=())
def philox_grid(
    seed: torch.Tensor, planes: int, rows: int, cols: int, stream: int, rounds: int
) -> torch.Tensor:
    """The words of the blocks on the counters (z, i, stream, j) under the int64 `seed` (a CPU
    tensor of one element), as `ops.random.grid_words` defines them: int32, (planes, rows, cols,
    4)."""
    library, seed = _checked("philox_grid", seed)
    out = torch.empty((planes, rows, cols, 4), dtype=torch.int32)
    library.seqfast_philox_grid(
        seed.data_ptr(), stream & 0xFFFFFFFF, rounds, planes, rows, cols, out.data_ptr()
    )
    return out


@philox_grid.register_fake
def _(
    seed: torch.Tensor, planes: int, rows: int, cols: int, stream: int, rounds: int
) -> torch.Tensor:
    return seed.new_empty((planes, rows, cols, 4), dtype=torch.int32)


def _checked(op: str, seed: torch.Tensor) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The library and the seed as the C functions read it, or the error of a call they cannot
    serve."""
    library = _library()
    if library is None or seed.device.type != "cpu" or seed.numel() != 1:
        raise RuntimeError(f"seqfast::{op} runs on CPU, on a one-element seed, where available()")
    return library, seed.to(torch.int64).contiguous()
