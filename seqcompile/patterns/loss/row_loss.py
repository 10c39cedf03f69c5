"""The loss family's chunked linear + row-wise loss: when the logits of a linear reach a scalar loss
only through math on each of their rows and sums over the rows (cross-entropy with a z-loss,
soft-capped or masked logits, KL or JSD against a teacher's logits, class weights, a per-token
loss summed by hand), the linear and the loss become `seqfast::linear_row_loss`, and the logits are
never built whole.

The site is anchored at the linear. Its *region* (`region.py`) is every node computed from its
output; it must end in one scalar, the loss, that nothing else in the region reads. The region is
traced to core ATen and read by `row_split.py`, whose refusal names the op that stops it; the
loss's joint (chunk terms and their gradient) is traced from what it reads
(`ops/linear_row_loss/program.py`). Where the region holds a plain cross-entropy of the logits
(scaled after it or not, as with the Trainer's `num_items_in_batch`),
`seqfast::linear_cross_entropy` (with its kernel) takes it.
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
    concrete,
    erase_unused,
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
from seqcompile.patterns.engine import FuseContext, Reject, Rewrite
from seqcompile.patterns.loss.linear import Linear, joins_linear, linear_at, only_autocast_between
from seqcompile.patterns.loss.pattern import FAMILY
from seqcompile.patterns.loss.read import eager_raises
from seqcompile.patterns.loss.region import Gradients, outside_values, pulled, region_to_loss
from seqcompile.patterns.loss.row_ops import NotRowWise
from seqcompile.patterns.loss.row_split import Split, split

aten = torch.ops.aten


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
    linear: Linear,
    nodes: list[Node],
    externals: list[Node],
    loss: Node,
    gradients: Gradients,
) -> str | None:
    """Why the region cannot be chunked before it is read (None: it may be)."""
    raising = next(filter(None, map(eager_raises, nodes)), None)
    if raising is not None:
        return raising
    if not only_autocast_between(linear.node, loss):
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
    family = FAMILY

    def find(self, node: Node, ctx: FuseContext) -> Rewrite | Reject | None:
        linear = linear_at(node)
        found = region_to_loss(node) if linear is not None else None
        if found is None:
            return None
        nodes, loss = found
        if any(joins_linear(n) for n in nodes):
            return None  # linear_cross_entropy's, with its kernel (scaled after it or not)
        gradients = Gradients(ctx)
        nodes = pulled(nodes, node, gradients)
        externals = outside_values(nodes, node)
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
