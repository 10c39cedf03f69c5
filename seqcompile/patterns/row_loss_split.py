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
import math

import torch
from torch.fx import Graph, GraphModule, Node

from seqcompile.patterns.pointwise_ops import element_wise

aten = torch.ops.aten
Tensor = torch.Tensor

_VIEWS = frozenset(
    [aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.squeeze.dims,
     aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default, aten.expand.default]
)  # fmt: skip
"""Ops that give a row value another shape over the same rows (an expand only of its trailing
dimensions, checked by the sizes)."""
_REDUCTIONS = {
    aten.sum.dim_IntList: 1, aten.amax.default: 1, aten.amin.default: 1, aten.mean.dim: 1,
    aten.any.dims: 1, aten.prod.dim_int: 1, aten.any.dim: 1, aten.argmax.default: 1,
    aten.argmin.default: 1, aten.logsumexp.default: 1, aten._log_softmax.default: 1,
    aten._softmax.default: 1, aten.sum.default: None, aten.mean.default: None,
}  # fmt: skip
"""Reductions (and the row-wise normalizations) with the index of their dims argument (None:
over every element)."""
_IDENTITIES = frozenset([aten.clone.default, aten.alias.default, aten.detach.default])
_NORMALIZATIONS = frozenset([aten._log_softmax.default, aten._softmax.default])
"""Row-wise ops over a dimension that keep it."""
_MATMULS = frozenset([aten.mm.default, aten.addmm.default])
_PERMUTES = frozenset([aten.permute.default, aten.transpose.int])
_SUMS = frozenset([aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default])
_MEANS = frozenset([aten.mean.dim, aten.mean.default])
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


class NotRowWise(Exception):
    """The loss is not row-wise math plus an affine function of row sums; says which op."""


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


def _value(node: Node) -> Tensor:
    """The tensor `node` computes; NotRowWise where it computes something else (the list of a
    `split`, the tuple of a `max.dim`), which no row value is."""
    value = node.meta.get("val")
    if not isinstance(value, Tensor):
        kind = f"{len(value)} values" if isinstance(value, list | tuple) else type(value).__name__
        raise NotRowWise(
            f"{node.target} gives {kind}, not one tensor; the chunked loss reads ops of one"
            " output (a loss written over the whole logits is chunked by seqfast itself)"
        )
    return value


def _shape(node: Node) -> tuple[int, ...]:
    return tuple(_value(node).shape)


