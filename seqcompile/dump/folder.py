"""The dump folder of one run: the first compile of a process clears what an earlier run wrote there
(its `graph_N` folders and its index), so files of two runs never mix, and `README.txt` lists this
run's graphs, each with how its compile ended, and says what each file of a graph folder is."""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch

INDEX = "README.txt"
_GRAPH_FOLDER = re.compile(r"graph_\d+")
_started = time.strftime("%Y-%m-%d %H:%M:%S")
_runs: dict[Path, dict[str, str]] = {}
"""Per run folder this process writes into: each graph's one-line summary, in compile order."""

_FILES = """\
What each file of a graph folder is:
  00_dynamo.py                  the graph Dynamo handed over
  01_capture.py ... 03_fuse.py  after capture, normalize and fuse (fused calls print their
                                arguments by name)
  04_differentiate.py           the joint forward and backward graph from AOTAutograd (a graph
                                compiled with grad off has none, and goes on with lower_inference)
  NN_plan_memory_<pass>.py      stage 5, one file per pass in the order they ran, headed by the
                                pass's notes
  NN_lower_<kind>.py            what each executor received (forward, backward or inference;
                                with accumulate_grads, backward_returning is the backward that
                                hands the gradients to autograd);
                                with Inductor, also the code it generated (*_inductor_code.py)
  kernels/<kernel>_<hash>.py    each generated kernel the graph launches, headed by the fused-op
                                calls of this compile that launch it
  report.txt                    the compile report of this graph, or why its compile stopped
  rerun.py                      compiles the graph again and runs it on random inputs of the
                                traced shapes (python rerun.py)
  graph_N_verify_repro.py       with the verify option, when the graph differed from eager
"""


def run_folder(dump_dir: str | os.PathLike[str]) -> Path:
    """Where this process writes its graphs under `dump_dir` (a folder per rank under
    torch.distributed): the first time, cleared of an earlier run's graph folders and index.
    Other files there are left alone."""
    root = Path(dump_dir)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        root = root / f"rank_{torch.distributed.get_rank()}"
    root = root.resolve()
    if root not in _runs:
        root.mkdir(parents=True, exist_ok=True)
        for old in root.iterdir():
            if old.is_dir() and _GRAPH_FOLDER.fullmatch(old.name):
                shutil.rmtree(old)
        _runs[root] = {}
        _write_index(root)
    return root


def record(root: Path, graph: str, summary: str) -> None:
    """Note in the index how the compile of `graph` ended."""
    _runs[root][graph] = summary
    _write_index(root)


def _write_index(root: Path) -> None:
    graphs = _runs[root]
    lines = [
        "seqcompile dump: one folder per graph Dynamo handed to the seqfast backend in this run",
        f"(process {os.getpid()}, {' '.join(sys.argv) or 'python'}, started"
        f" {_started}). A run's first compile removes the graph folders of the run before.",
        "",
        *(f"{name}/  {summary}" for name, summary in graphs.items()),
        *([] if graphs else ["(no graph compiled yet)"]),
        "",
        _FILES,
    ]
    (root / INDEX).write_text("\n".join(lines))
