"""The loss family's chunked linear + row-wise loss: when the logits of a linear reach a scalar loss
only through math on each of their rows and sums over the rows (cross-entropy with a z-loss,
soft-capped or masked logits, KL or JSD against a teacher's logits, class weights, a per-token
loss summed by hand), the linear and the loss become `seqfast::linear_row_loss`, and the logits are
never built whole.

The site is anchored at the linear. Its *region* is every node computed from its output; it must
end in one scalar, the loss, that nothing else in the region reads. The region is traced to core
ATen and read by `row_loss_split`, whose refusal names the op that stops it; the loss's joint
(chunk terms and their gradient) is traced from what it reads (`ops/linear_row_loss/program.py`).
Where the region holds a plain cross-entropy of the logits (scaled after it or not, as with the
Trainer's `num_items_in_batch`), `seqfast::linear_cross_entropy` (with its kernel) takes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch._decomp import core_aten_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functionalize
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_arg

from seqcompile.fx.nodes import (
    RESHAPES,
    concrete,
    erase_unused,
    grad_enabled_at,
    has_symbols,
    in_own_thread,
    insert_getitem,
    is_call,
    is_dtensor,
    tensor_val,
    val,
)
from seqcompile.ops.linear_row_loss import op as linear_row_loss
from seqcompile.ops.linear_row_loss import program as row_loss
from seqcompile.patterns import loss as loss_family
from seqcompile.patterns.engine import FuseContext, Reject, Rewrite
from seqcompile.patterns.pointwise_ops import element_wise
from seqcompile.patterns.row_loss_split import NotRowWise, Split, split

aten = torch.ops.aten
_MAX_REGION = 256
"""Nodes past which a linear's region is taken for the rest of a model, not a loss."""
PULLABLE = frozenset(
    [*RESHAPES, aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
     aten._log_softmax.default, aten.transpose.int, aten.permute.default, aten.t.default,
     aten.to.dtype, aten._to_copy.default, aten.detach.default, aten.clone.default]
)  # fmt: skip
"""Ops (beyond element-wise ones) pulled into the region with the values the loss reads."""
_NOT_LOSS = frozenset(
    [aten.mm.default, aten.bmm.default, aten.addmm.default, aten.linear.default,
     aten.matmul.default, aten.baddbmm.default, aten.convolution.default,
     aten.scaled_dot_product_attention.default, aten.embedding.default]
)  # fmt: skip
"""Ops that mark a linear's region as more of the model (a loss reads its logits row by row)."""


def region_to_loss(start: Node) -> tuple[list[Node], Node] | None:
    """Every node computed from `start`, in graph order, and the one the graph returns (the loss);
    None where they are not a loss over `start` (too many, a matmul, not one scalar out)."""
    region, frontier = {start}, [start]
    while frontier:
        for user in frontier.pop().users:
            if user in region or user.op == "output":
                continue
            if user.op != "call_function" or is_call(user, *_NOT_LOSS):
                return None
            if len(region) >= _MAX_REGION:
                return None
            region.add(user)
            frontier.append(user)
    sinks = [n for n in region if any(u.op == "output" for u in n.users)]
    if len(sinks) != 1 or sinks[0] is start:
        return None
    out = tensor_val(sinks[0])
    if out is None or not out.is_floating_point() or out.numel() != 1:
        return None
    nodes = [n for n in start.graph.nodes if n in region and n is not start]
    return nodes, sinks[0]


def _pulled(nodes: list[Node], start: Node, gradients: _Gradients) -> list[Node]:
    """`nodes` with what computes the values they read only for them, up to a linear, and
    carries no gradient: row math on a teacher's logits, and the teacher's head itself, then
    run a chunk at a time too (or, where not row-wise, before the op, as it ran before)."""
    region = {start, *nodes}
    frontier = _externals(nodes, start)
    while frontier:
        node = frontier.pop()
        if node in region or node.op != "call_function" or node.is_impure():
            continue
        if gradients.carries[node]:
            continue
        if not all(u in region for u in node.users):
            continue
        linear = loss_family.linear_at(node) is not None
        if not (linear or is_call(node, *PULLABLE) or element_wise(node.target)):
            continue
        region.add(node)
        if not linear:
            frontier.extend(node.all_input_nodes)
        elif is_call(node, aten.matmul.default):
            region.add(node.args[1])  # (the transpose of the weight)
    return [n for n in start.graph.nodes if n in region and n is not start]


def _externals(nodes: list[Node], start: Node) -> list[Node]:
    """The values the region reads that it does not compute, in order of first reading."""
    inside = {start, *nodes}
    return list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))


def _region_module(
    start: Node, nodes: list[Node], externals: list[Node], loss: Node
) -> GraphModule:
    """The region as its own graph: placeholders the logits, then `externals`; output the loss."""
    graph = Graph()
    env = {start: graph.placeholder("logits")}
    env.update({e: graph.placeholder(e.name) for e in externals})
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[loss])
    return GraphModule(torch.nn.Module(), graph)


