"""`seqcompile.explain`: compile a model with seqfast, run it once, and say what was fused."""

from __future__ import annotations

import functools
from typing import Any

import torch

from seqcompile.report import CompileReport, collecting


def explain(model: Any, *args: Any, **kwargs: Any) -> CompileReport:
    """Compile `model` with the seqfast backend, call it once with `args` and `kwargs`, and return
    the merged report of every graph that call compiled. Options come from `SEQFAST_*` variables.

    A fresh backend object is used, so Dynamo compiles anew even if `model` was compiled before.
    """
    from seqcompile.backend import seqfast

    backend = functools.partial(seqfast)
    with collecting() as report:
        torch.compile(model, backend=backend)(*args, **kwargs)
    return report
