"""The fuse stage's machinery: a pattern looks at one anchor node and answers with a rewrite, a
`Reject` (recognized, but the kernel cannot take it, and why), or None (not its anchor). The engine
runs the patterns over a graph, applies rewrites, and records counts and refusals in the report.
An error while a site is read or rewritten leaves that site unfused, the graph as it was, and the
error in the report and a warning; under `SEQFAST_STRICT=1` (the test suite) it is raised."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg

from seqcompile.fx.evaluate import Evaluator
from seqcompile.fx.nodes import (
    depends_on,
    in_layout_of,
    insert_call,
    site_name,
    source_meta,
    tensor_val,
)
from seqcompile.ops import sharding
from seqcompile.ops.fused_op import Call, by_name
from seqcompile.ops.random import SEED_HIGH
from seqcompile.ops.registry import entries_of, entry_of
from seqcompile.options import Options
from seqcompile.report import CompileReport, Missed
from seqcompile.run.settings import switch_on

aten = torch.ops.aten
log = logging.getLogger("seqcompile")
T = TypeVar("T")

STRICT_ENV = "SEQFAST_STRICT"
"""Set to 1, an error raised while a site is read or rewritten fails the compile instead of
leaving the site unfused: the test suite runs so, so that no bug hides behind a missed site."""


def strict() -> bool:
    """Whether `SEQFAST_STRICT` asks for errors to be raised."""
    return switch_on(STRICT_ENV)


class Reject:
    """A refusal with a reason built only when someone reads it."""

    def __init__(self, template: str, *args: Any) -> None:
        self.template, self.args = template, args

    @property
    def reason(self) -> str:
        return self.template.format(*self.args)

    def __repr__(self) -> str:
        return f"Reject({self.reason!r})"


class ReadingFailed(Reject):
    """The reading of a site raised (`read_site`): the site is missed, the error its reason."""


class Refused(Exception):
    """Raised by a rewrite that finds, as it builds its fused call, that the call cannot run on
    the graph's values (a fused op on DTensors placed as no sharding rule of it takes): the engine
    puts the graph back as the rewrite found it (`rewritten`) and records the reason as a
    refusal."""


def dtensor_refusal(op: Any, args: tuple) -> str | None:
    """Why a call of the fused op `op` with positional `args` (nodes, or values) cannot run on the
    DTensors it would take, as they are placed (`ops/sharding.py`); None where it can."""
    entry = entry_of(op)
    rule = entry.sharding.get(op) if entry is not None else None
    reason = sharding.refusal(op, rule, Call(op, args, {})) if rule is not None else None
    return None if reason is None else f"{entry.name} on DTensors: {reason}"


Rewrite = Callable[["FuseContext"], Node]
"""Applies a match to the graph and returns the fused node."""


class Pattern(Protocol):
    """A built-in family or a user pattern (`user.py`). `run_patterns` asks it about every node in
    graph order, in the graph as the rewrites before left it, and applies a rewrite at once."""

    family: str
    """Key under which the report counts this pattern's sites."""

    def find(self, node: Node, ctx: FuseContext) -> Rewrite | Reject | None:
        """The site anchored at `node`: the rewrite that fuses it, why it cannot be fused, or None
        where no site is anchored there."""
        ...


