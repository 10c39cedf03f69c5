"""The program of a chunked row-wise loss, and a process-wide registry that
`seqfast::linear_row_loss` looks programs up in by key.

A loss read as row math plus an affine function of sums over the rows (`patterns/loss/row_split.py`)
comes here as two graphs: `rows` (a chunk of logits and the chunk's rows of the other inputs ->
the chunk's sums, the *terms*) and `post` (the terms -> the loss). From them this module traces,
into plain ATen graphs:
- `joint`: a chunk's terms and the gradient, by the chunk of logits, of the terms weighted by the
  loss's gradient by each; traced with the chunk's rows symbolic, so it runs at any chunk size;
- `weights`: the loss's gradient by each term. The loss is affine in the terms, so the weights do
  not depend on them: they are known before the first chunk, and each chunk's gradient is final.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
    statically_known_true,
)

from seqcompile.fx.nodes import concrete, in_own_thread
from seqcompile.ops.index_check import check_indices

Tensor = torch.Tensor
_EXAMPLE_ROWS = 2
"""Rows of the example chunk the joint is traced on, as a symbol that no other size shares."""


class UntraceableLoss(Exception):
    """Tracing the loss's joint or weights failed; says how."""


@dataclasses.dataclass(frozen=True)
class RowLoss:
    key: str
    joint: GraphModule
    """(logits chunk, *row inputs' chunks, *constants, weights `(K,)`) -> (the gradient by the
    logits chunk, the chunk's terms `(K,)` float32)."""
    weights: GraphModule
    """(zeros `(K,)`, *post inputs) -> the loss's gradient by each term, `(K,)` float32."""
    post: GraphModule
    """(terms `(K,)` float32, *post inputs) -> the loss."""
    rows: GraphModule
    """(logits `(c, V)`, *row inputs' rows, *constants) -> the terms of those rows: the loss's
    row math as read, before any gradient is traced."""
    num_terms: int
    num_rows: int
    chunk_tensors: int
    """The most values of the joint the size of the chunk of logits that are live at once: the
    chunk-sized temporaries a chunk holds (for the memory model)."""


_registry: dict[str, RowLoss] = {}


def lookup(key: str) -> RowLoss:
    if key not in _registry:
        raise KeyError(
            f"seqfast::linear_row_loss: no loss program {key!r} in this process (programs are"
            " registered when a graph is compiled)"
        )
    return _registry[key]


def _rows_like(t: Tensor, rows: int) -> Tensor:
    """Zeros of `t`'s dtype, device and trailing sizes, `rows` rows of them: the example a trace
    makes symbolic in its rows (small, whatever `t`'s rows)."""
    return torch.zeros([rows, *(concrete(s) for s in t.shape[1:])], dtype=t.dtype, device=t.device)


def register(
    rows: GraphModule,
    post: GraphModule,
    num_terms: int,
    logits: Tensor,
    row_inputs: Sequence[Tensor],
    consts: Sequence[Tensor],
    post_inputs: Sequence[Tensor],
) -> RowLoss:
    """Trace the joint and the weights of the loss and register them; UntraceableLoss where a
    trace fails. `logits` (any rows) and the inputs (rows first for `row_inputs`) are examples of
    the dtypes, devices and sizes, fake or real."""
    num_rows = len(row_inputs)

    def joint(chunk: Tensor, *rest: Tensor):
        *inputs, weights = rest

        def weighted(z: Tensor):
            terms = rows(z, *inputs)
            return (terms * weights).sum(), terms

        return torch.func.grad(weighted, has_aux=True)(chunk)

    def weights(zeros: Tensor, *inputs: Tensor):
        return torch.func.grad(lambda terms: post(terms, *inputs).sum())(zeros)

    def traced() -> tuple[GraphModule, GraphModule]:
        mode = FakeTensorMode(shape_env=ShapeEnv())

        def example(t: Tensor, rows: int | None = None) -> Tensor:
            """A fake of `t`'s dtype, device and sizes, its rows (where given) symbolic. Whole
            values are made fake, never allocated (a teacher's weight may be large)."""
            if rows is None:
                with mode:
                    shape = [concrete(s) for s in t.shape]
                    return torch.empty(shape, dtype=t.dtype, device=t.device)
            dims = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (t.dim() - 1)
            context = StatelessSymbolicContext(dynamic_sizes=dims)
            return mode.from_tensor(_rows_like(t, rows), symbolic_context=context)

        classes = concrete(logits.shape[-1])
        chunk = torch.zeros(_EXAMPLE_ROWS, classes, dtype=logits.dtype, device=logits.device)
        terms = torch.zeros(num_terms, device=logits.device)
        chunk_examples = [example(chunk, _EXAMPLE_ROWS)]
        chunk_examples += [example(t, _EXAMPLE_ROWS) for t in row_inputs]
        chunk_examples += [example(t) for t in (*consts, terms)]
        post_examples = [example(t) for t in (terms, *post_inputs)]
        with mode:
            return (
                make_fx(joint, tracing_mode="fake")(*chunk_examples),
                make_fx(weights, tracing_mode="fake")(*post_examples),
            )

    try:
        traced_joint, traced_weights = in_own_thread(traced)
    except Exception as error:  # an op that autograd or symbolic shapes cannot trace
        raise UntraceableLoss(f"tracing the loss's gradient failed: {error}") from error
    check_indices(traced_joint, "the loss's class indices")
    dtypes = [t.dtype for t in (logits, *row_inputs, *consts, *post_inputs)]
    text = f"{traced_joint.code}|{traced_weights.code}|{post.code}|{dtypes}"
    key = "row_loss_" + hashlib.sha256(text.encode()).hexdigest()[:16]
    if key not in _registry:
        _registry[key] = RowLoss(
            key, traced_joint, traced_weights, post, rows, num_terms, num_rows,
            _chunk_sized(traced_joint),
        )  # fmt: skip
    return _registry[key]


def _chunk_sized(joint: GraphModule) -> int:
    """The most values of `joint` with as many elements as its first input (the chunk of logits)
    that are live at once, each from the node that makes it to its last reader."""
    nodes = list(joint.graph.nodes)
    logits = nodes[0].meta["val"]
    last_read = {a: n for n in nodes for a in n.all_input_nodes}
    live: set[Node] = set()
    most = 0
    for node in nodes[1:]:
        value = node.meta.get("val")
        if isinstance(value, Tensor) and statically_known_true(value.numel() == logits.numel()):
            live.add(node)
        most = max(most, len(live))
        live -= {a for a in node.all_input_nodes if last_read.get(a) is node}
    return most
