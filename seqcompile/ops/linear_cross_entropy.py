"""The fused linear + cross-entropy operator `seqfast::linear_cross_entropy`, which never builds the
full logits, and its backward `seqfast::linear_cross_entropy_backward`.

    linear_cross_entropy(hidden (M, D), weight (V, D), bias (V,)?, target (M,), ignore_index,
                         smoothing, mean, chunk, compute_dtype, needs_grad)
        -> (loss (), dhidden, dweight, dbias)

walks the tokens in chunks of `chunk` rows. Per chunk it forms the logits in `compute_dtype` (the
linear's dtype, autocast's included), computes each row's loss and overwrites the logits with their
gradient (one kernel), then adds the chunk's share of the gradients: `dlogits @ weight` into
`dhidden`, `dlogits^T @ hidden` into a float32 weight gradient, and column sums into a float32 bias
gradient. The loss is the sum over non-ignored rows, divided by their count (kept on the device)
when `mean`. The gradients are those of this loss; the backward only multiplies them by the
incoming gradient, so the loss can be scaled, summed with other terms or divided for gradient
accumulation. Peak extra memory is one chunk of logits.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

import seqcompile.ops.accumulate  # noqa: F401  (registers accumulate_scaled_)
from seqcompile.fx_utils import concrete
from seqcompile.ops import cross_entropy as ce
from seqcompile.ops import samples_loss
from seqcompile.ops.fused_op import Call, FusedOp, gradients, named, needs_grad

Tensor = torch.Tensor
GRADIENTS = ("hidden", "weight", "bias")
"""The arguments whose gradients the forward computes, in the order of its `needs_grad` flags."""


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


def workspace_bytes(call: Call) -> int:
    """Bytes a call allocates and frees while it runs, beyond its outputs, at the traced sizes (for
    the memory model): copies of its inputs in `compute_dtype`, one chunk of logits (rows padded
    to 16 bytes) and of `dlogits @ weight` (where the hidden states need a gradient), and the
    float32 weight and bias gradients before their cast."""
    hidden, weight, bias = (call.value(name) for name in ("hidden", "weight", "bias"))
    compute_dtype, chunk = call["compute_dtype"], call["chunk"]
    wants = _wanted(call)
    m, d, vocab = (concrete(s) for s in (*hidden.shape, weight.shape[0]))
    size = torch.empty((), dtype=compute_dtype).element_size()
    step = min(chunk if chunk > 0 else default_chunk(m, vocab), m)
    total = step * (padded_classes(vocab, compute_dtype) + (d if wants["hidden"] else 0)) * size
    total += m * d * size if hidden.dtype != compute_dtype else 0
    total += vocab * d * size if weight.dtype != compute_dtype else 0
    total += vocab * size if bias is not None and bias.dtype != compute_dtype else 0
    total += vocab * d * 4 if wants["weight"] and weight.dtype != torch.float32 else 0
    bias_dtype = bias.dtype if bias is not None else torch.float32
    total += vocab * 4 if wants["bias"] and bias_dtype != torch.float32 else 0
    return total


def flops(call: Call) -> int:
    """The logits, then the hidden-state and weight gradients where they are wanted, all in the
    forward."""
    hidden, weight = call.value("hidden"), call.value("weight")
    wants = _wanted(call)
    products = 1 + wants["hidden"] + wants["weight"]
    return 2 * products * concrete(hidden.numel()) * concrete(weight.shape[0])


def _wanted(call: Call) -> dict[str, bool]:
    """Which gradients a call computes, by argument name."""
    return dict(zip(GRADIENTS, call["needs_grad"], strict=True))


def _accumulate(total: Tensor, a: Tensor, b: Tensor) -> None:
    """total += a @ b, `total` float32: half-precision products accumulate in float32 on CUDA; on
    CPU the product runs in float32."""
    if a.is_cuda and a.dtype != torch.float32:
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total.addmm_(a.float(), b.float())


def padded_classes(classes: int, dtype: torch.dtype) -> int:
    """The row length of a chunk of logits: the classes, padded to a multiple of 16 bytes."""
    per_vector = 16 // torch.empty((), dtype=dtype).element_size()
    return -(-classes // per_vector) * per_vector


def _logits(h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """h @ w^T (+ b), its rows 16 bytes apart (the padding is never read), so that the
    cross-entropy kernel reads each row in 16-byte vectors whatever the number of classes."""
    rows = h.new_empty((h.shape[0], padded_classes(w.shape[0], h.dtype)))[:, : w.shape[0]]
    return torch.mm(h, w.t(), out=rows) if b is None else torch.addmm(b, h, w.t(), out=rows)


def _empty(t: Tensor, shape, dtype) -> Tensor:
    return t.new_empty(shape, dtype=dtype)


@torch.library.custom_op("seqfast::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    smoothing: float,
    mean: bool,
    chunk: int,
    compute_dtype: torch.dtype,
    needs_grad: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`needs_grad`: whether hidden, weight and bias need gradients (absent ones come back
    empty)."""
    m, vocab = hidden.shape[0], weight.shape[0]
    if hidden.dim() != 2 or weight.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(
            "seqfast::linear_cross_entropy: hidden must be (rows, features), weight (classes,"
            f" features) and target (rows,); got {tuple(hidden.shape)}, {tuple(weight.shape)}"
            f" and {tuple(target.shape)}"
        )
    ce.check_targets(target, vocab, ignore_index)
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    want_h, want_w, want_b = needs_grad
    count = (target != ignore_index).sum()
    scale = (1.0 / count).float() if mean else torch.ones((), device=hidden.device)
    dh = _empty(hidden, (m, hidden.shape[1]) if want_h else (0,), hidden.dtype)
    dw = torch.zeros(weight.shape if want_w else (0,), device=weight.device)
    db = torch.zeros((vocab,) if want_b else (0,), device=weight.device)
    total = torch.zeros((), device=hidden.device)
    for start, end in chunks(m, vocab, chunk):
        rows = slice(start, end)
        logits = _logits(h[rows], w, b)
        loss, _ = ce.loss_and_grad_in_place(logits, target[rows], scale, ignore_index, smoothing)
        total += loss.sum()
        if want_h:
            dh[rows] = torch.mm(logits, w)
        if want_w:
            _accumulate(dw, logits.t(), h[rows])
        if want_b:
            db += logits.sum(0, dtype=torch.float32)
    loss = total * scale if mean else total
    dbias_dtype = bias.dtype if bias is not None else torch.float32
    return loss, dh, dw.to(weight.dtype), db.to(dbias_dtype)


