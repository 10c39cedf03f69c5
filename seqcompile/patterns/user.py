"""User patterns, written as plain PyTorch functions. With a `replacement_fn`, every match of
`pattern_fn` is replaced by `replacement_fn`'s computation. Without one, `pattern_fn` must be
pointwise: its matches are fused by the pointwise region fuser, which generates the kernels and
their backward. Patterns are traced to pre-dispatch ATen and normalized like the model graph (so
`x / 2` in a pattern still matches `x * 0.5`); they run before the built-in families, and their
sites count under the name given. A trace holds the sizes it was made at, so each match is checked
again, and the replacement traced, at the match's own inputs; a match that fails is refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from seqcompile.capture import trace_function
from seqcompile.fx_utils import describe, fake_values, same_shape, site_name
from seqcompile.normalize import normalize_graph
from seqcompile.patterns.engine import FuseContext
from seqcompile.patterns.pointwise import USER_PATTERN, unsupported_ops
from seqcompile.report import CompileReport, Missed


@dataclasses.dataclass(frozen=True)
class UserPattern:
    name: str
    pattern_fn: Callable[..., Any]
    pattern: GraphModule
    """`pattern_fn` traced at the example inputs and normalized: it finds the candidate sites, and
    each candidate is checked again at its own inputs (a trace holds the sizes it was made at)."""
    replacement_fn: Callable[..., Any] | None
    """Traced again for every match, at its inputs; None: the matches become pointwise regions
    with generated kernels."""


_registry: dict[str, UserPattern] = {}


def register_pattern(
    name: str,
    pattern_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    replacement_fn: Callable[..., Any] | None = None,
) -> UserPattern:
    """Fuse every occurrence of `pattern_fn`'s computation in every graph compiled from now on.

    `example_inputs` (tensors of representative dtype and rank) are used to trace the functions;
    each site found is then checked, and the replacement traced, at the site's own inputs.
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
    if replacement_fn is not None:  # fails early on a function that cannot be traced at all
        trace_function(replacement_fn, example_inputs, f"replacement_fn of {name!r}")
    fake_mode = next(
        n.meta["val"].fake_mode
        for n in pattern.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    )
    normalize_graph(pattern, fake_mode)
    if replacement_fn is None:
        unsupported = unsupported_ops(pattern)
        if unsupported:
            raise ValueError(
                f"pattern {name!r} has no replacement_fn, so it must be pointwise, but "
                f"{', '.join(unsupported)} cannot join a pointwise region; pass a replacement_fn"
            )
    registered = UserPattern(name, pattern_fn, pattern, replacement_fn)
    _registry[name] = registered
    return registered


def unregister_pattern(name: str) -> None:
    """Forget the pattern registered under `name` (no error if there is none)."""
    _registry.pop(name, None)


def registered_patterns() -> list[UserPattern]:
    return list(_registry.values())


def apply_user_patterns(ctx: FuseContext, fake_inputs: list[Any]) -> None:
    """Apply every registered pattern: rewrite the matches of patterns with a replacement (fake
    values re-derived after a change), and mark the matches of pointwise ones for the region
    fuser, which counts them. Only matches that hold at their own inputs count (`_Sites`); the
    others are refused in the report. A match the context does not admit is left alone."""
    gm, fake_mode, report = ctx.gm, ctx.fake_mode, ctx.report
    replaced = 0
    for user in registered_patterns():
        sites = _Sites(user, gm, fake_mode, report)
        if user.replacement_fn is None:
            _mark_matches(gm, user, sites)
            continue

        def admitted(match: InternalMatch, *graphs: Graph, name: str = user.name) -> bool:
            return ctx.admits(name, _anchor(match))

        def accepted(match: InternalMatch, *graphs: Graph, sites: _Sites = sites) -> bool:
            if not sites.accepts(match):
                return False
            ctx.fused(sites.user.name, _anchor(match))
            return True

        matches = replace_pattern_with_filters(
            gm,
            user.pattern,
            match_filters=[admitted, accepted],
            replacement_callback=sites.replacement,
        )
        if matches:
            report.counts[user.name] += len(matches)
            replaced += len(matches)
    if replaced:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        with fake_mode:
            FakeTensorProp(gm, mode=fake_mode).propagate_dont_convert_inputs(*fake_inputs)


def _anchor(match: InternalMatch) -> Node:
    """The node that names a match as a site: its last output."""
    return match.returning_nodes[-1]


def _mark_matches(gm: GraphModule, user: UserPattern, sites: _Sites) -> None:
    matcher = SubgraphMatcher(user.pattern.graph, ignore_literals=False)
    for match in matcher.match(gm.graph):
        if not sites.accepts(match):
            continue
        for pattern_node, node in match.nodes_map.items():
            if pattern_node.op == "call_function" and USER_PATTERN not in node.meta:
                node.meta[USER_PATTERN] = user.name


@dataclasses.dataclass
class _Traced:
    """The pattern (and the replacement) traced at one signature of inputs."""

    refusal: str | None
    """Why no site with these inputs can be a match (the functions cannot be traced there)."""
    sites: dict[frozenset[Node], list[Any]]
    """The matched nodes of every match of the pattern traced here, with its inputs."""
    replacement: GraphModule | None


