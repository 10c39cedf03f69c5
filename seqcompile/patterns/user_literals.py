"""Literal wildcards of user patterns: a scalar example input of `register_pattern` is a named
parameter that matches any literal where its value lands in the traced pattern. Where it lands is
found by tracing the pattern again with another value for it."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils._pytree import tree_flatten, tree_unflatten

from seqcompile.capture import trace_function
from seqcompile.normalize import normalize_graph

LITERAL = bool | int | float
"""Types of the example inputs that are literal wildcards."""


def traced_pattern(
    fn: Callable[..., Any], inputs: Sequence[Any], what: str, symbolic: bool = False
) -> GraphModule:
    """`fn` traced at `inputs` (at symbolic sizes where `symbolic`) and normalized like the model
    graph."""
    pattern = trace_function(fn, inputs, what, symbolic)
    fake_mode = next(
        n.meta["val"].fake_mode
        for n in pattern.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    )
    normalize_graph(pattern, fake_mode)
    return pattern


def make_wildcards(
    name: str,
    pattern_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    pattern: GraphModule,
    symbolic: bool = False,
) -> None:
    """Put each literal parameter's placeholder into `pattern` (`pattern_fn` traced at
    `example_inputs`, at symbolic sizes where `symbolic`) where its value lands: where the literal
    changes when the pattern is traced again with another value for it. A ValueError where the
    value does not land as itself, or a parameter is not used."""
    inputs_of = placeholders(pattern.graph)
    nodes = calls(pattern.graph)
    for k, value in enumerate(example_inputs):
        if not isinstance(value, LITERAL):
            continue
        parameter, other = parameter_name(pattern_fn, k), _another(value)
        inputs = [*example_inputs[:k], other, *example_inputs[k + 1 :]]
        what = f"pattern_fn of {name!r} with {parameter}={other!r}"
        again = calls(traced_pattern(pattern_fn, inputs, what, symbolic).graph)
        found = _where_literal(nodes, again, value, other)
        if isinstance(found, str):
            raise ValueError(
                f"pattern_fn of {name!r}: the literal parameter {parameter} (example {value!r})"
                " matches any literal where its value lands in the traced pattern, but with"
                f" {parameter}={other!r} instead {found}: it does not land as itself."
                " Normalization or arithmetic may change it (`x / a` is traced as `x * 0.5` for"
                " a = 2; `x * (a * 2)` folds it). Write the literal the trace holds as the"
                " parameter (`x * inv_a`, passing 1 / a), pick an example value normalization"
                " leaves alone (not 0, 1 or a power of two), or write the literal in pattern_fn's"
                " body to match only that value"
            )
        for node, index in found:
            leaves, spec = tree_flatten((node.args, node.kwargs))
            leaves[index] = inputs_of[k]
            node.args, node.kwargs = tree_unflatten(leaves, spec)
    unused = [parameter_name(pattern_fn, k) for k, p in enumerate(inputs_of) if not p.users]
    if unused:
        raise ValueError(
            f"pattern_fn of {name!r} does not use {', '.join(unused)}: every input of a pattern"
            " must be used, so that each match gives it a value"
        )


def _where_literal(
    nodes: list[Node], again: list[Node], value: Any, other: Any
) -> list[tuple[Node, int]] | str:
    """Where `value` lands among the literal arguments of `nodes` (node, index among its flattened
    arguments), found against `again`, the same pattern traced with `other` in its place; or how
    `again` differs otherwise."""
    if [n.target for n in nodes] != [n.target for n in again]:
        return "the trace has other ops"
    found = []
    for node, twin in zip(nodes, again, strict=True):
        leaves, spec = tree_flatten((node.args, node.kwargs))
        twins, twin_spec = tree_flatten((twin.args, twin.kwargs))
        if spec != twin_spec:
            return f"the trace has other arguments to {node.target}"
        for index, (a, b) in enumerate(zip(leaves, twins, strict=True)):
            if isinstance(a, Node) or isinstance(b, Node) or _same_literal(a, b):
                continue
            if not (_same_literal(a, value) and _same_literal(b, other)):
                return f"the literal {a!r} of {node.target} in the trace becomes {b!r}"
            found.append((node, index))
    return found or "nothing in the trace changes"


def _same_literal(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _another(value: bool | int | float) -> bool | int | float:
    """A second value for a literal parameter, to see where the first lands in the trace: one
    normalization treats like any other (not 0, 1 or a power of two)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return next(c for c in itertools.count(value + 1) if abs(c) > 1 and abs(c) & (abs(c) - 1))
    return value + 0.1234567


def parameter_name(fn: Callable[..., Any], k: int) -> str:
    """How a message names `fn`'s parameter number `k`."""
    try:
        names = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # a builtin without a signature
        names = []
    return names[k] if k < len(names) else f"input {k}"


def placeholders(graph: Graph) -> list[Node]:
    return list(graph.find_nodes(op="placeholder"))


def calls(graph: Graph) -> list[Node]:
    """The nodes that compute: neither inputs nor the output."""
    return [n for n in graph.nodes if n.op not in ("placeholder", "output")]
