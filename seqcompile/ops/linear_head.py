"""What the chunked linear + loss operators share (`seqfast::linear_cross_entropy`,
`seqfast::linear_row_loss`): both take hidden states `(M, D)`, a weight `(V, D)` and a bias, walk
the rows in chunks, and return the loss with the finished gradients of the hidden states, the
weight and the bias, which their backward multiplies by the incoming gradient.

Here: the chunking, the float32 accumulation of the weight gradient, the FLOPs, the fake
implementation, the backward op and its sharding rule, the autograd registration, and the
accumulation hook that adds the weight and bias gradients into the parameters' buffers.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch._ops import OpOverload
from torch.fx import Graph, Node

import seqcompile.ops.accumulate  # noqa: F401  (registers accumulate_scaled_)
from seqcompile.fx.nodes import concrete
from seqcompile.ops.fused_op import Call, define, gradients, named, needs_grad, schema
from seqcompile.ops.sharding import (
    NoSharding,
    Partial,
    Shape,
    Shard,
    Strategy,
    placed,
    row_dims,
    shape_of,
    shards,
)

Tensor = torch.Tensor
GRADIENTS = ("hidden", "weight", "bias")
"""The arguments whose gradients the forward computes, in the order of its `needs_grad` flags."""

BACKWARD_ARGUMENTS = "Tensor grad, Tensor dhidden, Tensor dweight, Tensor dbias"
"""The backward's: the incoming gradient of the loss and the forward's finished gradients."""

SAVES = (
    "the finished gradients of the hidden states, the weight and the bias (the forward computes"
    " them chunk by chunk), never the logits"
)
"""What the operators keep for the backward (their registry entries' `saves`)."""

SMALL_LOGITS = 2**20
"""Logits (elements) below which the default chunk takes every row: a chunk of them saves under
4 MiB in float32 and costs three matmuls."""


def default_chunk(rows: int, classes: int) -> int:
    """An eighth of the tokens, in multiples of 128 rows once there are that many; every row when
    all the logits are fewer than `SMALL_LOGITS`."""
    if rows * classes < SMALL_LOGITS:
        return max(1, rows)
    chunk = max(1, rows // 8)
    return chunk - chunk % 128 if chunk >= 128 else chunk


TILE = 128
"""Rows and columns of the matmul output tile the chunk rule counts (cuBLAS's and Inductor's
usual 128 x 128 on Hopper)."""
WAVES = 2
"""Waves of output tiles each of a chunk's matmuls should give the device at least."""


def filling_chunk(call: Call, processors: int) -> int:
    """The rows of the smallest chunk whose every matmul gives `processors` multiprocessors
    `WAVES` waves of `TILE` x `TILE` output tiles: the logits (rows x classes) and, where the
    hidden states want a gradient, `dlogits @ weight` (rows x features). The weight's gradient
    (classes x features) has as many tiles at any chunk."""
    features, classes = (
        concrete(call.value(n).shape[i]) for n, i in (("hidden", 1), ("weight", 0))
    )
    narrowest = min(classes, features) if wanted(call)["hidden"] else classes
    columns = max(1, -(-narrowest // TILE))
    return -(-WAVES * processors // columns) * TILE


def even_chunk(rows: int, at_least: int) -> int:
    """The chunk that splits `rows` evenly into as many chunks of at least `at_least` rows as
    there are room for (one chunk of every row where there is room for none)."""
    count = max(1, rows // max(at_least, 1))
    return -(-rows // count)


def chunks(m: int | torch.SymInt, classes: int, chunk: int) -> list[tuple[int, int]]:
    """The (start, end) rows of each chunk the forward walks; one chunk of every row when the
    number of rows is symbolic (a loop over it would fix it to its traced value)."""
    if not isinstance(m, int):
        return [(0, m)]
    step = chunk if chunk > 0 else default_chunk(m, classes)
    return [(start, min(start + step, m)) for start in range(0, m, step)]


def chunk_rows(call: Call) -> int:
    """The rows of the largest chunk a call walks, at the traced sizes."""
    m, vocab = concrete(call.value("hidden").shape[0]), concrete(call.value("weight").shape[0])
    return min(call["chunk"] if call["chunk"] > 0 else default_chunk(m, vocab), m)


def wanted(call: Call) -> dict[str, bool]:
    """Which gradients a call computes, by argument name."""
    return dict(zip(GRADIENTS, call["needs_grad"], strict=True))


def flops(call: Call) -> int:
    """The logits, then the hidden-state and weight gradients where they are wanted, all in the
    forward."""
    hidden, weight = call.value("hidden"), call.value("weight")
    wants = wanted(call)
    products = 1 + wants["hidden"] + wants["weight"]
    return 2 * products * concrete(hidden.numel()) * concrete(weight.shape[0])


def cast_bytes(call: Call) -> int:
    """Bytes of the inputs' copies in `compute_dtype` and of the float32 weight and bias
    gradients before their cast (part of a call's workspace)."""
    hidden, weight, bias = (call.value(name) for name in GRADIENTS)
    compute_dtype, wants = call["compute_dtype"], wanted(call)
    m, d, vocab = (concrete(s) for s in (*hidden.shape, weight.shape[0]))
    size = torch.empty((), dtype=compute_dtype).element_size()
    total = m * d * size if hidden.dtype != compute_dtype else 0
    total += vocab * d * size if weight.dtype != compute_dtype else 0
    total += vocab * size if bias is not None and bias.dtype != compute_dtype else 0
    total += vocab * d * 4 if wants["weight"] and weight.dtype != torch.float32 else 0
    bias_dtype = bias.dtype if bias is not None else torch.float32
    return total + (vocab * 4 if wants["bias"] and bias_dtype != torch.float32 else 0)


def add_product(total: Tensor, a: Tensor, b: Tensor) -> None:
    """total += a @ b, `total` float32: half-precision products accumulate in float32 on CUDA; on
    CPU the product runs in float32."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total.addmm_(a.float(), b.float())


def gradient_buffers(hidden: Tensor, weight: Tensor, needs: list[bool]) -> tuple[Tensor, ...]:
    """The hidden-state gradient (hidden's dtype) and the float32 weight and bias gradients a
    forward fills, empty where not wanted."""
    want_h, want_w, want_b = needs
    dh = hidden.new_empty((hidden.shape[0], hidden.shape[1]) if want_h else (0,))
    dw = torch.zeros(weight.shape if want_w else (0,), device=weight.device)
    db = torch.zeros((weight.shape[0],) if want_b else (0,), device=weight.device)
    return dh, dw, db


def finished(weight: Tensor, bias: Tensor | None, dw: Tensor, db: Tensor) -> tuple[Tensor, Tensor]:
    """The float32 weight and bias gradients in the parameters' dtypes."""
    return dw.to(weight.dtype), db.to(bias.dtype if bias is not None else torch.float32)


def fake_outputs(call: Call) -> tuple[Tensor, ...]:
    """The forward's outputs at fake values: the float32 loss, then the three gradients."""
    hidden, weight, bias = (call[name] for name in GRADIENTS)
    wants = wanted(call)
    dbias_dtype = bias.dtype if bias is not None else torch.float32
    return (
        hidden.new_empty((), dtype=torch.float32),
        hidden.new_empty(hidden.shape if wants["hidden"] else (0,)),
        weight.new_empty(weight.shape if wants["weight"] else (0,)),
        weight.new_empty((weight.shape[0],) if wants["bias"] else (0,), dtype=dbias_dtype),
    )


def scaled(grad: Tensor, dhidden: Tensor, dweight: Tensor, dbias: Tensor) -> tuple[Tensor, ...]:
    """The backward (and its lowering): each gradient times `grad`."""
    return tuple((t * grad).to(t.dtype) for t in (dhidden, dweight, dbias))


def fake_backward(call: Call) -> tuple[Tensor, ...]:
    return tuple(torch.empty_like(call[name]) for name in ("dhidden", "dweight", "dbias"))


CHUNKED: set[OpOverload] = set()
"""The forward ops of the chunked linear + loss operators (each `define_backward` adds its own)."""


def define_backward(op, forward: OpOverload, name: str) -> OpOverload:
    """For the forward custom op `op` (its overload `forward`, named `seqfast::<name>`): its fake
    implementation, its backward op `seqfast::<name>_backward` (`scaled`), and its autograd."""
    CHUNKED.add(forward)
    op.register_fake(named(forward)(fake_outputs))
    backward = define(
        f"seqfast::{name}_backward",
        schema(BACKWARD_ARGUMENTS, returns="(Tensor, Tensor, Tensor)"),
        lambda call: scaled(**call),
    )
    packet = getattr(torch.ops.seqfast, f"{name}_backward")
    backward.register_fake(named(packet.default)(fake_backward))
    _register_autograd(op, forward, packet)
    return packet.default


def _register_autograd(op, forward, backward) -> None:
    """The autograd of the forward custom op `op` (its overload `forward`): it saves the finished
    gradients, and its backward calls `backward` (an op of `scaled`'s schema) on them."""

    def setup_context(ctx, inputs, output):
        call = Call(forward, inputs, {})
        _loss, dh, dw, db = output
        ctx.mark_non_differentiable(dh, dw, db)
        ctx.save_for_backward(dh, dw, db)
        ctx.has_bias = call["bias"] is not None
        ctx.computed = wanted(call)  # which of dh, dw, db the forward computed
        ctx.no_grads = {  # a list of tensors takes a list of Nones
            a.name: [None] * len(value)
            for a, value in zip(forward._schema.arguments, inputs, strict=False)
            if str(a.type) == "List[Tensor]"
        }
        ctx.set_materialize_grads(False)

    def backward_of(ctx, grad, *_unused):
        if grad is None:
            return gradients(forward, **ctx.no_grads)
        dh, dw, db = backward(grad, *ctx.saved_tensors)
        # by the flags, not by size: with no tokens (or no classes) a computed gradient is empty,
        # and autograd wants it, empty, where the input requires grad
        wants = {name: needs_grad(ctx, forward, name) and ctx.computed[name] for name in GRADIENTS}
        return gradients(
            forward,
            hidden=dh if wants["hidden"] else None,
            weight=dw if wants["weight"] else None,
            bias=db if ctx.has_bias and wants["bias"] else None,
            **ctx.no_grads,
        )

    op.register_autograd(backward_of, setup_context=setup_context)


def accumulate(graph: Graph, buffer: Node, call: Node, output: int) -> bool:
    """Scale the finished weight (output 1) or bias (output 2) gradient of the backward `call`
    into `buffer`, and take the hidden-state gradient out of the op, so the op, and the
    weight-sized product it would return, go once the parameter gradients are accumulated."""
    if output not in (1, 2):
        return False
    backward = Call.of(call)
    done = backward["dweight"] if output == 1 else backward["dbias"]
    graph.call_function(
        torch.ops.seqfast.accumulate_scaled_.default, (buffer, done, backward["grad"])
    )
    for user in list(call.users):
        if user.target is operator.getitem and user.args[1] == 0:
            with graph.inserting_before(user):
                alone = graph.call_function(
                    torch.ops.aten.mul.Tensor, (backward["dhidden"], backward["grad"])
                )
            alone.meta["val"] = user.meta.get("val")
            user.replace_all_uses_with(alone)
            graph.erase_node(user)
    return True


@shards("the forward's gradients as it placed them")
def backward_sharding(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
    """The forward's gradients scaled by the loss's (replicated) gradient: placed as they are."""
    if shape_of(call["dhidden"]) == (0,):
        raise NoSharding("it makes no gradient of the hidden states")
    options = []
    for d in row_dims(call, "dhidden"):
        grads = [Shard(d), placed(shape_of(call["dweight"]), Partial()),
                 placed(shape_of(call["dbias"]), Partial())]  # fmt: skip
        scaled = dict(zip(("dhidden", "dweight", "dbias"), grads, strict=True))
        options.append(Strategy(grads, scaled))
    return options
