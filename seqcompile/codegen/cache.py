"""Content-hashed kernel files: generated source is written once under the cache directory,
named by the hash of its body, and imported from that file so tracebacks and `inspect` see it."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

_lock = threading.Lock()
_modules: dict[Path, ModuleType] = {}


def cache_dir() -> Path:
    """`$SEQFAST_CACHE_DIR`, else `~/.cache/seqcompile/kernels`."""
    root = os.environ.get("SEQFAST_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "seqcompile", "kernels"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """One generated kernel file."""

    name: str
    """Name of the `@triton.jit` function in the file, also the file's stem."""
    template: str
    key: tuple[tuple[str, object], ...]
    path: Path

    @property
    def source(self) -> str:
        return self.path.read_text()


def body_digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def write_source(stem: str, header: str, body: str) -> Path:
    """Write `header + body` to `<cache>/<stem>.py` unless that file exists already.

    `stem` must already carry the body's digest, so an existing file holds the same kernel.
    """
    path = cache_dir() / f"{stem}.py"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(header + body)
        os.replace(tmp, path)
    return path


def import_source(path: Path) -> ModuleType:
    """Import a generated file once per process."""
    with _lock:
        module = _modules.get(path)
        if module is None:
            name = f"seqcompile_generated.{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            _modules[path] = module
        return module
