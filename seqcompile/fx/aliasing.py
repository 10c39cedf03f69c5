"""Which memory the in-place ops of a captured graph write. The graph is not functionalized: an
in-place op (`m[:, :5] = True`, `bias.triu_(1)`) writes its first argument, and through it the
base that argument views and every other view of that base. Rewrites that read a value from how it
was computed (a mask from its `tril`, a bias from its `arange`s) or turn an in-place op into a copy
must know whether such a write reaches it, or they would drop the write."""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from seqcompile.fx.nodes import depends_on, tensor_val


def writes_in_place(node: Node) -> bool:
    """Whether `node` writes its first argument in place (`add_`, `fill_`, `copy_`)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    arguments = node.target._schema.arguments
    return bool(arguments) and bool(arguments[0].alias_info and arguments[0].alias_info.is_write)


def _may_alias(node: Node) -> bool:
    """Whether `node`'s result may share its first argument's memory (a view, an in-place op's
    result, a piece of `split`); a cast to another dtype (`to`, which the schema lets alias)
    copies."""
    if node.op != "call_function":
        return False
    if not isinstance(node.target, torch._ops.OpOverload):
        return node.target is operator.getitem
    if not any(r.alias_info is not None for r in node.target._schema.returns):
        return False
    out, source = tensor_val(node), tensor_val(node.args[0]) if node.args else None
    converts = out is not None and source is not None and out.dtype != source.dtype
    return not converts or node.target is torch.ops.aten.view.dtype


def _family(node: Node) -> tuple[set[Node], set[Node]]:
    """The nodes that share `node`'s memory: its base (following views and in-place ops up to
    what made the memory) and everything aliasing that base, split into (the base and in-place
    results on it, views)."""
    base = node
    while _may_alias(base) and isinstance(base.args[0], Node):
        base = base.args[0]
    same, views, stack = {base}, set(), [base]
    while stack:
        for user in stack.pop().users:
            if (
                user in same
                or user in views
                or not _may_alias(user)
                or user.args[0] not in (same | views)
            ):
                continue
            (same if writes_in_place(user) and user.args[0] in same else views).add(user)
            stack.append(user)
    return same, views


def written_through_a_view(node: Node) -> bool:
    """Whether an in-place op writes a view of `node`'s memory (`y[:, 0] = 0` after `y.mul_(3)`):
    a copy made in place of an in-place op on `node` would not see that write."""
    _, views = _family(node)
    return any(writes_in_place(u) and u.args[0] is view for view in views for u in view.users)


def computed_from_written(node: Node) -> bool:
    """Whether `node`, or a value it is computed from, shares memory an in-place op writes: its
    value is then not what its computation alone says."""
    written: set[Node] = set()
    for user in node.graph.nodes:
        if writes_in_place(user) and isinstance(user.args[0], Node) and user.args[0] not in written:
            same, views = _family(user.args[0])
            written |= same | views
    return bool(written) and depends_on(node, frozenset(written))  # (most graphs write none)
