"""Compile a model on the meta device to read its memory plan at any batch size: nothing runs on
real data and nothing the size of an activation is allocated. Fused ops run their reference on
shapes alone, so the plan is the one the model gets with the eager executor on a device with the
H100's roofline (the figures the budget planner weighs recompute by, used on meta).
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.convert_frame import input_codes
from torch.utils._pytree import tree_flatten, tree_map

from seqcompile.options import OptionError
from seqcompile.report import MemoryPlan, collecting


def meta_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """`model` with every parameter and buffer replaced by an empty meta tensor of its shape (and
    floating ones of `dtype`, when given); tied weights stay tied, and their data is never
    copied (tensors held as plain attributes, neither parameters nor buffers, are copied as
    they are)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        empty = torch.empty_like(tensor, device="meta", dtype=_cast(tensor, dtype))
        if isinstance(tensor, nn.Parameter):
            empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = empty
    return copy.deepcopy(model, memo)


def as_batch(example: Any) -> tuple[Any, ...] | dict[str, Any]:
    """A model's example inputs as a batch: a tuple of positional arguments or a dict of keyword
    arguments (a single tensor becomes a one-element tuple)."""
    return example if isinstance(example, tuple | dict) else (example,)


def call_arguments(batch: tuple[Any, ...] | dict[str, Any]) -> tuple[tuple[Any, ...], dict]:
    """The batch as `(args, kwargs)` for calling the model."""
    return (batch, {}) if isinstance(batch, tuple) else ((), batch)


def batch_size(batch: Any) -> int:
    """The leading size of the first tensor in `batch` (the batch dimension)."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise ValueError("the example batch holds no tensor with a batch dimension")


def at_batch_size(batch: Any, size: int, dtype: torch.dtype | None = None) -> Any:
    """`batch` on the meta device with every tensor whose leading size is the batch's set to
    `size` (and floating tensors of `dtype`, when given); other values are kept."""
    current = batch_size(batch)

    def resize(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        shape = list(value.shape)
        if shape and shape[0] == current:
            shape[0] = size
        return torch.empty(shape, dtype=_cast(value, dtype), device="meta").requires_grad_(
            value.requires_grad
        )

    return tree_map(resize, batch)


def memory_plans(model: nn.Module, batch: Any, options: dict[str, Any]) -> list[MemoryPlan]:
    """The memory plans of `model` (a meta copy) compiled with seqfast on `batch` (positional
    arguments as a tuple, or keyword arguments as a dict) and `options`, eager executor."""
    args, kwargs = call_arguments(batch)
    with collecting() as report, _scratch_compiles():
        compiled = torch.compile(
            _fresh_caller(model),
            backend="seqfast",
            options={**options, "rest": "eager"},
            dynamic=False,
        )
        try:
            compiled(*args, **kwargs)
        except OptionError:
            raise
        except Exception as error:
            raise RuntimeError(
                f"the model could not be compiled on the meta device to plan its memory: {error}"
            ) from error
    if not report.memory:
        raise ValueError(
            "the model made no training graph: it needs parameters that require grad, and grad"
            " mode on"
        )
    return report.memory


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


@contextlib.contextmanager
def _scratch_compiles() -> Iterator[None]:
    """Compile without Dynamo's recompile limits, then drop the cache entries made, so a dry run
    neither runs into the limit nor leaves entries that count against the user's compiles. A code
    object it compiled anew (a frame a graph break made Dynamo compile on its own) loses all its
    entries, the user's too: they are compiled again on their next call."""
    before = {code: _entries(code) for code in _compiled_codes()}
    with torch._dynamo.config.patch(recompile_limit=2**20, accumulated_recompile_limit=2**20):
        try:
            yield
        finally:
            for code in _compiled_codes():
                if _entries(code) != before.get(code, 0):
                    torch._dynamo.reset_code(code)


def _compiled_codes() -> list[types.CodeType]:
    """The code objects Dynamo has compiled frames of, still alive."""
    return [code for ref in input_codes.seen if (code := ref()) is not None]


def _entries(code: types.CodeType) -> int:
    return len(_debug_get_cache_entry_list(code))


def _fresh_caller(model: nn.Module) -> Any:
    """A function calling `model` with a code object of its own, so Dynamo's cache for it (and
    its recompile limit) starts empty on every call and goes away with it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    return types.FunctionType(call.__code__.replace(), call.__globals__, closure=call.__closure__)
