"""The row values of a loss read a chunk of rows at a time (`row_split.py`): the chunk graph
(`Split.rows`), which computes one chunk's terms from its logits, and in `prepare` what it reads
that does not vary with the chunk (constants, and the other values laid out as `(rows, ...)` to
be sliced). Values the logits do not make are lifted into the chunk where they are row math on
sliced values (a teacher's log-probabilities), so nothing the size of the logits is made whole.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Graph, GraphModule, Node

from seqcompile.patterns.loss.row_ops import (
    IDENTITIES,
    MATMULS,
    MEANS,
    NORMALIZATIONS,
    PERMUTES,
    REDUCTIONS,
    SUMS,
    VIEWS,
    Layout,
    NotRowWise,
    row_prefix,
    shape_of,
    value_of,
)
from seqcompile.patterns.pointwise_ops import element_wise

aten = torch.ops.aten


class RowValues:
    """Reads the row values and terms of `loss` into `chunk` (with what they read into `prepare`,
    and each term's whole sum into `after`, the post graph), node by node through `_row`."""

    def __init__(self, loss: GraphModule) -> None:
        self.loss = loss
        placeholders = [n for n in loss.graph.nodes if n.op == "placeholder"]
        self.logits, self.others = placeholders[0], placeholders[1:]
        shape = shape_of(self.logits)
        self.num_rows = math.prod(shape[:-1])
        self.prepare, self.chunk, self.after = Graph(), Graph(), Graph()
        self.outside: dict[Node, Node] = {n: self.prepare.placeholder(n.name) for n in self.others}
        self.layout: dict[Node, Layout] = {
            self.logits: Layout(len(shape), tuple(range(len(shape) - 1)))
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

    def _operand(self, node: Node, out: tuple[int, ...], layout: Layout) -> Node:
        """The chunk's placeholder for `node` (not computed from the logits) as an operand of a
        row value of shape `out`: a constant where it is the same for every row, else its rows
        laid out as `(rows, ...)`."""
        shape = shape_of(node)
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
        shape = shape_of(node)
        rows = row_prefix(shape, self.num_rows)
        if not rows:
            raise NotRowWise("not laid out by the logits' rows")
        rest = list(shape[rows:])
        make = lambda: self._call(aten.reshape.default, self._outside(node), [self.num_rows, *rest])  # noqa: E731
        self.in_chunk[node] = self._prepared(self.row_inputs, (node,), self.chunk, make)
        self.layout[node] = Layout(len(shape), tuple(range(rows)))

    def _undo(self, nodes: int, layout, in_chunk, row_inputs, consts) -> None:
        for node in reversed(list(self.chunk.nodes)[nodes:]):
            self.chunk.erase_node(node)
        for mapping, kept in ((self.layout, layout), (self.in_chunk, in_chunk)):
            for key in set(mapping) - kept:
                del mapping[key]
        self.row_inputs, self.consts = row_inputs, consts

    # row values
    def _row(self, node: Node) -> None:
        out = shape_of(node)
        tainted = [a for a in node.all_input_nodes if a in self.layout]
        if not tainted:
            raise NotRowWise(f"{node.target} reads no row value")
        layout = self.layout[next((a for a in tainted if a in self.tainted), tainted[0])]
        target = node.target
        if target in IDENTITIES:
            self._emit_row(node, target, (self.in_chunk[node.args[0]],), {}, layout)
        elif target in VIEWS:
            self._view(node, layout, out)
        elif target in PERMUTES:
            self._permute(node, layout)
        elif target in MATMULS:
            self._matmul(node, layout)
        elif target in REDUCTIONS:
            self._reduction(node, layout)
        elif target is aten.copy.default:  # functionalized copy_: src in dst's dtype and shape
            self._copy(node, layout, out)
        elif target is aten.gather.default or element_wise(target):
            self._element_wise(node, tainted, layout, out)
        else:
            raise NotRowWise(f"{target} on the logits is not read row by row")

    def _emit_row(self, node: Node, target, args, kwargs, layout: Layout) -> None:
        self.in_chunk[node] = self.chunk.call_function(target, tuple(args), dict(kwargs))
        self.layout[node] = layout

    def _view(self, node: Node, layout: Layout, out: tuple[int, ...]) -> None:
        """A reshape (squeeze, unsqueeze, expand of other dimensions): of a value whose rows lead,
        into one whose rows lead, the fewest dimensions they take; of any value, one that only
        adds or drops dimensions of size 1."""
        source = shape_of(node.args[0])
        x = self.in_chunk[node.args[0]]
        if node.target is aten.expand.default:
            lead = len(out) - len(source)
            if any(out[lead + r] != source[r] for r in layout.rows):
                raise NotRowWise(f"an expand to {out} broadcasts the rows")
            new = Layout(len(out), tuple(r + lead for r in layout.rows))
            sizes = [-1, *(out[d] for d in new.others)]
            self._emit_row(node, aten.expand.default, (x, sizes), {}, new)
            return
        q = row_prefix(out, self.num_rows)
        if layout.leading and q is not None:
            new = Layout(len(out), tuple(range(q)))
        elif [s for s in source if s != 1] == [s for s in out if s != 1]:
            kept = [d for d, s in enumerate(source) if s != 1]
            places = dict(zip(kept, [d for d, s in enumerate(out) if s != 1], strict=True))
            new = Layout(len(out), tuple(places[r] for r in layout.rows if r in places))
        else:
            raise NotRowWise(f"{node.target} of shape {out} mixes the rows with other dimensions")
        sizes = [-1, *(out[d] for d in new.others)]
        self._emit_row(node, aten.reshape.default, (x, sizes), {}, new)

    def _matmul(self, node: Node, layout: Layout) -> None:
        """Rows times a matrix the same for every row (a teacher's head): `mm(rows, w)`, or
        `addmm(bias, rows, w)` with a bias of the columns."""
        *bias, rows, matrix = node.args[:3] if node.target is aten.addmm.default else node.args[:2]
        whole = [*bias, matrix]
        if rows not in self.layout or layout.rows != (0,) or any(a in self.layout for a in whole):
            raise NotRowWise(f"{node.target} of a value that is not (rows, features)")
        if bias and len(shape_of(bias[0])) > 1 and shape_of(bias[0])[0] != 1:
            raise NotRowWise(f"{node.target} with a bias that varies over the rows")
        args = [self._whole(a) for a in bias] + [self.in_chunk[rows], self._whole(matrix)]
        self._emit_row(node, node.target, args, {}, layout)

    def _whole(self, node: Node) -> Node:
        """The chunk's placeholder for `node`, the same for every row, read whole."""
        make = lambda: self._outside(node)  # noqa: E731
        return self._prepared(self.consts, (node, "whole"), self.chunk, make)

    def _permute(self, node: Node, layout: Layout) -> None:
        rank = layout.rank
        if node.target is aten.transpose.int:
            order = list(range(rank))
            a, b = (d % rank for d in node.args[1:3])
            order[a], order[b] = b, a
        else:
            order = [d % rank for d in node.args[1]]
        new = Layout(rank, tuple(order.index(r) for r in layout.rows))
        chunk_order = [0, *(layout.in_chunk(order[d]) for d in new.others)]
        x = self.in_chunk[node.args[0]]
        self._emit_row(node, aten.permute.default, (x, chunk_order), {}, new)

    def _reduction(self, node: Node, layout: Layout) -> None:
        x = node.args[0]
        rank = layout.rank
        at = REDUCTIONS[node.target]
        given = node.args[at] if at is not None and len(node.args) > at else None
        dims = [given] if isinstance(given, int) else given
        dims = sorted({d % rank for d in dims}) if dims else list(range(rank))
        if not set(dims) & set(layout.rows):
            chunk_dims = [layout.in_chunk(d) for d in dims]
            args = [self.in_chunk[x], chunk_dims[0] if isinstance(given, int) else chunk_dims]
            keep = node.target in NORMALIZATIONS or (len(node.args) > at + 1 and node.args[at + 1])
            keep = keep or node.kwargs.get("keepdim", False)
            new = layout if keep else layout.without(dims)
            self._emit_row(node, node.target, [*args, *node.args[at + 1 :]], node.kwargs, new)
            return
        if node.target in SUMS and value_of(node).numel() == 1:
            self._term(node)
            return
        raise NotRowWise(f"{node.target} over the rows (dims {dims}) is not a sum of every row")

    def _element_wise(self, node: Node, tainted: list[Node], layout: Layout, out) -> None:
        for a in tainted:
            if a in self.tainted and self.layout[a] != layout:
                raise NotRowWise(f"{node.target} broadcasts one row value against another")
        if any(out[r] != shape_of(tainted[0])[r] for r in layout.rows) or len(out) != layout.rank:
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

    def _copy(self, node: Node, layout: Layout, out) -> None:
        dst, src = node.args[:2]
        if shape_of(src) != out or self.layout.get(src) != layout:
            raise NotRowWise(f"a copy into a {out} tensor of a value of another shape")
        dtype = value_of(node).dtype
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
        if node.target in MEANS:
            value = self.after.call_function(aten.div.Tensor, (value, value_of(x).numel()))
        value = self.after.call_function(
            aten._to_copy.default, (value,), {"dtype": value_of(node).dtype}
        )
        self.in_post[node] = self.after.call_function(
            aten.reshape.default, (value, list(shape_of(node)))
        )
