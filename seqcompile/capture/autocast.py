"""Autocast made explicit. Capture traces a `torch.autocast` region with autocast really on, so each
node's fake value has the dtype autocast gives it. This pass then writes autocast's casts into the
graph (`aten.to.dtype` on an op's floating inputs) wherever the op alone would give another dtype,
and drops the region's enter and exit nodes once every op in it is explicit. Patterns downstream see
plain dtypes: the upcast softmax autocast implies looks like the one users write, and a fused op
gets the inputs autocast would have given the ops it replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_flatten, tree_map

from seqcompile.fx.nodes import fake_values, insert_call, source_meta, val

aten = torch.ops.aten
ENTER = torch.amp.autocast_mode._enter_autocast
EXIT = torch.amp.autocast_mode._exit_autocast
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)


def enter_for_trace(args: tuple[Any, ...]) -> torch.autocast:
    """Enter the autocast region an `_enter_autocast(*args)` node opens. Under pre-dispatch
    tracing `torch.autocast.__enter__` both records the node and switches autocast on, so the ops
    traced inside get autocast's dtypes."""
    region = torch.autocast(*args)
    region.__enter__()
    return region


def make_autocast_explicit(gm: GraphModule, fake_mode: Any) -> int:
    """Write the casts of every autocast region into the graph; returns how many regions were
    removed. When autocast is on around the compiled code, the whole graph is one region that
    stays (the code runs under it), and so do regions inside it. A region with an op this pass
    cannot make explicit keeps its enter and exit nodes: autocast then applies when the graph is
    traced again, and the casts written are no-ops under it."""
    if ambient():
        for node in list(gm.graph.nodes):
            _explicit(node, gm, fake_mode)
        gm.recompile()
        return 0
    removed = 0
    for enter, inside, exit_ in _regions(gm):
        explicit = [_explicit(node, gm, fake_mode) for node in inside]
        if all(explicit) and exit_ is not None:
            switches = [enter, *(n for n in inside if n.target in (ENTER, EXIT)), exit_]
            for node in reversed(switches):
                gm.graph.erase_node(node)
            removed += 1
    gm.recompile()
    return removed


def _regions(gm: GraphModule) -> Iterator[tuple[Node, list[Node], Node | None]]:
    """Each outermost region: its enter node, the nodes inside (nested regions' included) and
    its exit node (None when the graph ends inside it)."""
    depth, enter, inside = 0, None, []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is ENTER:
            depth += 1
            if depth == 1:
                enter, inside = node, []
                continue
        elif node.op == "call_function" and node.target is EXIT:
            depth -= 1
            if depth == 0:
                yield enter, inside, node
                continue
        if depth > 0:
            inside.append(node)
    if depth > 0:
        yield enter, inside, None


def _explicit(node: Node, gm: GraphModule, fake_mode: Any) -> bool:
    """Make `node` give its recorded dtype without autocast; whether it now does."""
    if node.op != "call_function" or node.target in (ENTER, EXIT):
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return not isinstance(node.target, torch._ops.HigherOrderOperator)
    wanted = _dtypes(val(node))
    if _dtypes(_run_plain(node, fake_mode)) == wanted:
        return True
    floating = {d for d in wanted if d is not None and d.is_floating_point}
    if len(floating) != 1:
        return False
    (dtype,) = floating
    old_args, old_kwargs = node.args, node.kwargs
    with gm.graph.inserting_before(node):
        casts: dict[Node, Node] = {}
        node.args, node.kwargs = tree_map(
            lambda a: _cast(a, dtype, casts, gm, fake_mode, node), (node.args, node.kwargs)
        )
    if _dtypes(_run_plain(node, fake_mode)) == wanted:
        return True
    node.args, node.kwargs = old_args, old_kwargs
    for cast in casts.values():
        gm.graph.erase_node(cast)
    return False


def _cast(
    a: Any, dtype: torch.dtype, casts: dict[Node, Node], gm: GraphModule, fake_mode: Any, at: Node
) -> Any:
    v = val(a)
    if not isinstance(v, torch.Tensor) or v.dtype not in _CASTABLE or v.dtype == dtype:
        return a
    if a not in casts:
        casts[a] = insert_call(gm.graph, fake_mode, aten.to.dtype, (a, dtype))
        casts[a].meta.update(source_meta(at))
    return casts[a]


def _run_plain(node: Node, fake_mode: Any) -> Any:
    """The node's op run on its inputs' fake values with autocast off (None if it fails)."""
    args, kwargs = fake_values((node.args, node.kwargs))
    try:
        with fake_mode, _autocast_off():
            return node.target(*args, **kwargs)
    except Exception:
        return None


_DEVICES = ("cpu", "cuda")


def ambient() -> bool:
    """Whether autocast is on outside the compiled code, for any device."""
    return any(torch.is_autocast_enabled(device) for device in _DEVICES)


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    before = [torch.is_autocast_enabled(device) for device in _DEVICES]
    for device in _DEVICES:
        torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        for device, enabled in zip(_DEVICES, before, strict=True):
            torch.set_autocast_enabled(device, enabled)


def _dtypes(value: Any) -> list[torch.dtype | None]:
    leaves, _ = tree_flatten(value)
    return [leaf.dtype if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