class _Sites:
    """Checks the candidate matches of one pattern in one graph at their own inputs. The pattern
    was traced at the example inputs, so sizes it read are literals in it: a candidate counts
    only if `pattern_fn` traced at the candidate's inputs (fake values of their shapes, dtypes
    and devices, symbolic sizes kept) matches the same nodes, and `replacement_fn` traced there
    returns values of the shapes, dtypes and devices it replaces. Candidates with the same input
    signature share the traces; refusals go to the report."""

    def __init__(
        self, user: UserPattern, gm: GraphModule, fake_mode: Any, report: CompileReport
    ) -> None:
        self.user, self.gm, self.fake_mode, self.report = user, gm, fake_mode, report
        self._traced: dict[tuple[str, ...], _Traced] = {}
        self._replacements: dict[tuple[Node, ...], Graph] = {}

    def accepts(self, match: InternalMatch, *graphs: Graph) -> bool:
        """`match` holds at its inputs (a match filter of `replace_pattern_with_filters`)."""
        reason = self._refusal(match)
        if reason is not None:
            site = site_name(match.returning_nodes[-1])
            self.report.missed.append(Missed(site, self.user.name, reason))
        return reason is None

    def replacement(self, match: InternalMatch, *graphs: Graph) -> Graph:
        """The replacement traced at an accepted match's inputs."""
        return self._replacements.pop(tuple(match.returning_nodes))

    def _refusal(self, match: InternalMatch) -> str | None:
        inputs = fake_values(match.placeholder_nodes)
        traced = self._traced_at(inputs)
        if traced.refusal is not None:
            return traced.refusal
        nodes = _matched_nodes(match)
        if traced.sites.get(nodes) != match.placeholder_nodes:
            example = _describe(fake_values(_placeholders(self.user.pattern)))
            return (
                f"matches {self.user.name!r} as traced at the example inputs ({example}) but not"
                f" as traced at this site's ({_describe(inputs)}): the pattern's trace depends on"
                " its inputs' sizes or dtypes, and this site computes something else"
            )
        if traced.replacement is None:
            return None
        produced = [_output_value(n) for n in _outputs(traced.replacement)]
        replaced = fake_values(match.returning_nodes)
        if len(produced) != len(replaced) or not all(
            _same_kind(p, r) for p, r in zip(produced, replaced, strict=False)
        ):
            return (
                f"replacement_fn of {self.user.name!r} at this site's inputs"
                f" ({_describe(inputs)}) returns {_describe(produced)}, but the site computes"
                f" {_describe(replaced)}"
            )
        self._replacements[tuple(match.returning_nodes)] = traced.replacement.graph
        return None

    def _traced_at(self, inputs: list[Any]) -> _Traced:
        key = tuple(_signature(v) for v in inputs)
        if key not in self._traced:
            self._traced[key] = self._trace(inputs)
        return self._traced[key]

    def _trace(self, inputs: list[Any]) -> _Traced:
        pattern = _trace_at(self.user.pattern_fn, inputs, self.fake_mode)
        if isinstance(pattern, str):
            return _Traced(f"pattern_fn of {self.user.name!r} {pattern}", {}, None)
        normalize_graph(pattern, self.fake_mode)
        matcher = SubgraphMatcher(pattern.graph, remove_overlapping_matches=False)
        sites = {_matched_nodes(m): m.placeholder_nodes for m in matcher.match(self.gm.graph)}
        if self.user.replacement_fn is None:
            return _Traced(None, sites, None)
        replacement = _trace_at(self.user.replacement_fn, inputs, self.fake_mode)
        if isinstance(replacement, str):
            return _Traced(f"replacement_fn of {self.user.name!r} {replacement}", {}, None)
        return _Traced(None, sites, replacement)


def _trace_at(fn: Callable[..., Any], inputs: list[Any], fake_mode: Any) -> GraphModule | str:
    """`fn` traced to pre-dispatch ATen at the fake values `inputs`, or why it cannot be."""
    try:
        with fake_mode:
            return make_fx(lambda *args: fn(*args), pre_dispatch=True)(*inputs)
    except Exception as error:
        return f"could not be traced at this site's inputs ({_describe(inputs)}): {error}"


def _matched_nodes(match: InternalMatch) -> frozenset[Node]:
    return frozenset(
        node
        for pattern_node, node in match.nodes_map.items()
        if pattern_node.op not in ("placeholder", "output")
    )


def _placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm: GraphModule) -> list[Any]:
    (output,) = gm.graph.find_nodes(op="output")
    result = output.args[0]
    return list(result) if isinstance(result, tuple | list) else [result]


def _output_value(output: Any) -> Any:
    return output.meta.get("val") if isinstance(output, Node) else output


def _same_kind(a: Any, b: Any) -> bool:
    """Provably the same shape, dtype and device (tensors) or the same value (others)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.device == b.device and same_shape(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return statically_known_true(a == b)


def _describe(values: list[Any]) -> str:
    return ", ".join(describe(v) for v in values)


def _signature(value: Any) -> str:
    """What a trace at `value` depends on: a tensor's dtype, sizes, strides and device."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}{value.stride()}{value.device}"
    return f"{type(value).__name__} {value!r}"
