"""User patterns, written as plain PyTorch functions. With a `replacement_fn`, every match of
`pattern_fn` is replaced by `replacement_fn`'s computation. Without one, `pattern_fn` must be
pointwise: its matches are fused by the pointwise region fuser, which generates the kernels and
their backward. Patterns are traced to pre-dispatch ATen and normalized like the model graph (so
`x / 2` in a pattern still matches `x * 0.5`); they run before the built-in families, and their
sites count under the name given."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from seqcompile.capture import trace_function
from seqcompile.normalize import normalize_graph
from seqcompile.patterns.pointwise import USER_PATTERN, unsupported_ops
from seqcompile.report import CompileReport


@dataclasses.dataclass(frozen=True)
class UserPattern:
    name: str
    pattern: GraphModule
    replacement: GraphModule | None
    """None: the matches become pointwise regions with generated kernels."""


_registry: dict[str, UserPattern] = {}


def register_pattern(
    name: str,
    pattern_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    replacement_fn: Callable[..., Any] | None = None,
) -> UserPattern:
    """Fuse every occurrence of `pattern_fn`'s computation in every graph compiled from now on.

    `example_inputs` (tensors of representative dtype and rank) are used to trace the functions.
    With `replacement_fn`, matches are rewritten into its computation; without, `pattern_fn` must be
    made of element-wise ops and each match gets a generated forward and backward kernel.
    Registering a name again replaces the earlier pattern."""
    from seqcompile.patterns import FAMILIES

    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"pattern name must be an identifier string; got {name!r}")
    if name in FAMILIES:
        raise ValueError(f"pattern name {name!r} is a built-in family ({', '.join(FAMILIES)})")
    if callable(example_inputs):
        raise TypeError(
            "register_pattern(name, pattern_fn, example_inputs, replacement_fn=None): the third "
            "argument is the example inputs; pass the replacement as replacement_fn="
        )
    pattern = trace_function(pattern_fn, example_inputs, f"pattern_fn of {name!r}")
    replacement = None
    if replacement_fn is not None:
        replacement = trace_function(replacement_fn, example_inputs, f"replacement_fn of {name!r}")
    fake_mode = next(
        n.meta["val"].fake_mode
        for n in pattern.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    )
    normalize_graph(pattern, fake_mode)
    if replacement is None:
        unsupported = unsupported_ops(pattern)
        if unsupported:
            raise ValueError(
                f"pattern {name!r} has no replacement_fn, so it must be pointwise, but "
                f"{', '.join(unsupported)} cannot join a pointwise region; pass a replacement_fn"
            )
    registered = UserPattern(name, pattern, replacement)
    _registry[name] = registered
    return registered


def unregister_pattern(name: str) -> None:
    """Forget the pattern registered under `name` (no error if there is none)."""
    _registry.pop(name, None)


def registered_patterns() -> list[UserPattern]:
    return list(_registry.values())


def apply_user_patterns(
    gm: GraphModule, fake_mode: Any, fake_inputs: list[Any], report: CompileReport
) -> None:
    """Apply every registered pattern: rewrite the matches of patterns with a replacement (fake
    values re-derived after a change), and mark the matches of pointwise ones for the region
    fuser, which counts them."""
    replaced = 0
    for user in registered_patterns():
        if user.replacement is None:
            _mark_matches(gm, user)
            continue
        matches = replace_pattern_with_filters(gm, user.pattern, user.replacement)
        if matches:
            report.counts[user.name] += len(matches)
            replaced += len(matches)
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        with fake_mode:
            FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*fake_inputs)


def _mark_matches(gm: GraphModule, user: UserPattern) -> None:
    matcher = SubgraphMatcher(user.pattern.graph, ignore_literals=False)
    for match in matcher.match(gm.graph):
        for pattern_node, node in match.nodes_map.items():
            if pattern_node.op == "call_function" and USER_PATTERN not in node.meta:
                node.meta[USER_PATTERN] = user.name
