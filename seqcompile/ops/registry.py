"""The registry of fused operators: one `FusedOp` entry per operator, declared in the operator's
folder (`ops/<operator>/__init__.py`). Every stage asks here what it needs to know about a fused
op's call (its kernels, cost, workspace, in-place twin, accumulation hook) and reads the call's
arguments by name; the families, the report and the tests' and benchmarks' lists of operators
are derived from here."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from seqcompile.codegen import KernelSpec
from seqcompile.ops import (
    add_norm,
    attention,
    cross_entropy,
    linear_cross_entropy,
    linear_row_loss,
    pointwise,
    sharding,
    soft_cross_entropy,
)
from seqcompile.ops.fused_op import IMPLEMENTATIONS, Call, FusedOp

ENTRIES: tuple[FusedOp, ...] = (
    attention.ENTRY,
    add_norm.ENTRY,
    cross_entropy.ENTRY,
    linear_cross_entropy.ENTRY,
    linear_row_loss.ENTRY,
    soft_cross_entropy.ENTRY,
    pointwise.ENTRY,
)
_BY_OP = {op: entry for entry in ENTRIES for op in entry.ops}
if torch.distributed.is_available():
    sharding.register({op: rule for entry in ENTRIES for op, rule in entry.sharding.items()})
_BY_NAME = {entry.name: entry for entry in ENTRIES}
FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(entry.family for entry in ENTRIES))
"""The built-in pattern families, in the registry's order: the report's keys for their sites."""


def implementations_offered() -> dict[str, tuple[str, ...]]:
    """What the `implementations` option may ask of each fused operator and each family (what
    all of the family's operators offer)."""
    offered = {entry.name: entry.implementations for entry in ENTRIES}
    for family in FAMILIES:
        each = [set(entry.implementations) for entry in entries_of(family)]
        offered.setdefault(family, tuple(i for i in IMPLEMENTATIONS if all(i in e for e in each)))
    return offered


def entry_named(name: str) -> FusedOp:
    """The entry called `name` (`add_norm`); a KeyError naming the entries for any other."""
    if name not in _BY_NAME:
        raise KeyError(f"no fused operator {name!r}; the registry has {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def entries_of(family: str) -> tuple[FusedOp, ...]:
    """The entries the pattern family `family` makes (none for a user pattern's name)."""
    return tuple(entry for entry in ENTRIES if entry.family == family)


def entry_of(target: Any) -> FusedOp | None:
    """The entry of the fused operator `target` (a node, or an op) belongs to; None for any
    other op."""
    if isinstance(target, Node):
        target = target.target if target.op == "call_function" else None
    return _BY_OP.get(target)


def kernels_of(node: Node) -> list[KernelSpec]:
    """The generated kernels a call of a fused op launches, at the traced sizes."""
    entry = entry_of(node)
    if entry is None:
        return []
    return entry.kernels[node.target](Call.of(node))


def flops_of(node: Node) -> int | None:
    """FLOPs of a fused op's call that its entry counts; None when it gives no formula."""
    entry = entry_of(node)
    formula = entry.flops.get(node.target) if entry is not None else None
    return formula(Call.of(node)) if formula is not None else None


def workspace_of(node: Node) -> int:
    """Bytes a fused op's call allocates and frees while it runs."""
    entry = entry_of(node)
    formula = entry.workspace.get(node.target) if entry is not None else None
    return formula(Call.of(node)) if formula is not None else 0
