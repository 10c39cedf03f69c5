"""User patterns: a rewrite written as two plain PyTorch functions, `pattern_fn` and
`replacement_fn`. Both are traced to pre-dispatch ATen, the pattern is normalized like the model
graph (so `x / 2` in a pattern still matches `x * 0.5` in the graph), and every match is replaced.
They run before the built-in families; their sites count under the name given."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from seqcompile.normalize import normalize_graph
from seqcompile.report import CompileReport


@dataclasses.dataclass(frozen=True)
class UserPattern:
    name: str
    pattern: GraphModule
    replacement: GraphModule


_registry: dict[str, UserPattern] = {}


def _trace(fn: Callable[..., Any], example_inputs: Sequence[Any], what: str) -> GraphModule:
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [
        fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs
    ]
    try:
        with fake_mode:
            return make_fx(fn, pre_dispatch=True)(*inputs)
    except Exception as error:
        raise ValueError(f"{what} could not be traced with the example inputs: {error}") from error


def register_pattern(
    name: str,
    pattern_fn: Callable[..., Any],
    replacement_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
) -> UserPattern:
    """Fuse every occurrence of `pattern_fn`'s computation into `replacement_fn`'s, in every graph
    compiled from now on. `example_inputs` (tensors of representative dtype and rank) are used
    to trace both functions. Registering a name again replaces the earlier pattern."""
    from seqcompile.patterns import FAMILIES

    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"pattern name must be an identifier string; got {name!r}")
    if name in FAMILIES:
        raise ValueError(f"pattern name {name!r} is a built-in family ({', '.join(FAMILIES)})")
    pattern = _trace(pattern_fn, example_inputs, f"pattern_fn of {name!r}")
    replacement = _trace(replacement_fn, example_inputs, f"replacement_fn of {name!r}")
    fake_mode = next(
        n.meta["val"].fake_mode
        for n in pattern.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    )
    normalize_graph(pattern, fake_mode)
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
    """Replace every match of every registered pattern; re-derive fake values after a change."""
    replaced = 0
    for user in registered_patterns():
        matches = replace_pattern_with_filters(gm, user.pattern, user.replacement)
        if matches:
            report.counts[user.name] += len(matches)
            replaced += len(matches)
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        with fake_mode:
            FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*fake_inputs)
