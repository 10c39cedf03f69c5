"""Evaluating a value of the captured graph on concrete tensors, to check what a pattern concluded
about it against the model's own code: the sub-graph that computes the value runs on the CPU at
the traced sizes (or at another assignment of the graph's size symbols), reading random tensors
for the inputs it depends on where asked to, and nothing where not."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import sympy
import torch
from torch.fx import Node
from torch.utils._pytree import tree_map

from seqcompile.fx.aliasing import writes_in_place
from seqcompile.fx.nodes import val

MAX_ELEMENTS = 1 << 24
"""The most elements one evaluated tensor may have (a 4096 x 4096 mask): a check must cost
milliseconds, not the time and memory of the step it checks."""
_EVALUATION_ERRORS = (
    RuntimeError,
    ValueError,
    IndexError,
    TypeError,
    NotImplementedError,
    AssertionError,
)


@dataclasses.dataclass(frozen=True)
class Unevaluated:
    """Why a value could not be evaluated (it reads an input, it is too large, ...)."""

    reason: str


Sizes = Mapping[sympy.Symbol, int]
"""A value for each size symbol of the graph."""


def traced_sizes(values: list[Any]) -> dict[sympy.Symbol, int]:
    """The sizes the graph of `values` (nodes, fake tensors, sizes) was traced at: each
    symbol's hint (empty for a static graph)."""
    for value in values:
        for symbolic in _symbolic_values(val(value) if isinstance(value, Node) else value):
            env = symbolic.node.shape_env
            hints = getattr(env, "backed_var_to_val", None)  # (torch 2.13; var_to_val before)
            return {s: int(v) for s, v in (env.var_to_val if hints is None else hints).items()}
    return {}


def other_sizes(sizes: Sizes) -> dict[sympy.Symbol, int]:
    """A second assignment of the same symbols, each one larger: a reading that holds at one
    size only (a literal that happens to equal the traced length) fails at it."""
    return {s: v + 1 for s, v in sizes.items()}


def size_at(size: Any, sizes: Sizes) -> int | float | bool:
    """A size (an int, or a symbolic int, float or bool) at the assignment `sizes`."""
    if isinstance(size, torch.SymInt | torch.SymFloat | torch.SymBool):  # (a bool is an int)
        value = size.node.expr.xreplace(dict(sizes))
        if isinstance(size, torch.SymBool):
            return bool(value)
        return float(value) if isinstance(size, torch.SymFloat) else int(value)
    return size


class Evaluator:
    """Evaluates nodes of one graph, remembering each value per assignment of sizes. With a
    `generator`, tensor inputs of the graph read random values drawn from it (the same values for
    an input every time it is read); without, a value computed from an input is `Unevaluated`.
    `given` values are read for their nodes instead of computing them, at any shape the ops take
    (a few rows of the traced ones): the size limit, which judges a value by its traced shape, is
    then the caller's to keep."""

    def __init__(
        self, generator: torch.Generator | None = None, given: Mapping[Node, Any] | None = None
    ) -> None:
        self.generator = generator
        self.given = dict(given or {})
        self._values: dict[tuple[Node, tuple], Any] = {}
        self._inputs: dict[tuple[Node, tuple], torch.Tensor] = {}

    def value(self, node: Node, sizes: Sizes) -> Any:
        """`node`'s value at `sizes` (a tensor on the CPU, a number), or `Unevaluated`."""
        key = tuple(sorted((str(s), v) for s, v in sizes.items()))
        stack = [node]
        while stack:
            current = stack[-1]
            if (current, key) in self._values:
                stack.pop()
                continue
            pending = [n for n in current.all_input_nodes if (n, key) not in self._values]
            computed = current.op == "call_function" and current not in self.given
            if pending and not _is_size(val(current)) and computed:
                stack.extend(pending)
                continue
            stack.pop()
            self._values[current, key] = self._compute(current, sizes, key)
        return self._values[node, key]

    def _compute(self, node: Node, sizes: Sizes, key: tuple) -> Any:
        if node in self.given:
            return self.given[node]
        fake = val(node)
        if _is_size(fake):
            try:
                return size_at(fake, sizes)
            except (TypeError, ValueError) as error:  # a symbol the assignment does not give
                return Unevaluated(f"the size {fake} cannot be evaluated: {error}")
        if node.op == "get_attr":
            value = getattr(node.graph.owning_module, node.target, None)
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                return Unevaluated(f"{node.name} holds no values (a meta tensor)")
            return _on_cpu(value)
        if node.op == "placeholder":
            return self._input(node, fake, sizes, key)
        if node.op != "call_function":
            return Unevaluated(f"{node.name} is a {node.op}")
        refused = _refusal(node, fake, sizes, bounded=not self.given)
        if refused is not None:
            return refused
        missing = [
            self._values[n, key]
            for n in node.all_input_nodes
            if isinstance(self._values[n, key], Unevaluated)
        ]
        if missing:
            return missing[0]
        args, kwargs = tree_map(
            lambda a: self._values[a, key] if isinstance(a, Node) else _on_cpu(a),
            (node.args, node.kwargs),
        )
        try:
            return node.target(*args, **kwargs)
        except _EVALUATION_ERRORS as error:
            return Unevaluated(f"{node.name} ({node.target}) failed on concrete values: {error}")

    def _input(self, node: Node, fake: Any, sizes: Sizes, key: tuple) -> Any:
        if not isinstance(fake, torch.Tensor):
            return Unevaluated(f"the graph input {node.name} is not a tensor")
        if self.generator is None:
            return Unevaluated(f"computed from the graph input {node.name}")
        if (node, key) not in self._inputs:
            shape = [size_at(s, sizes) for s in fake.shape]
            self._inputs[node, key] = random_tensor(shape, fake.dtype, self.generator)
        return self._inputs[node, key]


def random_tensor(shape: list[int], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Values that exercise a reading: normal floats, booleans of both kinds, small integers
    (positions and ids with repeats and restarts)."""
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return torch.randint(0, 4, shape, generator=generator).to(dtype)


def _refusal(node: Node, fake: Any, sizes: Sizes, bounded: bool) -> Unevaluated | None:
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return Unevaluated(f"{node.name} is random")
    if writes_in_place(node):
        return Unevaluated(f"{node.name} writes in place")
    for value in _tensors(fake) if bounded else ():
        try:
            elements = math.prod(size_at(s, sizes) for s in value.shape)
        except (TypeError, ValueError):
            return Unevaluated(f"the shape of {node.name} cannot be evaluated")
        if elements > MAX_ELEMENTS:
            return Unevaluated(
                f"{node.name} has {elements} elements, more than a check evaluates ({MAX_ELEMENTS})"
            )
    return None


def _is_size(value: Any) -> bool:
    """A number the graph computes from sizes (symbolic, or a Python number where static)."""
    return isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool | int | float)


def _symbolic_values(value: Any) -> list[Any]:
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return [value]
    if isinstance(value, torch.Tensor):
        return [s for s in value.shape if isinstance(s, torch.SymInt)]
    if isinstance(value, list | tuple | torch.Size):
        return [s for v in value for s in _symbolic_values(v)]
    return []


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _on_cpu(value: Any) -> Any:
    """Devices named in arguments (`arange(..., device="cuda")`) become the CPU, where the check
    runs."""
    if isinstance(value, torch.device) or (isinstance(value, str) and value.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.cpu()
    return value