def chunks(m: int | torch.SymInt, classes: int, chunk: int) -> list[tuple[int, int]]:
    """The (start, end) rows of each chunk the forward walks; one chunk of every row when the
    number of rows is symbolic (a loop over it would fix it to its traced value)."""
    if not isinstance(m, int):
        return [(0, m)]
    step = chunk if chunk > 0 else default_chunk(m, classes)
    return [(start, min(start + step, m)) for start in range(0, m, step)]


def lower_forward(
    hidden, weight, bias, target, ignore_index, smoothing, mean, chunk, compute_dtype, needs_grad
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`linear_cross_entropy` on CPU in plain ATen (the registry's lowering): the op's chunks,
    unrolled at the traced sizes, written functionally (the gradients of the hidden states
    joined, the weight's and bias's summed), the targets checked by an op in the graph."""
    m, d = hidden.shape
    ce.assert_targets(target, weight.shape[0], ignore_index)
    h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    want_h, want_w, want_b = needs_grad
    count = (target != ignore_index).sum()
    scale = (1.0 / count).float() if mean else torch.ones((), device=hidden.device)
    dw = torch.zeros(weight.shape if want_w else (0,), device=weight.device)
    db = torch.zeros((weight.shape[0],) if want_b else (0,), device=weight.device)
    total = torch.zeros((), device=hidden.device)
    dhs = []
    for start, end in chunks(m, weight.shape[0], chunk):
        rows = h[start:end]
        logits = torch.mm(rows, w.t()) if b is None else torch.addmm(b, rows, w.t())
        if weight.shape[0] == 0:  # no classes: every target is ignored, no gradient to write
            loss, _ = ce.over_no_classes(end - start, smoothing, logits.device)
            dlogits = logits
        else:
            loss, lse = ce.reference_rows(logits, target[start:end], ignore_index, smoothing)
            dlogits = ce.reference_grad(
                logits, target[start:end], lse, scale.expand(end - start), ignore_index, smoothing
            )
        total = total + loss.sum()
        if want_h:
            dhs.append(torch.mm(dlogits, w))
        if want_w:
            dw = torch.addmm(dw, dlogits.t().float(), rows.float())
        if want_b:
            db = db + dlogits.sum(0, dtype=torch.float32)
    if want_h:
        dh = torch.cat(dhs).to(hidden.dtype) if dhs else hidden.new_empty((m, d))
    else:
        dh = hidden.new_empty((0,))
    loss = total * scale if mean else total
    dbias_dtype = bias.dtype if bias is not None else torch.float32
    return loss, dh, dw.to(weight.dtype), db.to(dbias_dtype)


def scaled(grad: Tensor, dhidden: Tensor, dweight: Tensor, dbias: Tensor) -> tuple[Tensor, ...]:
    """`linear_cross_entropy_backward` (and its lowering): each gradient times `grad`."""
    return tuple((t * grad).to(t.dtype) for t in (dhidden, dweight, dbias))


@linear_cross_entropy.register_fake
@named(torch.ops.seqfast.linear_cross_entropy.default)
def _(call: Call):
    hidden, weight, bias = (call[name] for name in GRADIENTS)
    wants = _wanted(call)
    dbias_dtype = bias.dtype if bias is not None else torch.float32
    return (
        _empty(hidden, (), torch.float32),
        _empty(hidden, hidden.shape if wants["hidden"] else (0,), hidden.dtype),
        _empty(weight, weight.shape if wants["weight"] else (0,), weight.dtype),
        _empty(weight, (weight.shape[0],) if wants["bias"] else (0,), dbias_dtype),
    )


@torch.library.custom_op("seqfast::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad: Tensor, dhidden: Tensor, dweight: Tensor, dbias: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The forward's gradients times the incoming gradient of the loss."""
    return scaled(grad, dhidden, dweight, dbias)


@linear_cross_entropy_backward.register_fake
@named(torch.ops.seqfast.linear_cross_entropy_backward.default)
def _(call: Call):
    return tuple(torch.empty_like(call[name]) for name in ("dhidden", "dweight", "dbias"))


FORWARD = torch.ops.seqfast.linear_cross_entropy.default


def _setup_context(ctx, inputs, output):
    call = Call(FORWARD, inputs, {})
    _loss, dh, dw, db = output
    ctx.mark_non_differentiable(dh, dw, db)
    ctx.save_for_backward(dh, dw, db)
    ctx.has_bias = call["bias"] is not None
    ctx.computed = _wanted(call)  # which of dh, dw, db the forward computed
    ctx.set_materialize_grads(False)


def _backward(ctx, grad, *_unused):
    if grad is None:
        return gradients(FORWARD)
    dh, dw, db = torch.ops.seqfast.linear_cross_entropy_backward(grad, *ctx.saved_tensors)
    # by the flags, not by size: with no tokens (or no classes) a computed gradient is empty,
    # and autograd wants it, empty, where the input requires grad
    wanted = {name: needs_grad(ctx, FORWARD, name) and ctx.computed[name] for name in GRADIENTS}
    return gradients(
        FORWARD,
        hidden=dh if wanted["hidden"] else None,
        weight=dw if wanted["weight"] else None,
        bias=db if ctx.has_bias and wanted["bias"] else None,
    )


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


def accumulate(graph: Graph, buffer: Node, call: Node, output: int) -> bool:
    """Scale the finished weight (output 1) or bias (output 2) gradient of the backward `call`
    into `buffer`, and take the hidden-state gradient out of the op, so the op, and the
    weight-sized product it would return, go once the parameter gradients are accumulated."""
    if output not in (1, 2):
        return False
    backward = Call.of(call)
    finished = backward["dweight"] if output == 1 else backward["dbias"]
    graph.call_function(
        torch.ops.seqfast.accumulate_scaled_.default, (buffer, finished, backward["grad"])
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


ENTRY = FusedOp(
    name="linear_cross_entropy",
    family="loss",
    forward=torch.ops.seqfast.linear_cross_entropy.default,
    backward=(torch.ops.seqfast.linear_cross_entropy_backward.default,),
    reference=linear_cross_entropy,
    lowering={
        torch.ops.seqfast.linear_cross_entropy.default: lower_forward,
        torch.ops.seqfast.linear_cross_entropy_backward.default: scaled,
    },
    kernels={
        torch.ops.seqfast.linear_cross_entropy.default: lambda call: [
            ce.spec("forward_grad", call["smoothing"])
        ],
        torch.ops.seqfast.linear_cross_entropy_backward.default: lambda call: [],
    },
    saves="the finished gradients of the hidden states, the weight and the bias (the forward"
    " computes them chunk by chunk), never the logits",
    flops={torch.ops.seqfast.linear_cross_entropy.default: flops},
    workspace={torch.ops.seqfast.linear_cross_entropy.default: workspace_bytes},
    accumulate=accumulate,
    samples=samples_loss.linear_cross_entropy_samples,
    benchmark="benchmarks.loss",
)
