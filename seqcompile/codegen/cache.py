"""Content-hashed kernel files: generated source is written under the cache folder, named by the
hash of its text, checked against that text before it is imported, and imported from that file so
tracebacks and `inspect` see it.

A file is used only when it holds exactly the text its name was computed from; anything else (an
edit, code appended, a truncated or empty file) is rebuilt with a warning. Writes go to a temporary
file in the same folder, then `os.replace`, so another process reading or writing the same kernel
at the same moment sees either no file or a whole one. The folder is looked up on every use, so a
change of `SEQFAST_CACHE_DIR` within a process is honoured. Results measured on a device (tuned
configurations, chosen implementations) are JSON files beside the kernels, written the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import linecache
import logging
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from seqcompile.run.settings import OptionError

_lock = threading.Lock()
_modules: dict[Path, tuple[str, ModuleType]] = {}
"""Imported generated modules by file, with the text each was executed from."""

CACHE_ENV = "SEQFAST_CACHE_DIR"
log = logging.getLogger("seqcompile")


class CacheFolderError(OptionError):
    """The kernel cache folder (`SEQFAST_CACHE_DIR`) cannot be created or written."""


def _folder_error(root: str, what: str, error: OSError) -> CacheFolderError:
    given = os.environ.get(CACHE_ENV, "").strip()
    origin = f"{CACHE_ENV}={given!r}" if given else f"the default kernel cache folder {root!r}"
    return CacheFolderError(
        f"{origin}: {what} ({error.strerror or error}); set {CACHE_ENV} to a folder this process"
        " can create and write"
    )


def cache_dir() -> Path:
    """`$SEQFAST_CACHE_DIR` (an empty value counts as unset), else `~/.cache/seqcompile/kernels`;
    created if missing. Raises `CacheFolderError`, naming the variable, where it cannot be."""
    root = os.environ.get(CACHE_ENV, "").strip() or os.path.join(
        os.path.expanduser("~"), ".cache", "seqcompile", "kernels"
    )
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file in the way, no permission, a read-only file system
        raise _folder_error(root, "the kernel cache folder cannot be created", error) from None
    return path


def check_cache_dir() -> Path:
    """`cache_dir()`, after proving a file can be written there (a folder that exists but is not
    writable fails here, with the variable named, rather than at the first kernel)."""
    path = cache_dir()
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-", suffix=".tmp")
    except OSError as error:
        raise _folder_error(str(path), "no file can be written there", error) from None
    os.close(fd)
    os.unlink(probe)
    return path


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """One generated kernel file, and the text it holds."""

    name: str
    """Name of the `@triton.jit` function in the file, also the file's stem."""
    template: str
    key: tuple[tuple[str, object], ...]
    path: Path
    source: str = dataclasses.field(default="", compare=False, repr=False)
    """The file's text as generated (what was checked and imported; never read back from disk,
    so a dump needs no cache file to exist)."""


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read(path: Path) -> bytes | None:
    """The file's bytes; None where there is no file."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def write_atomically(path: Path, text: str) -> None:
    """Atomically put `text` at `path`: a temporary file in the same folder, then a rename, so no
    reader ever sees a partial file and concurrent writers of the same text all succeed."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    except OSError as error:
        raise _folder_error(str(path.parent), "no file can be written there", error) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):  # the write or the rename failed
            os.unlink(tmp)


def read_entries(path: Path, what: str) -> dict[str, Any]:
    """The JSON object a results file (tuned configurations, chosen implementations) holds; empty
    where there is none, or where it cannot be read (with a warning naming the `what` file)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning(
            "seqfast: the %s file %s cannot be read (%s); measuring again", what, path, error
        )
        return {}
    return found if isinstance(found, dict) else {}


def add_entry(path: Path, key: str, value: Any) -> None:
    """Add `key` to the results file at `path`, keeping what other processes wrote since it was
    read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = {**read_entries(path, "results"), key: value}
    write_atomically(path, json.dumps(entries, indent=1, sort_keys=True))


def ensure_file(name: str, text: str) -> Path:
    """`<cache>/<name>.py` holding exactly `text` (`name` carries the hash of `text`): written if
    missing, rebuilt with a warning if it holds anything else."""
    path = cache_dir() / f"{name}.py"
    found = _read(path)
    if found == text.encode():
        return path
    if found is not None:
        problem = "is empty" if not found else "differs from what its name's hash says"
        warnings.warn(
            f"seqfast: the cached kernel {path} {problem} (edited, truncated or damaged);"
            " rebuilding it",
            stacklevel=2,
        )
    write_atomically(path, text)
    return path


def import_source(path: Path, text: str) -> ModuleType:
    """The module made by executing `text`, the checked contents of `path` (once per process and
    file). Its code and what `inspect` reads for it (Triton reads a kernel's source) both come
    from `text`, not from a second read of the file, which may have changed since."""
    with _lock:
        known = _modules.get(path)
        if known is not None and known[0] == text:
            return known[1]
        name = f"seqcompile_generated.{path.stem}"
        spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        module.__file__ = str(path)
        # mtime None: linecache.checkcache keeps the entry even if the file changes or goes
        linecache.cache[str(path)] = (len(text), None, text.splitlines(keepends=True), str(path))
        code = compile(text, str(path), "exec")
        sys.modules[name] = module
        exec(code, module.__dict__)
        _modules[path] = (text, module)
        return module