@dataclasses.dataclass
class FuseContext:
    """What a rewrite may use: the graph, its fake mode, the report, and the per-graph seed."""

    gm: GraphModule
    fake_mode: Any
    report: CompileReport
    training: bool
    """Whether AOTAutograd will build a backward (inputs may need gradients)."""
    grad_inputs: frozenset[Node] = frozenset()
    """Placeholders whose example inputs require grad (fake values in the pre-dispatch graph all
    say `requires_grad=False`)."""
    options: Options = dataclasses.field(default_factory=Options)
    site: Node | None = None
    """The anchor being rewritten; new nodes inherit its source location."""
    fuse_only: frozenset[str] | None = None
    """Keys of the sites that may be fused (None: every site); `verify` narrows it."""
    static_values: Mapping[Node, Any] = dataclasses.field(default_factory=dict)
    """The values of the graph inputs Dynamo marks static (parameters and buffers) at compile
    time, where they hold values (`backend._static_values`): what the report says of a value
    computed from them alone."""
    sites: dict[str, str] = dataclasses.field(default_factory=dict)
    """Key ("family:anchor") of each site fused, in order, with its place in the source."""
    captured: frozenset[str] = dataclasses.field(init=False)
    """Names of the nodes the graph had before this stage: the anchors that name a site the same
    way in every compile of the graph, whichever other sites were fused."""
    evaluator: Evaluator = dataclasses.field(
        default_factory=lambda: Evaluator(torch.Generator().manual_seed(0))
    )
    """Evaluates the graph's values on random inputs, for checking what a pattern reads from the
    code that computes a value (its own generator: torch's is left as it was)."""
    _seeds: dict[torch.device, Node] = dataclasses.field(default_factory=dict)
    _streams: int = 0
    _warned: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    """The errors warned about so far, as (type, message): each is warned about once."""

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        node = insert_call(self.gm.graph, self.fake_mode, target, args, kwargs)
        if self.site is not None:
            node.meta.update(source_meta(self.site))
        return node

    def call_fused(self, op: Any, **arguments: Any) -> Node:
        """A call of the fused op `op`, its arguments given by the names in its schema; raises
        `Refused` where it would take DTensors placed as the op's sharding rule does not take."""
        args = by_name(op, **arguments)
        reason = dtensor_refusal(op, args)
        if reason is not None:
            raise Refused(reason)
        return self.call(op, *args)

    def in_layout_of(self, value: Node, like: torch.Tensor) -> Node:
        return in_layout_of(self, value, like)

    def sizes(self, node: Node, dims: Iterable[int]) -> list[int | Node]:
        """`node`'s sizes along `dims` as arguments for a new node: an int where the size is
        one, a `sym_size` node where it is symbolic."""
        shape = tensor_val(node).shape
        return [
            shape[d] if isinstance(shape[d], int) else self.call(aten.sym_size.int, node, d)
            for d in dims
        ]

    def requires_grad(self, node: Node | None) -> bool:
        return self.training and node is not None and depends_on(node, self.grad_inputs)

    def seed(self, device: torch.device) -> Node:
        """The graph's seed tensor on `device`, drawn once per run from torch's generator."""
        if device not in self._seeds:
            placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
            anchor = placeholders[-1] if placeholders else None
            where = (
                self.gm.graph.inserting_after(anchor)
                if anchor is not None
                else self.gm.graph.inserting_before(next(iter(self.gm.graph.nodes)))
            )
            with where:
                self._seeds[device] = self.call(
                    aten.randint.low, 0, SEED_HIGH, [], dtype=torch.int64, device=device
                )
        return self._seeds[device]

    def forget_erased_seeds(self) -> None:
        live = set(self.gm.graph.nodes)
        self._seeds = {device: n for device, n in self._seeds.items() if n in live}

    def next_stream(self) -> int:
        """A distinct random stream per dropout site, so sites sharing the seed differ."""
        self._streams += 1
        return self._streams

    def __post_init__(self) -> None:
        self.captured = frozenset(n.name for n in self.gm.graph.nodes)

    def anchor(self, nodes: list[Node]) -> Node:
        """The node that names a site made of `nodes` (in graph order): the last one the graph
        had before this stage (nodes rewrites inserted are named by what else was fused)."""
        return next((n for n in reversed(nodes) if n.name in self.captured), nodes[-1])

    def admits(self, family: str, anchor: Node) -> bool:
        """Whether the site anchored at `anchor` may be fused."""
        return self.fuse_only is None or site_key(family, anchor) in self.fuse_only

    def fused(self, family: str, anchor: Node) -> None:
        """Record a site of `family` fused at `anchor`: in the sites, and counted in the report
        with the operators the registry says the family makes."""
        self.sites[site_key(family, anchor)] = site_name(anchor)
        self.report.counts[family] += 1
        names = tuple(entry.name for entry in entries_of(family))
        self.report.operators.setdefault(family, names)

    def failed(self, family: str, node: Node, step: str, error: Exception) -> str:
        """Why the site at `node` is left unfused: `error`, raised by `family` while `step` it (a
        seqcompile bug). Warned about once per distinct error, with the traceback logged at debug
        level; raised again under `SEQFAST_STRICT`."""
        if strict():
            raise error
        name, message = type(error).__name__, " ".join(str(error).split())
        reason = (
            f"{family} raised {name} while {step} this site, so it is left unfused: {message}"
            f" (a seqcompile bug; {STRICT_ENV}=1 raises it)"
        )
        log.debug("%s at %s", reason, site_name(node), exc_info=error)
        if (name, message) not in self._warned:
            self._warned.add((name, message))
            warnings.warn(f"seqfast: {site_name(node)}: {reason}", stacklevel=2)
        return reason