def _traced(module: GraphModule, inputs: list[torch.Tensor]) -> GraphModule:
    """The region traced to core ATen on fake values of `inputs`' sizes."""

    def trace() -> GraphModule:
        with FakeTensorMode():
            examples = [
                torch.empty_strided(
                    [concrete(s) for s in t.shape], [concrete(s) for s in t.stride()],
                    dtype=t.dtype, device=t.device,
                )
                for t in inputs
            ]  # fmt: skip
            return _core_aten(module, examples)

    try:
        return in_own_thread(trace)
    except Exception as error:  # an op fake tensors or the decompositions cannot trace
        raise row_loss.UntraceableLoss(f"tracing the loss failed: {error}") from error


_read: dict[str, tuple[Split, row_loss.RowLoss] | str] = {}
"""Each region read so far (by its code and its inputs' sizes, dtypes and devices): its reading
and program, or why it has none. A graph compiled again (another path, a recompile) reads its
loss once."""


def _reading(
    start: Node, nodes: list[Node], externals: list[Node], loss: Node, ctx: FuseContext
) -> tuple[Split, row_loss.RowLoss] | str:
    module = _region_module(start, nodes, externals, loss)
    inputs = [tensor_val(n) for n in (start, *externals)]
    key = module.code + repr([(t.shape, t.stride(), t.dtype, t.device) for t in inputs])
    if key not in _read:
        try:
            parts = split(_traced(module, inputs))
            with ctx.fake_mode:
                values = parts.prepare(*(val(e) for e in externals))
            _read[key] = (parts, program_of(parts, tensor_val(start), values))
        except (NotRowWise, row_loss.UntraceableLoss) as why_not:
            _read[key] = str(why_not)
    return _read[key]


def _core_aten(fn: Callable, examples: Sequence[torch.Tensor]) -> GraphModule:
    """`fn` traced at `examples` into core ATen without mutations (a decomposition may write in
    place)."""
    traced = make_fx(fn, decomposition_table=core_aten_decompositions())(*examples)
    functional = functionalize(traced, remove="mutations")
    return make_fx(functional, decomposition_table=core_aten_decompositions())(*examples)


def _why_not(
    linear: loss_family.Linear,
    nodes: list[Node],
    externals: list[Node],
    loss: Node,
    gradients: _Gradients,
) -> str | None:
    """Why the region cannot be chunked before it is read (None: it may be)."""
    raising = next(filter(None, map(loss_family.eager_raises, nodes)), None)
    if raising is not None:
        return raising
    if not loss_family.only_autocast_between(linear.node, loss):
        return "grad mode or an in-place op changes between the linear and the loss"
    if any(tensor_val(e) is None for e in externals):
        names = ", ".join(e.name for e in externals if tensor_val(e) is None)
        return f"the loss reads values that are not tensors ({names})"
    if any(is_dtensor(tensor_val(n)) for n in (linear.node, *nodes, *externals)):
        return "the logits or what the loss reads are DTensors; its program reads local rows"
    if has_symbols([val(n) for n in (linear.node, *externals)]):
        return "the logits or what the loss reads have dynamic shapes"
    needing = [e.name for e in gradients.needed(nodes, externals)]
    if needing:
        return (
            f"the loss reads {', '.join(needing)}, which needs a gradient the chunked loss does"
            " not compute"
        )
    return None


class _Gradients:
    """Which values of a graph carry a gradient: computed from inputs that require grad, with
    grad mode on and no `detach` on the way (a teacher's head under no_grad, or over detached
    values, carries none). One pass over the graph, in order."""

    def __init__(self, ctx: FuseContext) -> None:
        self.modes: dict[Node, bool] = {}
        self.carries: dict[Node, bool] = {}
        mode = None
        for node in ctx.gm.graph.nodes:
            mode = grad_enabled_at(node) if mode is None else mode
            if is_call(node, torch._C._set_grad_enabled):
                mode = bool(node.args[0])
            self.modes[node] = mode
            if node.op == "placeholder":
                self.carries[node] = ctx.training and node in ctx.grad_inputs
            else:
                self.carries[node] = (
                    mode
                    and not is_call(node, aten.detach.default)
                    and any(self.carries.get(a, False) for a in node.all_input_nodes)
                )

    def needed(self, nodes: list[Node], externals: list[Node]) -> list[Node]:
        """The values the region reads that need a gradient through it: they carry one, and a
        region node reads them with grad mode on."""
        inside = set(nodes)
        return [
            e
            for e in externals
            if self.carries[e] and any(self.modes[u] for u in e.users if u in inside)
        ]


