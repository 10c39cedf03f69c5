"""Reads a loss over logits as math on each row of the logits plus a linear function of sums over
the rows, so the logits can be made, and differentiated, a chunk of rows at a time.

The reading takes the loss traced to core ATen: placeholders the logits `(*rows, *rest)`, then
the other values the loss reads (targets, a teacher's logits, a mask, a count); one output, the
loss. Each value computed from the logits is
- a *row value*: leading dimensions whose sizes multiply to the number of rows, each row computed
  from the same row of its operands only (element-wise ops, reductions and `gather` over the
  trailing dimensions, reshapes that keep the rows in order); or
- a *term*: the sum or mean of a row value over every element; or
- a *post value*: computed from terms by ops that are affine in them (sums, products and quotients
  with values that do not depend on the logits, casts, reshapes).

Values that do not depend on the logits are computed once, outside the chunks; those that vary
over the rows are laid out as `(rows, ...)` and sliced with them. Anything else (a max over the
rows, a product of two terms, a reshape that mixes rows with classes) is refused with its op.
The result is three graphs: `prepare` (the outside values), `rows` (one chunk's terms) and
`post` (the loss from the terms).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch.fx import Graph, GraphModule, Node

from seqcompile.patterns.loss.row_ops import NotRowWise, value_of
from seqcompile.patterns.loss.row_values import RowValues

aten = torch.ops.aten

_AFFINE = frozenset(
    [aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten._to_copy.default, aten.clone.default,
     aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dims,
     aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default, aten.sum.default,
     aten.sum.dim_IntList, aten.mean.default, aten.mean.dim, aten.cat.default, aten.stack.default,
     aten.select.int, aten.alias.default, aten.expand.default, aten.detach.default,
     aten.mul.Scalar, aten.div.Scalar, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar]
)  # fmt: skip
"""Ops whose result is affine in each operand (and in all of them together; the `.Scalar`
overloads' other operand is a number)."""


@dataclasses.dataclass
class Split:
    prepare: GraphModule
    """(*other values) -> (*row inputs `(rows, ...)`, *constants, *post inputs)."""
    rows: GraphModule
    """(logits chunk `(c, *rest)`, *row inputs' chunks, *constants) -> the chunk's terms `(K,)`,
    float32."""
    post: GraphModule
    """(terms `(K,)` float32, *post inputs) -> the loss."""
    num_terms: int
    num_rows: int
    num_consts: int


class _Reader(RowValues):
    """The row values and terms, then the post values computed from the terms."""

    def __init__(self, loss: GraphModule) -> None:
        super().__init__(loss)
        self.post_inputs: dict[Node, tuple[Node, Node]] = {}

    def _post(self, node: Node) -> None:
        target, args = node.target, node.args
        linear = target in _AFFINE and (target is not aten.select.int or args[0] in self.in_post)
        if target is aten.mul.Tensor:  # by operand, not by node: x * x reads one node twice
            linear = sum(a in self.in_post for a in args[:2] if isinstance(a, Node)) == 1
        elif target is aten.div.Tensor:
            linear = args[0] in self.in_post and args[1] not in self.in_post
        elif target is aten.where.self:
            linear = args[0] not in self.in_post
        if not linear:
            raise NotRowWise(f"{target} of a sum over the rows is not linear in it")

        def operand(a):
            if not isinstance(a, Node):
                return a
            if a in self.in_post:
                return self.in_post[a]
            if a not in self.post_inputs:
                self.post_inputs[a] = (self._outside(a), self.after.placeholder(a.name))
            return self.post_inputs[a][1]

        mapped = torch.fx.node.map_arg(node.args, operand)
        kwargs = torch.fx.node.map_arg(node.kwargs, operand)
        self.in_post[node] = self.after.call_function(target, mapped, kwargs)

    def read(self) -> Split:
        for node in self.loss.graph.nodes:
            if node.op == "output":
                self._finish(node.args[0])
                continue
            if node.op != "call_function":
                continue
            inputs = node.all_input_nodes
            if any(a in self.in_post for a in inputs):
                if any(a in self.tainted for a in inputs):
                    raise NotRowWise(f"{node.target} mixes a sum over the rows with a row value")
                self._post(node)
            elif any(a in self.tainted for a in inputs):
                self._row(node)
                if node not in self.in_post:
                    self.tainted.add(node)
        return self._split()

    def _finish(self, loss) -> None:
        if isinstance(loss, list | tuple):
            loss = loss[0] if len(loss) == 1 else None
        if loss not in self.in_post or value_of(loss).numel() != 1:
            raise NotRowWise("the loss is not a single sum over the rows")
        self.after.output(self.in_post[loss])
        if not self.terms:
            raise NotRowWise("no sum over the rows")
        self.chunk.output(self.chunk.call_function(aten.stack.default, (self.terms,)))

    def _split(self) -> Split:
        rows, consts, post = (
            list(k.values()) for k in (self.row_inputs, self.consts, self.post_inputs)
        )
        self.prepare.output(tuple(outside for outside, _ in (*rows, *consts, *post)))
        _placeholders_first(
            self.chunk, [self.in_chunk[self.logits], *(p for _, p in (*rows, *consts))]
        )
        _placeholders_first(self.after, [self.terms_input, *(p for _, p in post)])
        modules = []
        for graph in (self.prepare, self.chunk, self.after):
            graph.eliminate_dead_code()
            modules.append(GraphModule(torch.nn.Module(), graph))
        return Split(*modules, len(self.terms), len(rows), len(consts))


def _placeholders_first(graph: Graph, order: list[Node]) -> None:
    """Move the placeholders in `order` to the front of `graph`, in that order."""
    first = next(iter(graph.nodes))
    if first is not order[0]:
        first.prepend(order[0])
    for before, placeholder in itertools.pairwise(order):
        before.append(placeholder)


def split(loss: GraphModule) -> Split:
    """`loss` (core ATen: the logits, then other values; one output) read as rows and terms;
    NotRowWise says where it is not."""
    return _Reader(loss).read()
