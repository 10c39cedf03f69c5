"""In-place ops out of place: an in-place op on a value the graph made itself becomes its
out-of-place form, so the families and the region fuser see plain math."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node
from torch.multiprocessing.reductions import StorageWeakRef

from seqcompile.fx.aliasing import written_through_a_view
from seqcompile.fx.nodes import grad_enabled_at, in_layout_of, tensor_val
from seqcompile.normalize.context import RuleContext

aten = torch.ops.aten


def out_of_place(node: Node, ctx: RuleContext) -> Node | None:
    """An in-place op (`x.add_(y)`, `scores *= c`) on a value the graph made itself, that no view
    shares and no op writes through a view, becomes its out-of-place form, read by the op's
    readers and by every later reader of that value: the families and the region fuser then see
    plain math (an in-place op stops them). The result keeps the value's dtype, as the in-place op
    does."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_") or name in _KEPT_IN_PLACE:
        return None
    functional = getattr(getattr(aten, name[:-1], None), target._overloadname, None)
    value = node.args[0] if node.args else None
    if functional is None or not _fresh(value):
        return None
    if not grad_enabled_at(node) and _turns_grad_on(node.graph):
        return None  # under no_grad the in-place op keeps the value's history; a copy would not
    if any(_aliases(u) for u in value.users if u is not node) or written_through_a_view(value):
        return None  # a write through a view would stay on the value the copy replaces
    result = ctx.call(functional, *node.args, **node.kwargs)
    dtype = tensor_val(value).dtype
    if tensor_val(result) is None or tensor_val(result).shape != tensor_val(value).shape:
        node.graph.erase_node(result)
        return None
    if tensor_val(result).dtype != dtype:
        result = ctx.call(aten.to.dtype, result, dtype)
    result = in_layout_of(ctx, result, tensor_val(value))
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    for reader in list(value.users):
        if reader is not node and order[reader] > order[node]:
            reader.replace_input_with(value, result)
    return result


_KEPT_IN_PLACE = frozenset({"copy_"})
"""In-place ops whose out-of-place form autograd cannot differentiate (`aten.copy`)."""


def _turns_grad_on(graph: Any) -> bool:
    """Whether any value of the graph is made with grad mode on (a graph compiled under no_grad
    that never enables it has no history to keep)."""
    enables = any(
        n.op == "call_function" and n.target is torch._C._set_grad_enabled and n.args[0]
        for n in graph.nodes
    )
    return torch.is_grad_enabled() or enables


def _fresh(node: Any) -> bool:
    """A value an op of the graph made, not a view of another (nor an input)."""
    return (
        isinstance(node, Node)
        and node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and not _aliases(node)
        and isinstance(tensor_val(node), torch.Tensor)
    )


def _aliases(node: Node) -> bool:
    """Whether `node`'s result may share memory with an input (a view, an in-place op); an op
    that only may (`to` a dtype) is asked through the storages of the traced values."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    if all(r.alias_info is None for r in node.target._schema.returns):
        return False
    out = tensor_val(node)
    if out is None:
        return True
    storage = StorageWeakRef(out.untyped_storage())
    return any(
        StorageWeakRef(tensor_val(n).untyped_storage()) == storage
        for n in node.all_input_nodes
        if tensor_val(n) is not None
    )
