"""A norm's output, made again from the sum the norm's backward keeps.

A residual + norm (`add_norm` with a prologue) returns its output `y` and the sum it normalized;
its backward keeps the sum, and the linear after it keeps `y` for its weight gradient: two
activations per norm. `y` is the sum normalized again, which needs nothing else the backward does
not keep (weight and bias are parameters), so this pass offers the planner a second producer of
`y` for the backward's readers: an `add_norm` of the sum alone. The planner recomputes it (it has
no FLOPs and frees `y`) or not, and `withdraw` removes the offers it did not take.
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from typing import Any

import torch
from torch.fx import GraphModule, Node

from seqcompile.fx.nodes import insert_call, insert_getitem, source_meta
from seqcompile.ops.add_norm.reference import has_prologue
from seqcompile.ops.fused_op import Call

_ADD_NORM = torch.ops.seqfast.add_norm.default
_OUT, _SUM = 0, 1


def offer(joint: GraphModule, forward: Collection[Node], fake_mode: Any) -> list[list[Node]]:
    """Give the backward's readers of each prologue norm's output (directly or through views)
    that output made from the norm's sum instead; returns the nodes added, one list per norm,
    its `add_norm` first."""
    offers = []
    for norm in [n for n in forward if n.target is _ADD_NORM]:
        call = Call.of(norm)
        if not has_prologue(call["residual"], call["branch_bias"], call["p"]):
            continue  # the norm's input is what its backward keeps: the planner can redo it
        out, total = _item(norm, _OUT), _item(norm, _SUM)
        if out is None or total is None or not _read_in_backward(out, forward):
            continue
        graph = joint.graph
        args = call.arguments(x=total, residual=None, branch_bias=None, seed=None, p=0.0)
        with graph.inserting_after(total):
            again = insert_call(graph, fake_mode, _ADD_NORM, args)
        again.meta.update(source_meta(norm))
        with graph.inserting_after(again):
            out_again = insert_getitem(graph, again, _OUT)
        offers.append([again, out_again, *_redirect(out, out_again, forward, fake_mode)])
    return offers


def withdraw(offers: list[list[Node]], recomputed: Collection[str]) -> None:
    """Put back the readers of the offers whose `add_norm` the planner did not recompute, and
    erase those offers."""
    taken = set(recomputed)
    for nodes in offers:
        if nodes[0].name in taken:
            continue
        for node in reversed(nodes):
            original = node.meta.pop("offered_for", None)
            if original is not None:
                node.replace_all_uses_with(original)
            node.graph.erase_node(node)


def _redirect(value: Node, again: Node, forward: Collection[Node], fake_mode: Any) -> list[Node]:
    """Point the backward's readers of `value` at `again`, and those of each view of `value` at
    the same view of `again`; returns the views added."""
    again.meta["offered_for"] = value
    added = []
    for user in list(value.users):
        if user not in forward:
            user.replace_input_with(value, again)
        elif _is_view(user) and _read_in_backward(user, forward):
            args, kwargs = torch.fx.node.map_arg(
                (user.args, user.kwargs), lambda n: again if n is value else n
            )
            with value.graph.inserting_after(again):
                view = insert_call(value.graph, fake_mode, user.target, args, kwargs)
            view.meta.update(source_meta(user))
            added.append(view)
            added.extend(_redirect(user, view, forward, fake_mode))
    return added


def _read_in_backward(value: Node, forward: Collection[Node]) -> bool:
    return any(
        u not in forward or (_is_view(u) and _read_in_backward(u, forward)) for u in value.users
    )


def _is_view(node: Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _item(node: Node, index: int) -> Node | None:
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user
    return None