def _row_prefix(shape: tuple[int, ...], rows: int) -> int | None:
    """The fewest leading dimensions (at least one where there are any) whose sizes multiply to
    `rows`; None where none do."""
    product = 1
    for q, size in enumerate(shape):
        product *= size
        if product == rows:
            return q + 1
        if product > rows:
            return None
    return 0 if rows == 1 else None


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a row value's rows lie: `rows`, its dimensions that index the rows, in the order
    that numbers them (the logits' own order); the chunk holds the value as `(c, *others)`, the
    other dimensions in their order."""

    rank: int
    rows: tuple[int, ...]

    @property
    def others(self) -> list[int]:
        return [d for d in range(self.rank) if d not in self.rows]

    def in_chunk(self, dim: int) -> int:
        """The chunk's dimension for the value's (other) dimension `dim`."""
        return 1 + self.others.index(dim % self.rank)

    @property
    def leading(self) -> bool:
        return self.rows == tuple(range(len(self.rows)))

    def without(self, dims: list[int]) -> _Layout:
        """The layout once the (other, or size-1 row) dimensions `dims` are removed."""
        kept = [d for d in range(self.rank) if d not in dims]
        return _Layout(len(kept), tuple(kept.index(r) for r in self.rows if r not in dims))


class _Reader:
    def __init__(self, loss: GraphModule) -> None:
        self.loss = loss
        placeholders = [n for n in loss.graph.nodes if n.op == "placeholder"]
        self.logits, self.others = placeholders[0], placeholders[1:]
        shape = _shape(self.logits)
        self.num_rows = math.prod(shape[:-1])
        self.prepare, self.chunk, self.after = Graph(), Graph(), Graph()
        self.outside: dict[Node, Node] = {n: self.prepare.placeholder(n.name) for n in self.others}
        self.layout: dict[Node, _Layout] = {
            self.logits: _Layout(len(shape), tuple(range(len(shape) - 1)))
        }
        """Row values (computed from the logits, or lifted into the chunk): where their rows
        lie."""
        self.tainted: set[Node] = {self.logits}
        """The values computed from the logits."""
        self.unliftable: set[Node] = set()
        self.lifting = 0
        self.in_chunk: dict[Node, Node] = {self.logits: self.chunk.placeholder("logits")}
        self.in_post: dict[Node, Node] = {}
        self.row_inputs: dict[tuple, tuple[Node, Node]] = {}
        self.consts: dict[tuple, tuple[Node, Node]] = {}
        self.post_inputs: dict[Node, tuple[Node, Node]] = {}
        self.terms: list[Node] = []
        self.terms_input = self.after.placeholder("terms")

    # values that do not depend on the logits
    def _outside(self, node: Node) -> Node:
        """`node`, computed in `prepare`."""
        if node not in self.outside:
            self.outside[node] = self.prepare.node_copy(node, self._outside)
        return self.outside[node]

    def _prepared(self, kind: dict, key: tuple, graph: Graph, make) -> Node:
        if key not in kind:
            kind[key] = (make(), graph.placeholder(f"{key[0].name}_{len(kind)}"))
        return kind[key][1]

    def _call(self, target, *args) -> Node:
        return self.prepare.call_function(target, args)

    def _operand(self, node: Node, out: tuple[int, ...], layout: _Layout) -> Node:
        """The chunk's placeholder for `node` (not computed from the logits) as an operand of a
        row value of shape `out`: a constant where it is the same for every row, else its rows
        laid out as `(rows, ...)`."""
        shape = _shape(node)
        lead = len(out) - len(shape)
        if lead < 0:
            raise NotRowWise(f"an operand of rank {len(shape)} broadcasts the rows")
        aligned = (1,) * lead + shape
        others = [aligned[d] for d in layout.others]
        if all(aligned[r] == 1 for r in layout.rows):
            make = lambda: self._call(aten.reshape.default, self._outside(node), others)  # noqa: E731
            return self._prepared(self.consts, (node, tuple(others)), self.chunk, make)

        def make() -> Node:
            value = self._call(aten.reshape.default, self._outside(node), list(aligned))
            sizes = [out[d] if d in layout.rows else aligned[d] for d in range(len(out))]
            value = self._call(aten.expand.default, value, sizes)
            value = self._call(aten.permute.default, value, [*layout.rows, *layout.others])
            return self._call(aten.reshape.default, value, [self.num_rows, *others])

        key = (node, tuple(aligned), layout, tuple(out[r] for r in layout.rows))
        return self._prepared(self.row_inputs, key, self.chunk, make)

    def _lift(self, node: Node) -> bool:
        """Compute `node`, which the logits do not make, in the chunk instead, where it is row math
        on values sliced with the rows (a teacher's log-probabilities, the targets' mask): so
        nothing the size of the logits is made whole. Undone where it is not."""
        if node in self.layout:
            return True
        if node in self.unliftable or node.op not in ("placeholder", "call_function"):
            return False
        before = (
            len(self.chunk.nodes), set(self.layout), set(self.in_chunk), dict(self.row_inputs),
            dict(self.consts),
        )  # fmt: skip
        self.lifting += 1
        try:
            if node.op == "placeholder":
                self._sliced(node)
            else:
                for a in node.all_input_nodes:
                    self._lift(a)
                self._row(node)
            return True
        except NotRowWise:
            self._undo(*before)
            self.unliftable.add(node)
            return False
        finally:
            self.lifting -= 1

    def _sliced(self, node: Node) -> None:
        """A placeholder with the logits' rows leading: a row input, sliced with the chunks."""
        shape = _shape(node)
        rows = _row_prefix(shape, self.num_rows)
        if not rows:
            raise NotRowWise("not laid out by the logits' rows")
        rest = list(shape[rows:])
        make = lambda: self._call(aten.reshape.default, self._outside(node), [self.num_rows, *rest])  # noqa: E731
        self.in_chunk[node] = self._prepared(self.row_inputs, (node,), self.chunk, make)
        self.layout[node] = _Layout(len(shape), tuple(range(rows)))

    def _undo(self, nodes: int, layout, in_chunk, row_inputs, consts) -> None:
        for node in reversed(list(self.chunk.nodes)[nodes:]):
            self.chunk.erase_node(node)
        for mapping, kept in ((self.layout, layout), (self.in_chunk, in_chunk)):
            for key in set(mapping) - kept:
                del mapping[key]
        self.row_inputs, self.consts = row_inputs, consts

    # row values
    def _row(self, node: Node) -> None:
        out = _shape(node)
        tainted = [a for a in node.all_input_nodes if a in self.layout]
        if not tainted:
            raise NotRowWise(f"{node.target} reads no row value")
        layout = self.layout[next((a for a in tainted if a in self.tainted), tainted[0])]
        target = node.target
        if target in _IDENTITIES:
            self._emit_row(node, target, (self.in_chunk[node.args[0]],), {}, layout)
        elif target in _VIEWS:
            self._view(node, layout, out)
        elif target in _PERMUTES:
            self._permute(node, layout)
        elif target in _MATMULS:
            self._matmul(node, layout)
        elif target in _REDUCTIONS:
            self._reduction(node, layout)
        elif target is aten.copy.default:  # functionalized copy_: src in dst's dtype and shape
            self._copy(node, layout, out)
        elif target is aten.gather.default or element_wise(target):
            self._element_wise(node, tainted, layout, out)
        else:
            raise NotRowWise(f"{target} on the logits is not read row by row")

    def _emit_row(self, node: Node, target, args, kwargs, layout: _Layout) -> None:
        self.in_chunk[node] = self.chunk.call_function(target, tuple(args), dict(kwargs))
        self.layout[node] = layout

    def _view(self, node: Node, layout: _Layout, out: tuple[int, ...]) -> None:
        """A reshape (squeeze, unsqueeze, expand of other dimensions): of a value whose rows lead,
        into one whose rows lead, the fewest dimensions they take; of any value, one that only
        adds or drops dimensions of size 1."""
        source = _shape(node.args[0])
        x = self.in_chunk[node.args[0]]
        if node.target is aten.expand.default:
            lead = len(out) - len(source)
            if any(out[lead + r] != source[r] for r in layout.rows):
                raise NotRowWise(f"an expand to {out} broadcasts the rows")
            new = _Layout(len(out), tuple(r + lead for r in layout.rows))
            sizes = [-1, *(out[d] for d in new.others)]
            self._emit_row(node, aten.expand.default, (x, sizes), {}, new)
            return
        q = _row_prefix(out, self.num_rows)
        if layout.leading and q is not None:
            new = _Layout(len(out), tuple(range(q)))
        elif [s for s in source if s != 1] == [s for s in out if s != 1]:
            kept = [d for d, s in enumerate(source) if s != 1]
            places = dict(zip(kept, [d for d, s in enumerate(out) if s != 1], strict=True))
            new = _Layout(len(out), tuple(places[r] for r in layout.rows if r in places))
        else:
            raise NotRowWise(f"{node.target} of shape {out} mixes the rows with other dimensions")
        sizes = [-1, *(out[d] for d in new.others)]
        self._emit_row(node, aten.reshape.default, (x, sizes), {}, new)

    def _matmul(self, node: Node, layout: _Layout) -> None:
        """Rows times a matrix the same for every row (a teacher's head): `mm(rows, w)`, or
        `addmm(bias, rows, w)` with a bias of the columns."""
        *bias, rows, matrix = node.args[:3] if node.target is aten.addmm.default else node.args[:2]
        whole = [*bias, matrix]
        if rows not in self.layout or layout.rows != (0,) or any(a in self.layout for a in whole):
            raise NotRowWise(f"{node.target} of a value that is not (rows, features)")
        if bias and len(_shape(bias[0])) > 1 and _shape(bias[0])[0] != 1:
            raise NotRowWise(f"{node.target} with a bias that varies over the rows")
        args = [self._whole(a) for a in bias] + [self.in_chunk[rows], self._whole(matrix)]
        self._emit_row(node, node.target, args, {}, layout)

    def _whole(self, node: Node) -> Node:
        """The chunk's placeholder for `node`, the same for every row, read whole."""
        make = lambda: self._outside(node)  # noqa: E731
        return self._prepared(self.consts, (node, "whole"), self.chunk, make)

    def _permute(self, node: Node, layout: _Layout) -> None:
        rank = layout.rank
        if node.target is aten.transpose.int:
            order = list(range(rank))
            a, b = (d % rank for d in node.args[1:3])
            order[a], order[b] = b, a
        else:
            order = [d % rank for d in node.args[1]]
        new = _Layout(rank, tuple(order.index(r) for r in layout.rows))
        chunk_order = [0, *(layout.in_chunk(order[d]) for d in new.others)]
        x = self.in_chunk[node.args[0]]
        self._emit_row(node, aten.permute.default, (x, chunk_order), {}, new)

    def _reduction(self, node: Node, layout: _Layout) -> None:
        x = node.args[0]
        rank = layout.rank
        at = _REDUCTIONS[node.target]
        given = node.args[at] if at is not None and len(node.args) > at else None
        dims = [given] if isinstance(given, int) else given
        dims = sorted({d % rank for d in dims}) if dims else list(range(rank))
        if not set(dims) & set(layout.rows):
            chunk_dims = [layout.in_chunk(d) for d in dims]
            args = [self.in_chunk[x], chunk_dims[0] if isinstance(given, int) else chunk_dims]
            keep = node.target in _NORMALIZATIONS or (len(node.args) > at + 1 and node.args[at + 1])
            keep = keep or node.kwargs.get("keepdim", False)
            new = layout if keep else layout.without(dims)
            self._emit_row(node, node.target, [*args, *node.args[at + 1 :]], node.kwargs, new)
            return
        if node.target in _SUMS and _value(node).numel() == 1:
            self._term(node)
            return
        raise NotRowWise(f"{node.target} over the rows (dims {dims}) is not a sum of every row")

    def _element_wise(self, node: Node, tainted: list[Node], layout: _Layout, out) -> None:
        for a in tainted:
            if a in self.tainted and self.layout[a] != layout:
                raise NotRowWise(f"{node.target} broadcasts one row value against another")
        if any(out[r] != _shape(tainted[0])[r] for r in layout.rows) or len(out) != layout.rank:
            raise NotRowWise(f"{node.target} broadcasts the rows")
        if node.target is aten.gather.default and node.args[1] % len(out) in layout.rows:
            raise NotRowWise("a gather along the rows")

        def operand(a):
            if not isinstance(a, Node):
                return a
            if a in self.tainted or (self._lift(a) and self.layout[a] == layout):
                return self.in_chunk[a]
            return self._operand(a, out, layout)

        args = [operand(a) for a in node.args]
        if node.target is aten.gather.default:
            args[1] = layout.in_chunk(node.args[1])
        kwargs = {k: operand(v) for k, v in node.kwargs.items()}
        self._emit_row(node, node.target, args, kwargs, layout)

    def _copy(self, node: Node, layout: _Layout, out) -> None:
        dst, src = node.args[:2]
        if _shape(src) != out or self.layout.get(src) != layout:
            raise NotRowWise(f"a copy into a {out} tensor of a value of another shape")
        dtype = _value(node).dtype
        self._emit_row(node, aten._to_copy.default, (self.in_chunk[src],), {"dtype": dtype}, layout)

    def _term(self, node: Node) -> None:
        """A sum (or mean) of a row value over every element: the chunk's sum in float32, and in
        `post` the whole sum, as the loss's dtype and shape."""
        if self.lifting:
            raise NotRowWise("a sum over the rows of a value the logits do not make")
        x = node.args[0]
        self.terms.append(
            self.chunk.call_function(
                aten.sum.dim_IntList, (self.in_chunk[x], []), {"dtype": torch.float32}
            )
        )
        value = self.after.call_function(
            aten.select.int, (self.terms_input, 0, len(self.terms) - 1)
        )
        if node.target in _MEANS:
            value = self.after.call_function(aten.div.Tensor, (value, _value(x).numel()))
        value = self.after.call_function(
            aten._to_copy.default, (value,), {"dtype": _value(node).dtype}
        )
        self.in_post[node] = self.after.call_function(
            aten.reshape.default, (value, list(_shape(node)))
        )

    # post values
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
        if loss not in self.in_post or _value(loss).numel() != 1:
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
