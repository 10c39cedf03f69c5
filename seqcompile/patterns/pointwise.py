"""The pointwise region fuser, the fuse stage's last pass: every maximal connected region of
supported element-wise ops of one shape becomes one `seqfast::pointwise` call whose kernels are
generated from the region (its program made by `pointwise_cut.py`; see `ops/pointwise/`). A
linear's bias feeding a region is moved into it, so the matmul runs without its epilogue. A region
whose value is read outside it before its last op is computed ahead of that read, or split there
where it reads a value made after the read. Unsupported element-wise ops next to a region are
reported with the reason the region ends there. A pointwise user pattern's match becomes a region
of its own, named after the pattern (`match_region`, called by the pattern as the fuse stage's
engine runs it)."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.fx import Node

from seqcompile.codegen.pointwise import Unprintable
from seqcompile.fx.custom_function import apply_one
from seqcompile.fx.nodes import (
    arg,
    insert_getitem,
    is_barrier,
    node_order,
    same_shape,
    site_name,
    tensor_val,
)
from seqcompile.ops import pointwise as pointwise_op
from seqcompile.ops.fused_op import by_name
from seqcompile.ops.pointwise import kernels as pointwise_kernels
from seqcompile.ops.pointwise import region as regions
from seqcompile.patterns.engine import (
    FuseContext,
    ReadingFailed,
    Reject,
    Rewrite,
    dtensor_refusal,
    read_site,
    rewritten,
)
from seqcompile.patterns.pointwise_cut import FOLDED_BIAS, Cut
from seqcompile.patterns.pointwise_ops import element_wise, refusal
from seqcompile.report import Missed

aten = torch.ops.aten
FAMILY = pointwise_op.ENTRY.family
_CASTS = (aten.to.dtype, aten._to_copy.default, aten.clone.default)
_FUNCTION = "custom autograd.Function"


@dataclasses.dataclass
class _Region:
    nodes: list[Node]
    mask: int
    """Bits of the region ids merged into this region."""


class _Regions:
    """Greedy grouping in graph order. A node joins the regions of its same-shape producers unless
    that would close a cycle through a node outside (an input that depends on one of them)."""

    def __init__(self) -> None:
        self.of: dict[Node, _Region] = {}
        self.reach: dict[Node, int] = {}
        """Bits of every region a node depends on, through any path."""
        self.epoch: dict[Node, int] = {}
        """How many barriers precede a node: regions never span one."""
        self.next_bit = 0

    def _depends(self, node: Node) -> int:
        bits = 0
        for i in node.all_input_nodes:
            bits |= self.reach.get(i, 0)
            if i in self.of:
                bits |= self.of[i].mask
        return bits

    def add(self, node: Node, epoch: int, eligible: bool) -> None:
        self.epoch[node] = epoch
        if eligible:
            self._place(node)
        self.reach[node] = self._depends(node)

    def _place(self, node: Node) -> None:
        shape = tensor_val(node)
        candidates: list[_Region] = []
        for i in node.all_input_nodes:
            region = self.of.get(i)
            if (
                region is not None
                and region not in candidates
                and self.epoch[i] == self.epoch[node]
                and same_shape(tensor_val(i), shape)
            ):
                candidates.append(region)
        for chosen in (candidates, *([c] for c in candidates)):
            if chosen and self._can_merge(node, chosen):
                target = chosen[0]
                for other in chosen[1:]:
                    target.nodes += other.nodes
                    target.mask |= other.mask
                    for n in other.nodes:
                        self.of[n] = target
                target.nodes.append(node)
                self.of[node] = target
                return
        self.of[node] = _Region([node], 1 << self.next_bit)
        self.next_bit += 1

    def _can_merge(self, node: Node, chosen: list[_Region]) -> bool:
        members = {n for r in chosen for n in r.nodes} | {node}
        mask = 0
        for r in chosen:
            mask |= r.mask
        feeding = [i for n in members for i in n.all_input_nodes if i not in members]
        return not any(self.reach.get(i, 0) & mask for i in feeding)

    def regions(self) -> list[_Region]:
        unique = {id(r): r for r in self.of.values()}
        return list(unique.values())


def _refusal(ctx: FuseContext, node: Node) -> Reject | None:
    """Why `node` cannot join a region (None: it can); where reading it raises, why it joins none
    (reported, as the site it would have been)."""
    why = read_site(ctx, FAMILY, node, refusal, node)
    if isinstance(why, ReadingFailed):
        ctx.report.missed.append(Missed(site_name(node), FAMILY, why.reason))
    return why


def _worth_fusing(nodes: list[Node]) -> bool:
    if any(n.target in (aten.dropout.default, apply_one) for n in nodes):
        return True  # (a custom Function alone is many ops in eager)
    return sum(n.target not in _CASTS for n in nodes) >= 2


def _fold_linear_biases(ctx: FuseContext, ok: dict[Node, bool]) -> None:
    """`linear(x, w, b)` whose users are all element-wise computations becomes `linear(x, w) + b`,
    so the bias add joins their region."""
    for node in list(ctx.gm.graph.nodes):
        if node.target is not aten.linear.default or arg(node, 2, "bias") is None:
            continue
        users = list(node.users)
        out = tensor_val(node)
        if users and all(
            ok.get(u) and u.target not in _CASTS and same_shape(tensor_val(u), out) for u in users
        ):
            rewritten(ctx, FAMILY, node, functools.partial(_fold_bias, node, ok))


def _fold_bias(linear: Node, ok: dict[Node, bool], ctx: FuseContext) -> Node:
    """`linear` (with a bias) as `linear(x, w) + b`, the add eligible for a region."""
    with ctx.gm.graph.inserting_after(linear):
        bare = ctx.call(aten.linear.default, linear.args[0], linear.args[1])
    with ctx.gm.graph.inserting_after(bare):
        added = ctx.call(aten.add.Tensor, bare, arg(linear, 2, "bias"))
    added.meta[FOLDED_BIAS] = True
    linear.replace_all_uses_with(added)
    ctx.gm.graph.erase_node(linear)
    ok[added] = True
    return added


def fuse_regions(ctx: FuseContext) -> None:
    """Replace every region worth fusing (two or more computing ops, or a dropout) with one
    `seqfast::pointwise` call."""
    graph = ctx.gm.graph
    refusals = {n: _refusal(ctx, n) for n in graph.nodes if n.op == "call_function"}
    ok = {n: r is None for n, r in refusals.items()}
    _fold_linear_biases(ctx, ok)
    grouping = _Regions()
    epoch = 0
    for node in graph.nodes:
        if is_barrier(node):
            epoch += 1
        grouping.add(node, epoch, ok.get(node, False))
    order = node_order(graph)
    chosen = [
        sorted(r.nodes, key=order.__getitem__) for r in grouping.regions() if _worth_fusing(r.nodes)
    ]
    borders = _borders(refusals, {n for nodes in chosen for n in nodes})
    fused: set[Node] = set()
    for region in chosen:
        parts = [p for p in _placeable_parts(region, node_order(graph)) if _worth_fusing(p)]
        if not parts and ctx.admits(FAMILY, ctx.anchor(region)):
            ctx.report.missed.append(Missed(site_name(region[-1]), FAMILY, _EARLY_USE))
        for nodes in parts:
            anchor = ctx.anchor(nodes)
            if not ctx.admits(FAMILY, anchor):
                continue
            fusion = read_site(ctx, FAMILY, nodes[-1], _fusion, ctx, nodes)
            if isinstance(fusion, Reject):
                ctx.report.missed.append(Missed(site_name(nodes[-1]), FAMILY, fusion.reason))
            elif rewritten(ctx, FAMILY, nodes[-1], fusion):
                ctx.fused(FAMILY, anchor)
                fused.update(nodes)
    for node, (reason, neighbours) in borders.items():
        if neighbours & fused:
            ctx.report.missed.append(
                Missed(site_name(node), FAMILY, f"{reason}; the region is split here")
            )
    for node in graph.find_nodes(op="call_function", target=apply_one):
        refused = refusals.get(node)
        why = refused.reason if refused is not None else "no region takes it"
        ctx.report.missed.append(
            Missed(site_name(node), _FUNCTION, f"runs as written with its own backward: {why}")
        )
    graph.lint()
    ctx.gm.recompile()


SEED_STAND_IN = torch.zeros((), dtype=torch.int64)
"""What a region's seed is to the check of its call on DTensors: a plain scalar tensor, which
DTensor takes as replicated (the seed node is made only once the region fuses)."""

_EARLY_USE = (
    "a value of the region is used before the region ends, ahead of a value the region reads;"
    " no part of the region split at that use is worth fusing"
)
USED_EARLY = "a value of the match is used before the match ends, ahead of a value it reads"
"""Why a user pattern's match has no one place for its fused call or replacement."""


