"""What the attention family concludes about a mask or bias from the code that computes it (a mask
is causal, a window, a prefix's; a float tensor is 0 where a mask keeps and a fill elsewhere; a
bias is zeros, or depends on positions only through key - query), stated as claims and checked by
evaluating the model's own sub-graph (`fx/evaluate.py`) at the traced sizes, at a second size in
a dynamic graph, with random values for the inputs it reads. A refuted claim marks its node, which
the readers then take as the tensor it is; a claim too large to evaluate stands unchecked."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import Node

from seqcompile.fx.aliasing import computed_from_written
from seqcompile.fx.evaluate import Evaluator, Sizes, Unevaluated, other_sizes, size_at, traced_sizes
from seqcompile.patterns.attention.positions import HalfPlane, Prefix

log = logging.getLogger("seqcompile")
REFUTED = "seqfast_refuted"
"""`node.meta` key of a node whose reading a check refuted, with the reason."""
FILL_LIMIT = -1e4
"""Values at most this (links.CAUSAL_FILL) mask a score as a fill does: they compare equal."""


def read_as_is(node: Node) -> bool:
    """Whether `node` must be read as the tensor it is, not from how it is computed: an in-place
    op writes what it is computed from, or a check refuted a reading of it."""
    return REFUTED in node.meta or computed_from_written(node)


@dataclasses.dataclass(frozen=True)
class KeepClaim:
    """`node` keeps (True keeping where `keeps`; a number keeps where not 0) exactly the scores in
    the intersection of `planes`, widened by `prefix`'s keys, among those `within` keeps."""

    node: Node
    keeps: bool
    scores: Sequence[Any]
    """The scores' shape (..., Lq, Lk), symbolic where the graph is."""
    reading: str
    planes: tuple[HalfPlane, ...] = ()
    prefix: Prefix | None = None
    within: tuple[tuple[Node, bool], ...] = ()
    """Other mask factors under which the reading holds (the documents of position ids)."""

    def refute(self, values: _Values) -> str | None:
        actual = values.keep(self.node, self.keeps)
        lq, lk = values.rows(self.scores)
        expected = torch.ones(lq, lk, dtype=torch.bool)
        for plane in self.planes:  # tril(d) keeps kv - q <= d, triu(d) kv - q >= d
            expected = expected.tril(plane.bound) if plane.upper else expected.triu(plane.bound)
        if self.prefix is not None:
            length = self.prefix.offset
            if self.prefix.length is not None:
                length = values.tensor(self.prefix.length) + self.prefix.offset
            expected = expected | (torch.arange(lk) < length)
        for factor, keeps in self.within:
            inside = values.keep(factor, keeps)
            actual, expected = actual & inside, expected & inside
        where = _first_difference(actual, expected)
        if where is None:
            return None
        seen = "keeps" if bool(_at(actual, expected, where)) else "masks"
        return f"read as {self.reading}, but the model's mask {seen} the score at {where}"


@dataclasses.dataclass(frozen=True)
class FillClaim:
    """`node` (float) holds `term` (0 where None) where `condition` keeps (True keeping where
    `keeps`; everywhere where None) and `fill` elsewhere; values at most `FILL_LIMIT` are equal,
    as they mask alike."""

    node: Node
    reading: str
    condition: Node | None = None
    keeps: bool = True
    fill: float = 0.0
    term: Node | None = None

    def refute(self, values: _Values) -> str | None:
        actual = values.tensor(self.node)
        dtype = torch.float64 if actual.dtype == torch.float64 else torch.float32
        actual = actual.to(dtype)
        term = values.tensor(self.term).to(dtype) if self.term is not None else None
        expected = term if term is not None else torch.zeros((), dtype=dtype)
        if self.condition is not None:
            kept = values.keep(self.condition, self.keeps)
            expected = torch.where(kept, expected, torch.tensor(self.fill, dtype=dtype))
        if _equal(actual, expected):
            return None
        same = (
            (actual == expected)
            | (actual.isnan() & expected.isnan())
            | ((actual <= FILL_LIMIT) & (expected <= FILL_LIMIT))
        )
        where = _first_difference(same, torch.ones((), dtype=torch.bool))
        if where is None:
            return None
        found = _at(actual, same, where).item()
        return f"read as {self.reading}, but the model's value at {where} is {found}"


