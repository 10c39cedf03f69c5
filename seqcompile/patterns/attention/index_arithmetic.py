"""Index arithmetic read as positions, as Hugging Face writes it: the query and key positions are
`arange`s broadcast along the scores' last two dims (`q_idx = arange(Lq)[None, None, :, None]`,
`kv_idx = arange(Lk)[None, None, None, :]`), and constants, positions, and sums and differences of
them are read as linear forms of the two (`Linear`). Position ids gathered at the query or key
index (`pos[b, q_idx]`) read as that index where they run consecutively within each document of a
packed batch (`Runs`, which `index_masks.py` finds from the document mask).
"""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import arg, is_call, tensor_val, val
from seqcompile.patterns.attention.masks import constant
from seqcompile.patterns.attention.positions import Linear

aten = torch.ops.aten
_BROADCAST_VIEWS = (
    aten.unsqueeze.default,
    aten.view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.alias.default,
)
POSITION_DTYPES = (torch.int32, torch.int64)
"""Dtypes positions are read in: narrower integers wrap around, which the arithmetic here does
not model."""


Runs = dict[Node, Node]
"""Position ids (B, L) that run consecutively within each document of a mask's document factor,
with the batch index both are gathered at."""


def linear(node: object, lq: object, lk: object, runs: Runs | None = None) -> Linear | None:
    """`node` as a linear form of the query and key positions: a constant, positions, or sums
    and differences of them; None for anything else."""
    number = integer(node)
    if number is not None:
        return Linear(constant=number)
    at = position(node, lq, lk)
    if at is None and runs:
        at = _gathered_position(node, runs, lq, lk)
    if at is not None:
        return at
    if is_call(node, aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2 and not node.kwargs:
        a, b = (linear(x, lq, lk, runs) for x in node.args)
        if a is None or b is None:
            return None
        return a + b if node.target is aten.add.Tensor else a - b
    return None


def position(node: object, lq: object, lk: object) -> Linear | None:
    """Whether `node` holds query (or key) positions plus a constant, along the scores' last
    two dims: an `arange` with unit step, through integer offsets and views that only add or
    remove size-1 dims or broadcast."""
    value = tensor_val(node)
    if value is None or value.dtype not in POSITION_DTYPES:
        return None
    varying = [d for d in range(value.dim()) if not statically_known_true(value.shape[d] == 1)]
    if len(varying) != 1 or value.dim() - varying[0] > 2:
        return None
    on_keys = varying[0] == value.dim() - 1
    found = _offset_arange(node)
    if found is None:
        return None
    node, offset = found
    start = _unit_range_start(node, lk if on_keys else lq)
    if start is None:
        return None
    return Linear(q=int(not on_keys), kv=int(on_keys), constant=offset + start)


def _gathered_position(node: object, runs: Runs, lq: object, lk: object) -> Linear | None:
    """The query or key index where `node` gathers position ids that run within documents at
    that index (`pos[b, q_idx]`), at the batch index their documents are gathered at."""
    gathered = gather(node)
    if gathered is None:
        return None
    source, batch, at = gathered
    if runs.get(peeled(source)) is not batch:
        return None
    index = position(at, lq, lk)
    return index if index is not None and index.constant == 0 else None


def gather(node: object) -> tuple[Node, Node, Node] | None:
    """(source, batch index, position index) of `source[b, idx]` on a (B, L) source."""
    if not is_call(node, aten.index.Tensor):
        return None
    source, indices = node.args[:2]
    value = tensor_val(source)
    if value is None or value.dim() != 2 or len(indices) != 2 or None in indices:
        return None
    return source, indices[0], indices[1]


def peeled(node: object) -> object:
    """`node` through broadcasts, aliases and casts to a position dtype."""
    while is_call(node, aten.expand.default, aten.alias.default) or _int_cast(node):
        node = node.args[0]
    return node


def _offset_arange(node: Node) -> tuple[Node, int] | None:
    """(the `arange`, the offset added) where `node` is an `arange` plus integer offsets,
    through views that only add or remove size-1 dims or broadcast."""
    offset = 0
    while not is_call(node, aten.arange.default, aten.arange.start, aten.arange.start_step):
        if is_call(node, *_BROADCAST_VIEWS) or _int_cast(node) or whole_slice(node):
            node = node.args[0]
        elif is_call(node, aten.add.Tensor, aten.sub.Tensor) and len(node.args) == 2:
            step = integer(node.args[1])
            if step is None or not isinstance(node.args[0], Node) or node.kwargs:
                return None
            offset += step if node.target is aten.add.Tensor else -step
            node = node.args[0]
        else:
            return None
        source = tensor_val(node)
        if source is None or source.dtype not in POSITION_DTYPES:
            return None  # narrower integers wrap around
        if sum(not statically_known_true(s == 1) for s in source.shape) > 1:
            return None
    return node, offset


def _unit_range_start(node: Node, length: object) -> int | None:
    """The start of the `arange` `node` where it steps by 1 over `length` values."""
    if node.target is aten.arange.default:
        start, end, step = 0, node.args[0], 1
    else:
        start, end = node.args[:2]
        step = arg(node, 2, "step", 1) if node.target is aten.arange.start_step else 1
    start, end = integer(start), val(end) if isinstance(end, Node) else end  # a symbolic size
    if (
        start is None
        or step != 1
        or end is None
        or not statically_known_true(end - start == length)
    ):
        return None
    return start


def integer(value: object) -> int | None:
    """`value` as an int: a Python int, or a number or constant (`constant`) holding a whole one."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    number = constant(value)
    return int(number) if number is not None and number == int(number) else None


def whole_slice(node: object) -> bool:
    """A slice that keeps every element (`x[:, None]` at symbolic sizes slices the whole dim)."""
    if not is_call(node, aten.slice.Tensor):
        return False
    before, after = tensor_val(node.args[0]), tensor_val(node)
    return (
        before is not None
        and after is not None
        and before.dim() == after.dim()
        and all(
            statically_known_true(a == b) for a, b in zip(before.shape, after.shape, strict=True)
        )
    )


def _int_cast(node: object) -> bool:
    value = tensor_val(node)
    return (
        is_call(node, aten.to.dtype, aten._to_copy.default)
        and value is not None
        and value.dtype in POSITION_DTYPES
    )