def match_region(ctx: FuseContext, nodes: list[Node], name: str) -> Rewrite | Reject:
    """The rewrite that fuses a match of the pointwise user pattern `name` (`nodes`, its computing
    nodes) into a region of its own, not merged with its neighbours and named after the pattern,
    or why the match cannot be one."""
    refused = next((r for r in map(refusal, nodes) if r is not None), None)
    if refused is not None:
        return refused
    order = node_order(ctx.gm.graph)
    nodes = sorted(nodes, key=order.__getitem__)
    if len(_placeable_parts(nodes, order)) > 1:
        return Reject(USED_EARLY)
    return _fusion(ctx, nodes, name)


def _placeable_parts(nodes: list[Node], order: dict[Node, int]) -> list[list[Node]]:
    """`nodes` (a region, in graph order) as parts that one call each can compute, placed after
    every value the part reads and before every read of its values outside it: the whole region
    when all it reads exists before the first outside read of its values; else the nodes before
    that read, then the rest, parted the same way."""
    parts = []
    while True:
        cut = Cut.of(nodes)
        members = set(nodes)
        first_read = min(
            (order[u] for o in cut.outputs for u in o.users if u not in members),
            default=len(order),
        )
        if all(order[i] < first_read for i in cut.inputs):
            return [*parts, nodes]
        parts.append([n for n in nodes if order[n] < first_read])
        nodes = [n for n in nodes if order[n] > first_read]