def site_key(family: str, anchor: Node) -> str:
    """A fused site's name, the same in every compile of the graph."""
    return f"{family}:{anchor.name}"


def read_site(
    ctx: FuseContext, family: str, node: Node, read: Callable[..., T], *args: Any
) -> T | Reject:
    """`read(*args)`, `family`'s reading of the site at `node`, or where it raises, the refusal
    that says so (`FuseContext.failed`)."""
    try:
        return read(*args)
    except Exception as error:  # a bug in the reading: the site is missed, the rest fuses
        return ReadingFailed("{}", ctx.failed(family, node, "reading", error))


class _Checkpoint:
    """The graph as a rewrite found it, put back where the rewrite raises half-way: its nodes in
    order and what each reads. A node the rewrite erases stays in the graph, reading nothing,
    until the rewrite has returned (`commit`), so that `restore` can give it back its inputs."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.order = list(graph.nodes)
        self.inputs = [(n.args, n.kwargs) for n in self.order]  # (cheaper than a dict by node)
        self.known = set(self.order)
        self.erased: dict[Node, None] = {}
        graph.erase_node = self._erase  # type: ignore[method-assign]

    def _erase(self, node: Node) -> None:
        if node not in self.known or node.users:
            Graph.erase_node(self.graph, node)  # (with readers, raises FX's error naming them)
            return
        node.args, node.kwargs = map_arg((node.args, node.kwargs), lambda _: None)
        self.erased[node] = None

    def _release(self) -> None:
        self.graph.__dict__.pop("erase_node", None)

    def commit(self) -> None:
        self._release()
        read = [n.name for n in self.erased if n.users]
        if read:
            raise RuntimeError(f"the rewrite erased {read} but the graph still reads them")
        for node in self.erased:
            self.graph.erase_node(node)

    def restore(self) -> None:
        """Take out the nodes the rewrite inserted, and give the graph's own their inputs and
        order back."""
        self._release()
        for node, (args, kwargs) in zip(self.order, self.inputs, strict=True):
            if node.args is not args or node.kwargs is not kwargs:
                node.args, node.kwargs = args, kwargs
        inserted = [n for n in self.graph.nodes if n not in self.known]
        for node in inserted:
            node.args, node.kwargs = (), {}
        for node in inserted:
            self.graph.erase_node(node)
        if list(self.graph.nodes) != self.order:
            for before, node in itertools.pairwise(self.order):
                before.append(node)


def rewritten(ctx: FuseContext, family: str, node: Node, rewrite: Rewrite) -> bool:
    """Apply `rewrite` at the site at `node` (inserting before it unless the rewrite says where);
    whether it applied. Where it is `Refused`, or raises (`FuseContext.failed`), the graph is put
    back as the rewrite found it and the site reported missed."""
    graph = ctx.gm.graph
    checkpoint = _Checkpoint(graph)
    ctx.site = node
    try:
        with graph.inserting_before(node):
            rewrite(ctx)
        checkpoint.commit()
    except Exception as error:  # Refused, or a bug in the rewrite: the site is missed
        checkpoint.restore()
        ctx.forget_erased_seeds()
        reason = (
            str(error)
            if isinstance(error, Refused)
            else ctx.failed(family, node, "rewriting", error)
        )
        ctx.report.missed.append(Missed(site_name(node), family, reason))
        return False
    finally:
        ctx.site = None
    return True


def run_patterns(patterns: list[Pattern], ctx: FuseContext) -> None:
    """Try every pattern at every node, in graph order; the first pattern that answers wins."""
    for node in list(ctx.gm.graph.nodes):
        if node.op != "call_function" or getattr(node, "_erased", False):
            continue
        for pattern in patterns:
            found = read_site(ctx, pattern.family, node, pattern.find, node, ctx)
            if found is None:
                continue
            if isinstance(found, Reject):
                ctx.report.missed.append(Missed(site_name(node), pattern.family, found.reason))
            elif ctx.admits(pattern.family, node) and rewritten(ctx, pattern.family, node, found):
                ctx.fused(pattern.family, node)
            break
    ctx.gm.graph.eliminate_dead_code()  # what fed only replaced nodes (a causal mask's builders)
    ctx.gm.graph.lint()
    ctx.gm.recompile()
