"""How a user pattern is found in a graph: a subgraph matcher anchored at one node, whose literals
and the sizes its trace computes match any number of their type (or, checking a candidate, only
equal ones), and the check that a candidate, the pattern traced again at its own inputs, matches
the same nodes."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.utils.fuser_utils import validate_partition
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher

from seqcompile.patterns.user_literals import calls


class Matcher(SubgraphMatcher):
    """Matches a pattern backwards from one node, as Inductor's patterns match from their anchor,
    rather than over a whole graph: the engine asks about every node in turn, in the graph as the
    rewrites before left it. A placeholder where a literal was in the example trace takes the
    literal it meets. The pattern's other literals, and the sizes its trace computes, match any
    number of their type that the graph holds or computes there, unless `exact`: then they must be
    equal (the check of a candidate, with the pattern traced at its inputs)."""

    def __init__(self, pattern: Graph, exact: bool = False) -> None:
        super().__init__(pattern, remove_overlapping_matches=False)
        self.exact = exact

    def exactly(self) -> Matcher:
        """This pattern's matcher whose literals must be equal."""
        return Matcher(self.pattern, exact=True)

    def _match_nodes(
        self, pn: Node, gn: Node, match: InternalMatch, node_name_match: str = ""
    ) -> bool:
        if pn.op == "placeholder" or number(pn) is None:
            return super()._match_nodes(pn, gn, match, node_name_match)
        return self._same_number(pn, gn)  # a size the pattern reads off its inputs

    def _match_literals(self, pn: Any, gn: Any, match: InternalMatch) -> bool:
        if super()._match_literals(pn, gn, match):
            return True
        placeholder = isinstance(pn, Node) and pn.op == "placeholder"
        return not placeholder and self._same_number(pn, gn)

    def _same_number(self, pn: Any, gn: Any) -> bool:
        """A literal of the pattern, or a size its trace computes, against the graph's: numbers of
        one type, equal where `exact`."""
        a, b = number(pn), number(gn)
        if a is None or b is None or _kind(a) is not _kind(b):
            return False
        return not self.exact or statically_known_true(a == b)

    def match_at(self, node: Node) -> InternalMatch | None:
        """The match whose last node in graph order is `node` (the pattern's other outputs are
        looked for before it), or None."""
        for anchor in self.pattern_anchors:
            match = InternalMatch(self.pattern_anchors)
            if not self._match_nodes(anchor, node, match):
                continue
            others = [a for a in self.pattern_anchors if a is not anchor]
            found = self._with_outputs(match, others, node)
            if found is not None and self._holds(found):
                placeholders, outputs = self.pattern_placeholder_nodes, self.pattern_returning_nodes
                found.placeholder_nodes = [found.nodes_map.get(p) for p in placeholders]
                found.returning_nodes = [found.nodes_map[p] for p in outputs]
                return found
        return None

    def computing(self, match: InternalMatch) -> list[Node]:
        """The matched nodes but the inputs and the sizes they read, in the pattern's order
        (producers first)."""
        return [match.nodes_map[p] for p in calls(self.pattern) if p in match.nodes_map]

    def _with_outputs(
        self, match: InternalMatch, outputs: list[Node], last: Node
    ) -> InternalMatch | None:
        """`match` with the pattern's `outputs` matched too, at nodes before `last` (trying every
        choice)."""
        if not outputs:
            return match
        for candidate in itertools.takewhile(lambda n: n is not last, last.graph.nodes):
            if not self._nodes_are_equal(outputs[0], candidate):
                continue
            trial = copy.copy(match)
            if self._match_nodes(outputs[0], candidate, trial):
                found = self._with_outputs(trial, outputs[1:], last)
                if found is not None:
                    return found
        return None

    def _holds(self, match: InternalMatch) -> bool:
        """Nothing outside the match reads its nodes but its outputs, and fusing the match makes no
        cycle (which only several outputs can)."""
        return self._is_contained(match.nodes_map) and (
            len(self.pattern_anchors) == 1 or validate_partition(self.computing(match))
        )


_SYMBOLIC = {torch.SymBool: bool, torch.SymInt: int, torch.SymFloat: float}


def number(value: Any) -> Any:
    """The number a literal is, or that a graph node computes (a size, symbolic in a dynamic
    graph); None for anything else."""
    if isinstance(value, Node):
        value = value.meta.get("val")
        return value if type(value) in _SYMBOLIC else None
    return value if type(value) in (bool, int, float) else None


def _kind(value: Any) -> type:
    return _SYMBOLIC.get(type(value), type(value))


def same_match(again: InternalMatch | None, match: InternalMatch) -> bool:
    """`again` (the pattern traced at `match`'s inputs) matches the same nodes, reading the same
    tensors."""
    return (
        again is not None
        and _matched_nodes(again) == _matched_nodes(match)
        and tensor_inputs(again) == tensor_inputs(match)
    )


def tensor_inputs(match: InternalMatch) -> list[Node]:
    return [n for n in match.placeholder_nodes if isinstance(n, Node)]


def _matched_nodes(match: InternalMatch) -> frozenset[Node]:
    return frozenset(
        node
        for pattern_node, node in match.nodes_map.items()
        if pattern_node.op not in ("placeholder", "output")
    )