def _borders(
    refusals: dict[Node, Reject | None], candidates: set[Node]
) -> dict[Node, tuple[str, set[Node]]]:
    """Refused element-wise ops next to a region about to be fused, with their neighbours."""
    borders = {}
    for node, refused in refusals.items():
        if refused is None or isinstance(refused, ReadingFailed) or not element_wise(node.target):
            continue  # (a reading that raised is reported already)
        neighbours = (set(node.all_input_nodes) | set(node.users)) & candidates
        if neighbours:
            borders[node] = (refused.reason, neighbours)
    return borders


def _fusion(ctx: FuseContext, nodes: list[Node], name: str | None = None) -> Rewrite | Reject:
    """The rewrite that swaps `nodes` (a part `_placeable_parts` gives; a user pattern's match
    when `name` is given) for one fused call, placed after the last of them or, where a value of
    theirs is read outside before that, just before the first such read; or why it cannot be
    done. Only the rewrite changes the graph."""
    order = node_order(ctx.gm.graph)
    cut = Cut.of(nodes, name)
    members, inputs, outputs, dropouts = set(nodes), cut.inputs, cut.outputs, cut.dropouts
    last = nodes[-1]
    readers = [u for o in outputs for u in o.users if u not in members]
    first_read = min(readers, key=order.__getitem__, default=None)
    values = [tensor_val(i) for i in inputs]
    needs_grad = [
        ctx.requires_grad(i) and v.dtype.is_floating_point
        for i, v in zip(inputs, values, strict=True)
    ]
    try:
        region = cut.register()
        # rendered now, so an op the printer lacks refuses the region rather than fail later
        pointwise_kernels.compile_time_specs(region, values, needs_grad if ctx.training else None)
    except (regions.UnsupportedRegion, Unprintable) as error:
        return Reject("{}", error)
    op, seed = pointwise_op.ENTRY.forward, SEED_STAND_IN if dropouts else None
    args = by_name(op, inputs=inputs, seed=seed, stream=0, region=region.key)
    on_dtensors = dtensor_refusal(op, args)
    if on_dtensors is not None:
        return Reject("{}", on_dtensors)

    def swap(ctx: FuseContext) -> Node:
        device = tensor_val(last).device
        seed = ctx.seed(device) if dropouts else None
        stream = ctx.next_stream() if dropouts else 0
        for _ in dropouts[1:]:
            ctx.next_stream()
        ctx.site = last
        early = first_read is not None and order[first_read] < order[last]
        graph = ctx.gm.graph
        with graph.inserting_before(first_read) if early else graph.inserting_after(last):
            call = ctx.call_fused(
                pointwise_op.ENTRY.forward,
                inputs=inputs,
                seed=seed,
                stream=stream,
                region=region.key,
            )
        with graph.inserting_after(call):
            items = [insert_getitem(graph, call, k) for k in range(len(outputs))]
        for o, item in zip(outputs, items, strict=True):
            item = ctx.in_layout_of(item, tensor_val(o))
            o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
        ctx.site = None
        for n in reversed(nodes):
            graph.erase_node(n)
        return call

    return swap