@dataclasses.dataclass(frozen=True)
class RelativeClaim:
    """The bias `node` (..., Lq, Lk) is constant along each diagonal: it depends on the positions
    only through key - query."""

    node: Node
    reading: str = "a bias by key - query position"

    def refute(self, values: _Values) -> str | None:
        bias = values.tensor(self.node)
        same = (bias[..., 1:, 1:] == bias[..., :-1, :-1]) | (
            bias[..., 1:, 1:].isnan() & bias[..., :-1, :-1].isnan()
        )
        where = _first_difference(same, torch.ones((), dtype=torch.bool))
        if where is None:
            return None
        return f"read as {self.reading}, but the model's bias differs along the diagonal at {where}"


Claim = KeepClaim | FillClaim | RelativeClaim


class _Values:
    """Values of nodes at one assignment of sizes; `Unevaluated` is raised out as `_Skip`."""

    def __init__(self, evaluator: Evaluator, sizes: Sizes) -> None:
        self.evaluator, self.sizes = evaluator, sizes

    def tensor(self, node: Node) -> torch.Tensor:
        value = self.evaluator.value(node, self.sizes)
        if isinstance(value, Unevaluated):
            raise _Skip(value.reason)
        return value if isinstance(value, torch.Tensor) else torch.tensor(value)

    def keep(self, node: Node, keeps: bool) -> torch.Tensor:
        value = self.tensor(node)
        kept = value if value.dtype == torch.bool else value != 0
        return kept if keeps else ~kept

    def rows(self, scores: Sequence[Any]) -> tuple[int, int]:
        try:
            return int(size_at(scores[-2], self.sizes)), int(size_at(scores[-1], self.sizes))
        except TypeError as error:  # a symbol the assignment does not give
            raise _Skip(f"the scores' size {scores}: {error}") from error


class _Skip(Exception):
    """A value a claim needs could not be evaluated."""


def _equal(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal where broadcast together (False where they do not broadcast)."""
    try:
        a, e = torch.broadcast_tensors(actual, expected)
    except RuntimeError:
        return False
    return torch.equal(a, e)


def _first_difference(actual: torch.Tensor, expected: torch.Tensor) -> tuple[int, ...] | None:
    """The first index where `actual` and `expected` (broadcast together) differ, or None; also
    where they do not broadcast (the index is then empty)."""
    if _equal(actual, expected):
        return None
    try:
        a, e = torch.broadcast_tensors(actual, expected)
    except RuntimeError:
        return ()
    return tuple(int(i) for i in (a != e).nonzero()[0])


def _at(value: torch.Tensor, other: torch.Tensor, where: tuple[int, ...]) -> torch.Tensor:
    """`value` broadcast with `other`, at `where`."""
    return torch.broadcast_tensors(value, other)[0][where] if where else value


def refutations(claims: Sequence[Claim], evaluator: Evaluator) -> list[tuple[Claim, str]]:
    """The claims the model's code refutes, each with the reason, at the traced sizes and, in a
    dynamic graph, at a second size; claims that cannot be evaluated are logged and stand."""
    if not claims:
        return []
    sizes = traced_sizes([c.node for c in claims] + [getattr(c, "scores", ()) for c in claims])
    assignments = [sizes, other_sizes(sizes)] if sizes else [sizes]
    refuted = []
    with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
        for claim in claims:
            for assignment in assignments:
                try:
                    reason = claim.refute(_Values(evaluator, assignment))
                except _Skip as skipped:
                    log.debug("unchecked: %s (%s): %s", claim.reading, claim.node, skipped)
                    break
                if reason is not None:
                    refuted.append((claim, reason))
                    break
    return refuted
