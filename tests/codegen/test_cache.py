"""The kernel cache runs only what it made: a cached file is checked whole against the text its
name's hash was computed from before it is imported, and rebuilt with a warning when it differs
(edited, appended to, truncated, empty, not text); writes are atomic, so processes writing the same
kernel at once all import a whole file; a change of `SEQFAST_CACHE_DIR` within a process is
honoured, and nothing keeps pointing at a folder that was deleted; a folder that cannot be used is
refused with the variable named."""

import inspect
import multiprocessing
import os
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

from seqcompile.codegen import KernelSpec, cache, kernel_function, prepare_kernel, render
from seqcompile.codegen.cache import CacheFolderError, cache_dir, ensure_file, import_source
from seqcompile.report import collecting


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """A private cache folder, and none of the kernels this process already rendered or imported:
    what a new process finds. Returns the folder."""
    folder = tmp_path / "kernels"
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(folder))
    forget_kernels(monkeypatch)
    return folder


def forget_kernels(monkeypatch):
    """Start over as a new process would (put back after the test)."""
    monkeypatch.setattr(render, "_rendered", {})
    monkeypatch.setattr(render, "_functions", {})
    monkeypatch.setattr(cache, "_modules", {})


def layer_norm(x, w, b):
    return F.layer_norm(x, (8,), w, b)


def norm_inputs():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 8, generator=g),
        torch.randn(8, generator=g),
        torch.randn(8, generator=g),
    ]


def run_compiled(**options):
    torch._dynamo.reset()
    inputs = norm_inputs()
    with torch.no_grad():
        out = torch.compile(layer_norm, backend="seqfast", options=options)(*inputs)
    assert_close(out, layer_norm(*inputs))
    return out


def edit(text):
    return text.replace("tl.store(OUT + offsets, y,", "tl.store(OUT + offsets, y * 2,")


def append(text):
    return text + '\nraise RuntimeError("code appended to a cached kernel ran")\n'


def truncate(text):
    return text[: len(text) // 2]


def empty(text):
    return ""


@pytest.mark.kernels("add_norm_fwd")
@pytest.mark.parametrize("damage", [edit, append, truncate, empty], ids=lambda f: f.__name__)
def test_a_damaged_cached_kernel_is_rebuilt_with_a_warning(
    interpret, fresh_process, damage, monkeypatch
):
    run_compiled()
    (path,) = fresh_process.glob("add_norm_fwd_*.py")
    made = path.read_text()
    assert damage(made) != made
    path.write_text(damage(made))

    forget_kernels(monkeypatch)  # the next process finds the damaged file
    with pytest.warns(UserWarning, match=rf"cached kernel {path} .* rebuilding it"):
        run_compiled()  # and computes what eager computes
    assert path.read_text() == made


def test_a_file_that_is_not_text_is_rebuilt(fresh_process):
    source = prepare_kernel(KernelSpec.of("column_sum", marker="not_text"))
    source.path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.warns(UserWarning, match="differs from what its name's hash says"):
        again = prepare_kernel(KernelSpec.of("column_sum", marker="not_text"))
    assert again.path.read_text() == source.source


def test_the_hash_in_the_name_covers_the_whole_file(fresh_process):
    """The header is part of what is hashed, so two keys that render the same body with other
    headers get files of their own rather than rebuilding each other's."""
    source = prepare_kernel(KernelSpec.of("column_sum", marker="a"))
    other = prepare_kernel(KernelSpec.of("column_sum", marker="b"))
    assert source.path != other.path
    assert source.path.read_text() == source.source
    digest = source.name.rsplit("_", 1)[1]
    assert cache.text_digest(source.source.replace(source.name, "KERNEL_NAME")) == digest


def test_what_is_imported_is_the_checked_text_even_if_the_file_changes_after(fresh_process):
    source = prepare_kernel(KernelSpec.of("column_sum", marker="late_edit"))
    # after the check, before the import: Triton reads the kernel's source with `inspect`
    source.path.write_text(source.source.replace("tl.", "tl ."))
    module = import_source(source.path, source.source)
    lines, _ = inspect.getsourcelines(getattr(module, source.name).fn)
    assert "tl." in "".join(lines) and "tl ." not in "".join(lines)


def test_a_change_of_cache_folder_is_honoured_after_the_old_one_is_deleted(
    fresh_process, monkeypatch, tmp_path
):
    spec = KernelSpec.of("column_sum", marker="moved")
    first = prepare_kernel(spec)
    kernel_function(spec)
    assert first.path.parent == fresh_process
    moved = tmp_path / "moved"
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(moved))
    shutil.rmtree(fresh_process)
    again = prepare_kernel(spec)
    assert again.path == moved / first.path.name and again.path.read_text() == first.source
    kernel_function(spec)
    assert render._functions[spec][0] == again.path  # imported again, from the new folder
    # and a deleted folder (the same variable) is made again with the file in it
    shutil.rmtree(moved)
    assert prepare_kernel(spec).path.read_text() == first.source


