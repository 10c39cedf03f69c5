"""Backward ops that write their result over a saved tensor the backward reads nowhere else (the
registry entries' in-place twins).

The cross-entropy backward's gradient has the logits' shape and dtype, and the logits are read by
nothing after it: writing the gradient over them saves a tokens x vocabulary buffer at the step's
peak. The swap is safe only when no one else can see the saved tensor: it is computed by the
forward (not a graph input such as a parameter or the user's own tensor) and shares its storage
with no output the user gets and no other saved value. A backward that autograd runs keeping the
graph for another (`retain_graph=True`, `create_graph=True`) gives the twins copies of the saved
tensors instead (`lower/retained_graph.py`), so a second backward finds them as the forward left
them; a backward that frees the graph, the usual case, writes over them.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from seqcompile.fx.nodes import tensor_val
from seqcompile.memory.estimate import graph_outputs, saved_values, tensor_bytes
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call


def write_over_saved(
    forward: GraphModule, backward: GraphModule, num_fwd_outputs: int
) -> dict[str, int]:
    """Swap in the in-place twin wherever its argument is a saved tensor only it may touch;
    returns, per swapped call, the bytes it writes over instead of allocating (at the traced
    sizes)."""
    private = _private_saved(forward, num_fwd_outputs)
    swapped: dict[str, int] = {}
    for node in list(backward.graph.nodes):
        entry = registry.entry_of(node)
        if entry is None or entry.in_place is None or node.target is not entry.in_place.functional:
            continue
        call = Call.of(node)
        over = call[entry.in_place.over]
        if not (
            isinstance(over, Node)
            and over.op == "placeholder"
            and over.name in private
            and list(over.users) == [node]
            and _same_layout(over, node)
        ):
            continue
        with backward.graph.inserting_before(node):
            twin = backward.graph.call_function(
                entry.in_place.twin, call.arguments_of(entry.in_place.twin)
            )
        twin.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        twin.meta["val"] = None
        node.replace_all_uses_with(over)
        backward.graph.erase_node(node)
        swapped[twin.name] = tensor_bytes(tensor_val(over))
    if swapped:
        backward.graph.lint()
        backward.recompile()
    return swapped


def _private_saved(forward: GraphModule, num_fwd_outputs: int) -> set[str]:
    """Names of the saved values computed by the forward whose storage nothing else shares: no
    graph input, no user-visible output, no other saved value."""
    visible = list(forward.graph.find_nodes(op="placeholder"))
    visible += [n for n in graph_outputs(forward)[:num_fwd_outputs] if isinstance(n, Node)]
    saved = [n for n in saved_values(forward, num_fwd_outputs) if tensor_val(n) is not None]
    owners: dict[StorageWeakRef, int] = {}
    for node in visible + saved:
        if (value := tensor_val(node)) is not None:
            key = StorageWeakRef(value.untyped_storage())
            owners[key] = owners.get(key, 0) + 1
    return {
        node.name
        for node in saved
        if node.op != "placeholder"
        and owners[StorageWeakRef(tensor_val(node).untyped_storage())] == 1
    }


def _same_layout(saved: Node, call: Node) -> bool:
    """The result the op would allocate has the saved tensor's shape, dtype and strides (so the
    twin writes straight into it, and the readers of the result see the layout they were traced
    with)."""
    result, value = tensor_val(call), tensor_val(saved)
    return (
        result is not None
        and value is not None
        and result.dtype == value.dtype
        and result.shape == value.shape
        and result.stride() == value.stride()
    )
