"""What a normalization rule is given: the graph, its fake mode, the node being rewritten (new
nodes take its source location) and the notes it leaves for the report; and a rule, a named
function from a node to its replacement (or None)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import GraphModule, Node

from seqcompile.fx.nodes import insert_call, site_name, source_meta, tensor_val
from seqcompile.report import Missed

aten = torch.ops.aten
Rewrite = Callable[[Node, "RuleContext"], Node | None]


@dataclasses.dataclass
class RuleContext:
    gm: GraphModule
    fake_mode: Any
    site: Node | None = None
    """The node being rewritten; new nodes inherit its source location."""
    notes: list[tuple[str, Missed]] = dataclasses.field(default_factory=list)
    """What the rules tell the report: ("rewritten", "refuted" or "missed", the site and what of
    it)."""
    checked: set[Node] = dataclasses.field(default_factory=set)
    """Nodes a rule's evaluation refuted, not read again."""

    def note(self, kind: str, rule: str, node: Node, text: str) -> None:
        self.notes.append((kind, Missed(site_name(node), rule, text)))

    def call(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        node = insert_call(self.gm.graph, self.fake_mode, target, args, kwargs)
        if self.site is not None:
            node.meta.update(source_meta(self.site))
        return node

    def size(self, x: Node, dim: int) -> Any:
        """`x`'s size along `dim` as an argument of a new op: the number where static, a
        `sym_size` node where symbolic (a raw SymInt is no argument a graph takes)."""
        size = tensor_val(x).shape[dim]
        return size if isinstance(size, int) else self.call(aten.sym_size.int, x, dim)


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    rewrite: Rewrite
