"""User patterns, written as plain PyTorch functions and run by the fuse stage's engine like the
built-in families (before them), each match counted under the pattern's name. With a
`replacement_fn`, a match is replaced by `replacement_fn`'s computation; without one, `pattern_fn`
must be pointwise and each match becomes a pointwise region of its own, its generated kernels named
after the pattern. Patterns are traced to pre-dispatch ATen and normalized like the model graph (so
`x / 2` in a pattern still matches `x * 0.5`); a scalar example input is a literal wildcard. A
trace holds the sizes it was made at, so candidates are found with any number where it holds one
(and by a second trace at symbolic sizes where the pattern reads a size), then checked again, and
the replacement traced, at the match's own inputs (both in `user_matcher.py`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.utils.matcher_utils import InternalMatch

from seqcompile.capture import trace_function
from seqcompile.fx.nodes import (
    describe,
    fake_values,
    node_order,
    same_shape,
    source_meta,
    tensor_val,
)
from seqcompile.normalize import normalize_graph
from seqcompile.patterns.engine import FuseContext, Reject, Rewrite, run_patterns
from seqcompile.patterns.pointwise import USED_EARLY, match_region
from seqcompile.patterns.pointwise_ops import unsupported_ops
from seqcompile.patterns.user_literals import (
    LITERAL,
    calls,
    make_wildcards,
    placeholders,
    traced_pattern,
)
from seqcompile.patterns.user_matcher import Matcher, number, same_match, tensor_inputs

log = logging.getLogger("seqcompile")


@dataclasses.dataclass(frozen=True)
class UserPattern:
    """A registered pattern, one `Pattern` of the fuse stage's engine: asked about a node, it
    answers for the match whose last node that is."""

    name: str
    pattern_fn: Callable[..., Any]
    replacement_fn: Callable[..., Any] | None
    """Traced again for every match, at its inputs; None: each match becomes a pointwise region
    of its own, with generated kernels."""
    matchers: tuple[Matcher, ...]
    """Find the candidates: `pattern_fn` traced at the example inputs and normalized, with each
    literal parameter's placeholder where its value was, and again at symbolic sizes where that
    trace reads a size (a dynamic graph divides by a size where a static one multiplies by a
    literal). A literal of the trace matches any literal of its type, and a size any size. A
    candidate is checked again, literals and sizes included, with the pattern traced at its own
    inputs."""
    literals: tuple[bool, ...]
    """Which parameters are literal wildcards (the scalar example inputs)."""
    examples: str
    """The example inputs as a refusal describes them."""

    @property
    def family(self) -> str:
        return self.name

    def find(self, node: Node, ctx: FuseContext) -> Rewrite | Reject | None:
        """The match whose last node is `node`, checked at its own inputs: the rewrite that fuses
        it, or why it cannot be fused; None where no match ends at `node`."""
        found = self._candidate(node)
        if found is None:
            return None
        matcher, match = found
        inputs = fake_values(match.placeholder_nodes)
        traced = _trace_at(self.pattern_fn, inputs, ctx.fake_mode)
        if isinstance(traced, str):
            return Reject("pattern_fn of {!r} {}", self.name, traced)
        normalize_graph(traced, ctx.fake_mode)
        if not same_match(Matcher(traced.graph, exact=True).match_at(node), match):
            if not same_match(self.matchers[0].exactly().match_at(node), match):
                return None  # other literals than the pattern's: another computation
            return Reject(
                "matches {!r} as traced at the example inputs ({}) but not as traced at this"
                " site's ({}): the pattern's trace depends on its inputs' sizes or dtypes, and"
                " this site computes something else",
                self.name,
                self.examples,
                _describe(inputs),
            )
        nodes = matcher.computing(match)
        if self.replacement_fn is None:
            return match_region(ctx, nodes, self.name)
        replacement = _trace_at(self.replacement_fn, inputs, ctx.fake_mode)
        if isinstance(replacement, str):
            return Reject("replacement_fn of {!r} {}", self.name, replacement)
        if replacement.graph.find_nodes(op="get_attr"):
            return Reject(
                "replacement_fn of {!r} makes a tensor constant (`torch.tensor(...)`), which is"
                " not copied into the graph; write it as a Python number",
                self.name,
            )
        produced = [_output_value(n) for n in _outputs(replacement.graph)]
        replaced = fake_values(match.returning_nodes)
        if len(produced) != len(replaced) or not all(map(_same_kind, produced, replaced)):
            return Reject(
                "replacement_fn of {!r} at this site's inputs ({}) returns {}, but the site"
                " computes {}",
                self.name,
                _describe(inputs),
                _describe(produced),
                _describe(replaced),
            )
        where = _insertion_point(match, nodes, node)
        if where is None:
            return Reject(USED_EARLY)
        return functools.partial(_inline, replacement.graph, match, nodes, where)

    def _candidate(self, node: Node) -> tuple[Matcher, InternalMatch] | None:
        """The first matcher's match whose last node is `node`, with a literal for each literal
        parameter and a tensor for each tensor one."""
        for matcher in self.matchers:
            match = matcher.match_at(node)
            if match is not None and self._takes(match.placeholder_nodes):
                return matcher, match
        return None

    def _takes(self, inputs: list[Any]) -> bool:
        """Each literal parameter met a literal (not a value the graph computes), and each tensor
        parameter a tensor."""
        return all(
            isinstance(v, LITERAL) if literal else tensor_val(v) is not None
            for v, literal in zip(inputs, self.literals, strict=True)
        )


_registry: dict[str, UserPattern] = {}


def register_pattern(
    name: str,
    pattern_fn: Callable[..., Any],
    example_inputs: Sequence[Any],
    replacement_fn: Callable[..., Any] | None = None,
) -> UserPattern:
    """Fuse every occurrence of `pattern_fn`'s computation in every graph compiled from now on;
    each match counts under `name` in the report.

    `example_inputs` are used to trace the functions: tensors of representative dtype and rank,
    and int, float or bool literals. Each match found is checked again, and the replacement
    traced, at the match's own inputs, so a size the functions read is right at every size.

    A literal (scalar) example input is a wildcard named by its parameter: where its value lands
    in the traced pattern, a match may hold any literal, and `pattern_fn` (for the check) and
    `replacement_fn` get the matched value as that parameter. `lambda x, alpha: x *
    torch.sigmoid(alpha * x)` with example alpha 1.702 matches `x * torch.sigmoid(1.5 * x)` too.
    Literals written in `pattern_fn`'s body must match exactly. The parameter must land in the
    trace as itself: where normalization or arithmetic changes it (`x / a` is traced as `x * 0.5`
    for a = 2; `x * (a * 2)` folds it), this raises a ValueError; write the literal the trace
    holds as the parameter instead (`x * inv_a`, passing 1 / a).

    With `replacement_fn`, matches are rewritten into its computation; without, `pattern_fn` must
    be made of element-wise ops and each match becomes a pointwise region of its own, with a
    generated forward and backward kernel whose region key starts with `name`.
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
    for k, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor | LITERAL):
            raise TypeError(
                f"example_inputs of {name!r} must be tensors or int, float or bool literals;"
                f" input {k} is a {type(value).__name__}"
            )
    pattern = traced_pattern(pattern_fn, example_inputs, f"pattern_fn of {name!r}")
    if replacement_fn is not None:  # fails early on a function that cannot be traced at all
        trace_function(replacement_fn, example_inputs, f"replacement_fn of {name!r}")
    else:
        unsupported = unsupported_ops(pattern)
        if unsupported:
            raise ValueError(
                f"pattern {name!r} has no replacement_fn, so it must be pointwise, but "
                f"{', '.join(unsupported)} cannot join a pointwise region; pass a replacement_fn"
            )
    make_wildcards(name, pattern_fn, example_inputs, pattern)
    registered = UserPattern(
        name,
        pattern_fn,
        replacement_fn,
        tuple(
            Matcher(trace.graph)
            for trace in (pattern, *_read_sizes(name, pattern_fn, example_inputs))
        ),
        tuple(isinstance(v, LITERAL) for v in example_inputs),
        _describe(example_inputs),
    )
    _registry[name] = registered
    return registered