@pytest.mark.kernels("add_norm_fwd")
def test_a_compile_after_the_cache_folder_moved_and_the_old_was_deleted(
    interpret, fresh_process, monkeypatch, tmp_path
):
    run_compiled()
    moved = tmp_path / "moved"
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(moved))
    shutil.rmtree(fresh_process)
    with collecting() as report:
        run_compiled(dump_dir=str(tmp_path / "dump"))
    assert report.kernels and all(use.path.parent == moved for use in report.kernels)
    assert all(use.path.exists() for use in report.kernels)
    (dumped,) = (tmp_path / "dump").glob("graph_*/kernels/add_norm_fwd_*.py")
    assert "@triton.jit" in dumped.read_text()


def _write_and_import(args):
    """One process's share of the race: make and import each kernel, reporting any warning (a
    reader that saw a partial file would warn and rebuild it)."""
    folder, texts = args
    os.environ["SEQFAST_CACHE_DIR"] = folder
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for name, text in texts:
            path = ensure_file(name, text)
            module = import_source(path, text)
            assert module.VALUE == name, (module.VALUE, name)
            assert path.read_text() == text
    return [str(w.message) for w in seen]


def test_processes_writing_the_same_kernels_at_once_all_import_whole_files(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir()
    # big enough that a write takes a while; each kernel's name carries the hash of its text
    texts = []
    for i in range(40):
        body = f"VALUE = NAME\n# {i}\n" + "# padding\n" * 20000
        name = f"race_{cache.text_digest(body)}"
        texts.append((name, body.replace("NAME", repr(name), 1)))
    # a damaged file is there from the start: the first process to find it rebuilds it
    folder.joinpath(f"{texts[0][0]}.py").write_text("VALUE = 'damaged'\n")
    context = multiprocessing.get_context("fork")  # a copy of this process: no second import
    with context.Pool(4) as pool:
        results = pool.map(_write_and_import, [(str(folder), texts)] * 4)
    damaged = f"{texts[0][0]}.py"
    warned = [message for seen in results for message in seen]
    assert warned and all(damaged in message for message in warned), warned
    assert not list(folder.glob("*.tmp")), "a temporary file was left behind"
    for name, text in texts:
        assert (folder / f"{name}.py").read_text() == text


def test_a_cache_folder_that_cannot_be_made_names_the_variable(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(blocker / "kernels"))
    with pytest.raises(CacheFolderError, match=r"^SEQFAST_CACHE_DIR=.*cannot be created"):
        cache_dir()
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"^SEQFAST_CACHE_DIR=.*set SEQFAST_CACHE_DIR to a folder"):
        torch.compile(lambda x: x + 1, backend="seqfast")(torch.randn(2))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any folder")
def test_a_cache_folder_that_cannot_be_written_names_the_variable(monkeypatch, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(locked))
    with pytest.raises(CacheFolderError, match=r"^SEQFAST_CACHE_DIR=.*no file can be written"):
        cache.check_cache_dir()


def test_an_empty_cache_variable_is_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("SEQFAST_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "seqcompile" / "kernels"
