"""Stage 5's `gradient_sums` pass: autograd's gradient sums folded into the backward of pointwise
regions.

A value read twice (the residual stream feeds both the residual add and a projection) receives two
gradients, and autograd adds them with `aten.add` before the region that produced the value reads
the sum. This pass hands the terms to that region's `seqfast::pointwise_backward` instead: its
kernel adds them as it loads them, and writes the sum only when something else reads it too (the
gradient a residual passes through to the region's own input). It runs on the backward graph.
"""

from __future__ import annotations

import operator

import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node

from seqcompile.fx.nodes import (
    erase_unused,
    insert_call,
    insert_getitem,
    is_call,
    node_order,
    same_shape,
    source_meta,
    tensor_val,
)
from seqcompile.ops.fused_op import Call
from seqcompile.ops.pointwise import reference as pointwise_reference
from seqcompile.ops.pointwise import region as regions

aten = torch.ops.aten
BACKWARD = torch.ops.seqfast.pointwise_backward.default


def fold_gradient_sums(gm: GraphModule) -> list[str]:
    """Fold every sum a region's backward can take apart; return what changed, one line per
    region backward that now adds its gradient terms itself."""
    folded = [
        note for node in list(gm.graph.nodes) if is_call(node, BACKWARD) for note in _fold(gm, node)
    ]
    if folded:
        gm.graph.lint()
        gm.recompile()
    return folded


def _terms(grad: Node, call: Node, order: dict[Node, int], outer: bool = True) -> list[Node] | None:
    """The tensors `grad` is the sum of, when `call` can add them itself: an `add` of two tensors
    of its own shape and dtype whose other readers all run after `call`. Nested sums read only
    by their outer sum are taken apart too."""
    if not is_call(grad, aten.add.Tensor) or grad.kwargs.get("alpha", 1) != 1:
        return None
    if outer:
        if any(order[u] < order[call] for u in grad.users if u is not call):
            return None
    elif len(grad.users) != 1:
        return None
    total = tensor_val(grad)
    terms: list[Node] = []
    for addend in grad.args:
        value = tensor_val(addend)
        if value is None or value.dtype != total.dtype or not same_shape(value, total):
            return None
        terms += _terms(addend, call, order, outer=False) or [addend]
    return terms


def _fold(gm: GraphModule, node: Node) -> list[str]:
    call = Call.of(node)
    grads, written, dtypes = call["grads"], call["written"], call["dtypes"]
    order = node_order(gm.graph)
    flat = iter(grads)
    groups = [[next(flat) for _ in range(n)] for n in call["grad_terms"]]
    folded: dict[int, Node] = {}  # output -> the sum node its terms replace
    for j, group in enumerate(groups):
        terms = _terms(group[0], node, order) if len(group) == 1 else None
        if terms is not None:
            folded[j], groups[j] = group[0], terms
    if not folded:
        return []
    new_written = [w or (j in folded and len(folded[j].users) > 1) for j, w in enumerate(written)]
    needs = tuple(call["needs_grad"])
    before = regions.backward_plan(call["region"], needs, tuple(call["grad_terms"]), tuple(written))
    grad_terms = [len(g) for g in groups]
    after = regions.backward_plan(call["region"], needs, tuple(grad_terms), tuple(new_written))
    moved = _moved_outputs(before, after, written, new_written)
    if moved is None or before.saved != after.saved:
        return []

    new_dtypes = _output_dtypes(before, after, moved, dtypes, grads, folded, new_written)
    terms = [t for group in groups for t in group]
    args = call.arguments(
        grads=terms, grad_terms=grad_terms, written=new_written, dtypes=new_dtypes
    )
    fake_mode = detect_fake_mode([tensor_val(t) for t in terms])
    with gm.graph.inserting_before(node):
        new_call = insert_call(gm.graph, fake_mode, BACKWARD, args)
    new_call.meta.update(source_meta(node))
    for item in list(node.users):
        assert is_call(item, operator.getitem)
        item.args = (new_call, moved[item.args[1]])
    sums = iter(after.sums)
    for j, was_written in enumerate(new_written):
        index = next(sums) if was_written else None
        if j in folded and index is not None:
            with gm.graph.inserting_after(new_call):
                item = insert_getitem(gm.graph, new_call, index)
            folded[j].replace_all_uses_with(item, delete_user_cb=lambda u: u is not node)
    gm.graph.erase_node(node)
    erase_unused(_sum_nodes(folded.values()))
    return [
        f"{new_call.name}: pointwise_backward variant that adds {len(terms)} gradient terms"
        f" itself (instead of {node.name} reading their sums)"
    ]


def _moved_outputs(before, after, written, new_written) -> dict[int, int] | None:
    """Where each value the old call computed sits among the new call's; None when the two plans
    do not line up (then nothing is folded)."""
    moved: dict[int, int] = {}
    pairs = [
        (old.index, new.index)
        for old, new in zip(before.input_grads, after.input_grads, strict=True)
        if old.kind == "computed"
    ]
    old_sums = iter(before.sums)
    new_sums = iter(after.sums)
    for was, now in zip(written, new_written, strict=True):
        old = next(old_sums) if was else None
        new = next(new_sums) if now else None
        if old is not None:
            pairs.append((old, new))
    for old, new in pairs:
        if new is None or moved.setdefault(old, new) != new:
            return None
    return moved


def _output_dtypes(before, after, moved, dtypes, grads, folded, new_written) -> list[int]:
    """Dtype codes of the new call's values: an old value keeps its dtype; a new one (a written
    sum, or a passed-through gradient that is now a sum) has its output gradient's dtype."""
    codes: list[int | None] = [None] * len(after.computed)
    for old, new in moved.items():
        codes[new] = dtypes[old]
    for old, new in zip(before.input_grads, after.input_grads, strict=True):
        if old.kind == "passthrough" and new.kind == "computed" and codes[new.index] is None:
            codes[new.index] = _code(grads[old.index])
    sums = iter(after.sums)
    for j, was_written in enumerate(new_written):
        index = next(sums) if was_written else None
        if index is not None and codes[index] is None:
            codes[index] = _code(folded[j])
    assert None not in codes, codes
    return codes


def _code(node: Node) -> int:
    return pointwise_reference.DTYPE_CODES.index(tensor_val(node).dtype)


def _sum_nodes(tops) -> list[Node]:
    """The folded sums and the nested sums under them."""
    nodes, stack = [], list(tops)
    while stack:
        node = stack.pop()
        if is_call(node, aten.add.Tensor):
            nodes.append(node)
            stack.extend(a for a in node.args if isinstance(a, Node))
    return nodes