def _read_sizes(
    name: str, pattern_fn: Callable[..., Any], example_inputs: Sequence[Any]
) -> list[GraphModule]:
    """`pattern_fn` traced at symbolic sizes, where the trace reads a size (its own shapes,
    computed where a static trace holds literals); nothing where it reads none, or cannot be
    traced so (then only graphs holding the sizes as literals match)."""
    try:
        traced = traced_pattern(pattern_fn, example_inputs, f"pattern_fn of {name!r}", True)
        if all(number(n) is None for n in calls(traced.graph)):
            return []
        make_wildcards(name, pattern_fn, example_inputs, traced, symbolic=True)
    except ValueError as error:
        log.debug("pattern %r matches no size a dynamic graph computes: %s", name, error)
        return []
    return [traced]


def unregister_pattern(name: str) -> None:
    """Forget the pattern registered under `name` (no error if there is none)."""
    _registry.pop(name, None)


def registered_patterns() -> list[UserPattern]:
    return list(_registry.values())


def apply_user_patterns(ctx: FuseContext) -> None:
    """The fuse stage's first pass: the registered patterns, run by the engine."""
    run_patterns(registered_patterns(), ctx)


def _insertion_point(match: InternalMatch, nodes: list[Node], last: Node) -> Node | None:
    """What a replacement of `match` (its computing `nodes`, `last` the last) goes in before:
    `last`, or the first node outside the match that reads an output of it where that comes
    earlier (several outputs); None where an input of the match comes after that read."""
    if len(match.returning_nodes) == 1:
        return last
    order = node_order(last.graph)
    members = set(nodes)
    readers = [u for o in match.returning_nodes for u in o.users if u not in members]
    first = min([*readers, last], key=order.__getitem__)
    return first if all(order[i] < order[first] for i in tensor_inputs(match)) else None


def _inline(
    replacement: Graph, match: InternalMatch, nodes: list[Node], where: Node, ctx: FuseContext
) -> Node:
    """Copy `replacement` (traced at `match`'s inputs) into the graph before `where`, in place of
    the match's `nodes` (producers first): the copies keep their fake values and take the
    anchor's source location."""
    graph = ctx.gm.graph
    copies = dict(zip(placeholders(replacement), match.placeholder_nodes, strict=True))
    with graph.inserting_before(where):
        result = graph.graph_copy(replacement, copies)
    for n in calls(replacement):
        copies[n].meta.update(source_meta(ctx.site))
    results = list(result) if isinstance(result, tuple | list) else [result]
    for old, new in zip(match.returning_nodes, results, strict=True):
        old.replace_all_uses_with(new)
    for n in reversed(nodes):
        graph.erase_node(n)
    return results[-1]


def _trace_at(fn: Callable[..., Any], inputs: list[Any], fake_mode: Any) -> GraphModule | str:
    """`fn` traced to pre-dispatch ATen at the fake values `inputs`, or why it cannot be."""
    try:
        with fake_mode:
            return make_fx(lambda *args: fn(*args), pre_dispatch=True)(*inputs)
    except Exception as error:
        return f"could not be traced at this site's inputs ({_describe(inputs)}): {error}"


def _outputs(graph: Graph) -> list[Any]:
    (output,) = graph.find_nodes(op="output")
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


def _describe(values: Sequence[Any]) -> str:
    return ", ".join(describe(v) for v in values)