def _inline(ctx: FuseContext, prepare: GraphModule, externals: Sequence[Node]) -> list[Node]:
    """`prepare`'s nodes, inserted into the graph at the insertion point; its outputs."""
    env: dict[Node, Node] = {}
    placeholders = iter(externals)
    outputs: list[Node] = []
    for node in prepare.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "output":
            outputs = list(map_arg(node.args[0], env.__getitem__))
        else:
            args, kwargs = map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = ctx.call(node.target, *args, **kwargs)
    return outputs


def _cut(values: Sequence, parts: Split) -> tuple[list, list, list]:
    """`prepare`'s outputs as (row inputs, constants, post inputs)."""
    rows, consts = parts.num_rows, parts.num_consts
    return list(values[:rows]), list(values[rows : rows + consts]), list(values[rows + consts :])


def program_of(
    parts: Split, logits: torch.Tensor, values: Sequence[torch.Tensor]
) -> row_loss.RowLoss:
    """Register the loss program of `parts` (`values`: examples of `prepare`'s outputs)."""
    rows, consts, post = _cut(values, parts)
    return row_loss.register(parts.rows, parts.post, parts.num_terms, logits, rows, consts, post)


def program_of_function(
    fn: Callable[..., torch.Tensor], logits: torch.Tensor, others: Sequence[torch.Tensor]
) -> tuple[row_loss.RowLoss, list, list, list]:
    """The loss program of `fn(logits, *others)` (real values), and its row inputs, constants and
    post inputs at `others`: what the samples and tests call the op with. The reading depends on
    `fn` and the sizes and dtypes alone, and is made once for them."""
    key = (fn, *((tuple(t.shape), t.dtype) for t in (logits, *others)))
    if key not in _functions_read:
        parts = split(_core_aten(fn, [logits, *others]))
        _functions_read[key] = (parts, program_of(parts, logits, list(parts.prepare(*others))))
    parts, program = _functions_read[key]
    return (program, *_cut(list(parts.prepare(*others)), parts))


_functions_read: dict[tuple, tuple[Split, row_loss.RowLoss]] = {}


def _rewrite(linear, nodes, loss, externals, parts: Split, program: row_loss.RowLoss) -> Rewrite:
    def apply(ctx: FuseContext) -> Node:
        with ctx.gm.graph.inserting_before(loss):  # after every value the loss reads
            rows, consts, post = _cut(_inline(ctx, parts.prepare, externals), parts)
            width = tensor_val(linear.hidden).shape[-1]
            hidden = ctx.call(aten.reshape.default, linear.hidden, [-1, width])
            needs = [ctx.requires_grad(n) for n in (linear.hidden, linear.weight, linear.bias)]
            fused = ctx.call_fused(
                linear_row_loss.FORWARD,
                hidden=hidden,
                weight=linear.weight,
                bias=linear.bias,
                rows=rows,
                consts=consts,
                post=post,
                program=program.key,
                chunk=ctx.options.loss_chunk,
                compute_dtype=tensor_val(linear.node).dtype,
                needs_grad=needs,
            )
            result = insert_getitem(ctx.gm.graph, fused, 0)
            out = tensor_val(loss)
            if out.dtype != torch.float32:
                result = ctx.call(aten.to.dtype, result, out.dtype)
            result = ctx.call(aten.reshape.default, result, list(out.shape))
        loss.replace_all_uses_with(result)
        replaced = [*reversed(nodes), linear.node]
        if is_call(linear.node, aten.matmul.default):
            replaced.append(linear.node.args[1])
        erase_unused(replaced)
        _erase_dead(externals)  # what fed only the loss (a teacher's softmax) is not visited
        return fused

    return apply


def _erase_dead(nodes: list[Node]) -> None:
    """Erase each of `nodes` left without readers, and what then fed nothing, upwards."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        if node.op == "call_function" and not node.users and not node.is_impure():
            stack.extend(node.all_input_nodes)
            node.graph.erase_node(node)


class RowLossPattern:
    family = loss_family.FAMILY

    def find(self, node: Node, ctx: FuseContext) -> Rewrite | Reject | None:
        linear = loss_family.linear_at(node)
        found = region_to_loss(node) if linear is not None else None
        if found is None:
            return None
        nodes, loss = found
        if any(loss_family.joins_linear(n) for n in nodes):
            return None  # linear_cross_entropy's, with its kernel (scaled after it or not)
        gradients = _Gradients(ctx)
        nodes = _pulled(nodes, node, gradients)
        externals = _externals(nodes, node)
        if not gradients.carries[node] and gradients.needed(nodes, externals):
            return None  # a teacher's head: the learning head's loss chunks it
        why = _why_not(linear, nodes, externals, loss, gradients)
        if why is not None:
            return Reject("the loss over this linear's logits is not chunked: {}", why)
        read = _reading(node, nodes, externals, loss, ctx)
        if isinstance(read, str):
            return Reject(
                "the loss over this linear's logits is not chunked, so they are built: {}", read
            )
        parts, program = read
        return _rewrite(linear, nodes, loss, externals, parts, program)
