"""Sample inputs of the fused operators (PyTorch's OpInfo is the model): a `Sample` is one call of
an op by argument name with the eager composition that defines its right answer, and `in_layout`
turns a contiguous tensor into each memory layout a caller may pass, so one sample yields all.

The samples of each operator live in its folder's `samples.py`, which the entry's `samples()`
imports when a test or a sweep asks; `tests/ops/test_samples.py` runs every one on every path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

Tensor = torch.Tensor

LAYOUTS = ("contiguous", "transposed", "strided", "expanded", "offset", "window")
"""How a tensor argument may sit in memory: as allocated; its last two dimensions swapped in
memory; every other element of a larger buffer along the last dimension; a dimension of stride 0
(expanded); at a storage offset; and an interior window of a larger tensor (every dimension
padded). The memory a view does not cover holds `fill_value`, so a kernel that ignores a stride
reads it."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One call of a fused op: its arguments by schema name (tensors contiguous; the sweep puts
    them in each layout), which of them are differentiable, and the composition of plain torch ops
    that defines the right answer."""

    name: str
    args: Mapping[str, Any]
    """The op's arguments by the names of its schema; a list argument holds tensors in order."""
    eager: Callable[..., Sequence[Tensor]]
    """`eager(**args)`, the float tensors upcast to float64: the op's compared outputs, from plain
    torch ops written independently of the op's reference."""
    grads: tuple[str, ...] = ()
    """The tensor arguments (slot names, `inputs[1]` for a list's element) autograd differentiates
    the op by."""
    outputs: tuple[int, ...] = (0,)
    """Which of the op's outputs `eager` returns, in its order."""

    def is_empty(self) -> bool:
        """Whether some tensor argument has no elements."""
        return any(t.numel() == 0 for _, t in tensor_slots(self.args))


def tensor_slots(args: Mapping[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """The tensor arguments of `args` by slot name: `name`, or `name[i]` inside a list."""
    for name, value in args.items():
        if isinstance(value, Tensor):
            yield name, value
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, Tensor):
                    yield f"{name}[{i}]", item


def replace_slots(args: Mapping[str, Any], change: Callable[[str, Tensor], Tensor]) -> dict:
    """`args` with each tensor argument `t` at slot `s` replaced by `change(s, t)`."""

    def one(name: str, value: Any) -> Any:
        if isinstance(value, Tensor):
            return change(name, value)
        if isinstance(value, list | tuple):
            return [
                change(f"{name}[{i}]", v) if isinstance(v, Tensor) else v
                for i, v in enumerate(value)
            ]
        return value

    return {name: one(name, value) for name, value in args.items()}


def fill_value(dtype: torch.dtype) -> float | int | bool:
    """What the memory around a view holds: NaN for floats (read by mistake, it shows), 0 for
    integers (an index that stays in bounds, a wrong class or id) and False for masks."""
    if dtype.is_floating_point:
        return math.nan
    return False if dtype == torch.bool else 0


def applies(t: Tensor, layout: str) -> bool:
    """Whether a tensor of `t`'s shape can take `layout`: transposing needs two dimensions,
    striding and a window one, expanding one of size > 1."""
    if layout == "transposed":
        return t.dim() >= 2
    if layout in ("strided", "window"):
        return t.dim() >= 1
    if layout == "expanded":
        return _expanded_dim(t) is not None
    return True


def in_layout(t: Tensor, layout: str, *, requires_grad: bool = False) -> Tensor:
    """`t` (contiguous) as a tensor of the same shape and values in `layout` (`LAYOUTS`), a view of
    a buffer that is a leaf of autograd (requiring grad when asked), so gradients reach the view.
    `expanded` reads the first slice along one dimension of size > 1 with stride 0, so its values
    repeat that slice (the sample's oracle is given the same tensor)."""
    if not applies(t, layout):
        raise ValueError(f"layout {layout!r} does not apply to a tensor of shape {tuple(t.shape)}")
    t = t.detach()
    fill = fill_value(t.dtype)
    if layout == "contiguous":
        base = t.clone()
        return _leaf(base, requires_grad)
    if layout == "transposed":
        base = _leaf(t.transpose(-1, -2).contiguous(), requires_grad)
        return base.transpose(-1, -2)
    if layout == "expanded":  # the rest of a buffer of t's size holds the fill
        dim = _expanded_dim(t)
        base = t.new_full(t.shape, fill)
        base.narrow(dim, 0, 1).copy_(t.narrow(dim, 0, 1))
        return _leaf(base, requires_grad).narrow(dim, 0, 1).expand(t.shape)
    if layout == "strided":
        base = t.new_full((*t.shape[:-1], 2 * t.shape[-1]), fill)
        base[..., ::2] = t
        return _leaf(base, requires_grad)[..., ::2]
    if layout == "offset":
        base = t.new_full((t.numel() + 3,), fill)
        base[3:] = t.flatten()
        return _leaf(base, requires_grad)[3:].view(t.shape)
    if layout == "window":
        base = t.new_full(tuple(n + 3 for n in t.shape), fill)
        inside = tuple(slice(1, 1 + n) for n in t.shape)
        base[inside] = t
        return _leaf(base, requires_grad)[inside]
    raise ValueError(f"unknown layout {layout!r}; layouts are {', '.join(LAYOUTS)}")


def _leaf(t: Tensor, requires_grad: bool) -> Tensor:
    return t.requires_grad_(requires_grad and t.is_floating_point())


def _expanded_dim(t: Tensor) -> int | None:
    """The dimension an expanded layout reads with stride 0: the last of size > 1 before the
    innermost (the rows a kernel walks), else the innermost; None when no dimension has size > 1."""
    dims = [d for d in range(t.dim()) if t.shape[d] > 1]
    if not dims:
        return None
    return dims[-2] if len(dims) >= 2 else dims[-1]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    """Standard normal float32 values (times `scale`)."""
    return torch.randn(shape, generator=g) * scale
