"""The residual + normalization family: `norm(residual + dropout(x + bias))` in any of its spellings
becomes one `seqfast::add_norm`.

A match composes independent readers: a *core* (aten `layer_norm` or `rms_norm`: normalize reads
the norms written out, as T5, LLaMA and Cohere write them, as those; its input read through a
widening cast, a weight read through a cast after it) and a *prologue* on the core's input (a
residual add, dropout on the branch, a bias on the branch, including a linear's own bias), read
through reshapes between the sum and the norm that keep the rows (OPT's
`(residual + x).view(shape)`). When the sum also feeds other nodes (pre-LN blocks), the fused
op's second output replaces it there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import (
    RESHAPES,
    arg,
    barrier_between,
    erase_unused,
    insert_getitem,
    is_call,
    is_row_vector,
    node_order,
    only_user,
    same_shape,
    site_name,
    tensor_val,
)
from seqcompile.ops import add_norm
from seqcompile.ops.add_norm import op as norm_op
from seqcompile.patterns.engine import FuseContext, Reject, Rewrite
from seqcompile.run import runtime

aten = torch.ops.aten
FAMILY = add_norm.ENTRY.family


@dataclasses.dataclass
class Core:
    """The normalization itself: `out = norm(input) * weight + bias`."""

    out: Node
    input: Node
    weight: Node | None
    bias: Node | None
    eps: float | None
    rms: bool
    nodes: list[Node]
    """Nodes of the spelled-out form that the fused op replaces (besides `out`)."""


@dataclasses.dataclass
class Prologue:
    """What is added up before normalizing: `residual + dropout(x + branch_bias, p)`."""

    x: Node
    residual: Node | None = None
    branch_bias: Node | None = None
    p: float = 0.0
    total: Node | None = None
    """The residual add, whose other readers get the fused op's sum output."""
    linear: Node | None = None
    """A linear whose bias becomes `branch_bias`; it is rebuilt without one."""
    nodes: list[Node] = dataclasses.field(default_factory=list)
    views: list[Node] = dataclasses.field(default_factory=list)
    """Reshapes from `total` to the norm's input, in order, each keeping the last dim: the fused
    op works in the sum's shape and its normalized output is reshaped the same way."""


# ---------------------------------------------------------------------------------------------
# cores


def _last_dims(node: Node, normalized_shape: list) -> Reject | None:
    if len(normalized_shape) != 1:
        return Reject(
            "normalizes over the last {} dimensions; the kernel normalizes over the last one only",
            len(normalized_shape),
        )
    return None


def _layer_norm_core(node: Node) -> Core | Reject | None:
    if not is_call(node, aten.layer_norm.default):
        return None
    shape = arg(node, 1, "normalized_shape")
    weight, bias = arg(node, 2, "weight"), arg(node, 3, "bias")
    return _last_dims(node, shape) or _with_epilogue(
        _core(node, weight, bias, arg(node, 4, "eps", 1e-5), rms=False)
    )


def _rms_norm_core(node: Node) -> Core | Reject | None:
    if not is_call(node, aten.rms_norm.default):
        return None
    shape = arg(node, 1, "normalized_shape")
    weight, eps = arg(node, 2, "weight"), arg(node, 3, "eps")
    return _last_dims(node, shape) or _with_epilogue(_core(node, weight, None, eps, rms=True))


def _core(node: Node, weight: Any, bias: Any, eps: float | None, rms: bool) -> Core:
    """The norm `node`, reading the source of a widening cast of its input (`x.float()`): the
    kernel computes in float32 whatever it reads."""
    source = _strip_widening(node.args[0])
    casts = [node.args[0]] if source is not node.args[0] else []
    return Core(node, source, weight, bias, eps, rms, casts)


def _strip_widening(node: object) -> object:
    """The source of a cast to float32 (which loses nothing); any other node unchanged."""
    if is_call(node, aten.to.dtype) and arg(node, 1, "dtype") == torch.float32:
        return node.args[0]
    return node


def _with_epilogue(core: Core) -> Core:
    """A norm without weight or bias, followed by an optional cast and a multiply by a weight
    vector (in either order of operands), takes the weight. The kernel rounds once, to the
    output dtype, so a cast to anything narrower than the output (which eager rounds to first)
    keeps the epilogue out of the fused op."""
    if core.weight is not None or core.bias is not None:
        return core
    node = core.out
    follower, cast = only_user(node), None
    if is_call(follower, aten.to.dtype):
        follower, cast = only_user(follower), follower
    if is_call(follower, aten.mul.Tensor) and len(follower.args) == 2:
        scaled = cast or node
        other = follower.args[1] if follower.args[0] is scaled else follower.args[0]
        cast_dtype = arg(cast, 1, "dtype") if cast is not None else torch.float32
        exact = cast_dtype in (torch.float32, tensor_val(follower).dtype)
        if exact and is_row_vector(tensor_val(other), tensor_val(core.input)):
            core.nodes += [node] + ([cast] if cast is not None else [])
            core.out, core.weight = follower, other
    return core


CORES = (_layer_norm_core, _rms_norm_core)


# ---------------------------------------------------------------------------------------------
# prologue


def _foldable_dropout(node: Node) -> bool:
    return is_call(node, aten.dropout.default) and len(node.users) == 1


def _foldable_bias(node: Node) -> bool:
    if len(node.users) != 1:
        return False
    if is_call(node, aten.linear.default):
        return is_row_vector(tensor_val(arg(node, 2, "bias")), tensor_val(node))
    return _bias_operands(node) is not None


def _bias_operands(node: Node) -> tuple[Node, Node] | None:
    """(input, bias) of `input + bias` with `bias` a vector over the last dim of `input`."""
    if not is_call(node, aten.add.Tensor) or arg(node, 2, "alpha", 1) != 1:
        return None
    out = tensor_val(node)
    for a, b in (node.args[:2], node.args[1::-1]):
        av = tensor_val(a)
        if av is not None and same_shape(av, out) and is_row_vector(tensor_val(b), out):
            return a, b
    return None


def _keeps_rows(node: Node) -> bool:
    """`node` reshapes its input without changing the last dim: a row-wise norm commutes with it."""
    if not is_call(node, *RESHAPES):
        return False
    before, after = tensor_val(node.args[0]), tensor_val(node)
    return (
        before is not None
        and after is not None
        and min(before.dim(), after.dim()) >= 1
        and statically_known_true(before.shape[-1] == after.shape[-1])
    )


def _read_prologue(norm_input: Node) -> Prologue:
    z, views = norm_input, []
    while _keeps_rows(z):
        views.insert(0, z)
        z = z.args[0]
    value = tensor_val(z)
    if not is_call(z, aten.add.Tensor) or arg(z, 2, "alpha", 1) != 1:
        return Prologue(norm_input)
    a, b = z.args[:2]
    av, bv = tensor_val(a), tensor_val(b)
    if av is None or bv is None or not (same_shape(av, value) and same_shape(bv, value)):
        return Prologue(norm_input)

    def score(n: Node) -> int:
        return 2 if _foldable_dropout(n) else 1 if _foldable_bias(n) else 0

    residual, x = (b, a) if score(a) > score(b) else (a, b)
    prologue = Prologue(x, residual=residual, total=z, views=views)
    if _foldable_dropout(x):
        prologue.p = float(arg(x, 1, "p"))
        prologue.nodes.append(x)
        prologue.x = x = x.args[0]
    if _foldable_bias(x):
        if is_call(x, aten.linear.default):
            prologue.linear, prologue.branch_bias = x, arg(x, 2, "bias")
        else:
            prologue.x, prologue.branch_bias = _bias_operands(x)
            prologue.nodes.append(x)
    return prologue


# ---------------------------------------------------------------------------------------------
# checks and rewrite


def _check(core: Core, prologue: Prologue) -> Reject | None:
    value = tensor_val(core.out)
    width = value.shape[-1]
    if not isinstance(width, int):
        return Reject("normalized width {} is dynamic; the kernel needs it fixed", width)
    if width > norm_op.MAX_WIDTH:
        return Reject(
            "normalized width {} > {}, the widest row the kernel keeps in registers",
            width,
            norm_op.MAX_WIDTH,
        )
    tensors = [core.out, core.input, core.weight, core.bias, prologue.x, prologue.residual]
    tensors.append(prologue.branch_bias)
    for node in tensors:
        v = tensor_val(node)
        if v is not None and v.dtype not in norm_op.DTYPES:
            return Reject("dtype {} is not supported (float32, float16, bfloat16)", v.dtype)
        if v is not None and not runtime.runs_fused_ops(v.device):
            return Reject("device {} has neither kernels nor a reference here", v.device)
    if prologue.p >= 1:
        return Reject("dropout p={} drops every element", prologue.p)
    return None


def _other_readers(core: Core, prologue: Prologue) -> list[Node]:
    """Readers of the residual sum outside the normalization (the next block's residual add).
    The first reshape towards the norm is one when a reshape on the way is read elsewhere."""
    if prologue.total is None:
        return []
    inside = {core.out, *core.nodes, *prologue.views}
    readers = [u for u in prologue.total.users if u not in inside]
    if any(u not in inside for view in prologue.views for u in view.users):
        readers.append(prologue.views[0])
    return readers


def _placement(
    core: Core, prologue: Prologue, order: dict[Node, int]
) -> tuple[list[Node], Node] | None:
    """The other readers of the sum and the node the fused op goes before (the first reader of
    its outputs); None when the norm's parameters only exist after that point (they could be
    computed after another reader of the sum)."""
    readers = _other_readers(core, prologue)
    point = min([core.out, *readers], key=order.__getitem__)
    parameters = [n for n in (core.weight, core.bias) if isinstance(n, Node)]
    if any(order[n] >= order[point] for n in parameters):
        return None
    return readers, point


def _rewrite(
    core: Core, prologue: Prologue, readers: list[Node], point: Node, site: str
) -> Rewrite:
    def apply(ctx: FuseContext) -> Node:
        graph = ctx.gm.graph
        out_val = tensor_val(core.out)
        casts = _casts_of_every_read(core.out)
        out_dtype = tensor_val(casts[0]).dtype if casts else out_val.dtype
        with graph.inserting_before(point):
            x = prologue.x
            if prologue.linear is not None:
                x = ctx.call(aten.linear.default, *prologue.linear.args[:2])
            seed = ctx.seed(out_val.device) if prologue.p > 0 else None
            stream = ctx.next_stream() if prologue.p > 0 else 0
            sum_dtype = tensor_val(prologue.total or core.input).dtype
            eps = core.eps if core.eps is not None else torch.finfo(torch.float32).eps
            fused = ctx.call_fused(
                add_norm.ENTRY.forward,
                x=x,
                residual=prologue.residual,
                branch_bias=prologue.branch_bias,
                weight=core.weight,
                bias=core.bias,
                seed=seed,
                stream=stream,
                p=prologue.p,
                eps=eps,
                rms=core.rms,
                out_dtype=out_dtype,
                sum_dtype=sum_dtype,
            )
            out = insert_getitem(graph, fused, 0)
            total = insert_getitem(graph, fused, 1) if readers else None
        # after every reshape and its size arguments
        with graph.inserting_before(core.out):
            for view in prologue.views:
                out = ctx.call(view.target, out, *view.args[1:], **view.kwargs)
        for cast in casts:  # each reads the op's output in the dtype it already has
            cast.replace_all_uses_with(ctx.in_layout_of(out, tensor_val(cast)))
        core.out.replace_all_uses_with(ctx.in_layout_of(out, out_val))
        if readers:
            total = ctx.in_layout_of(total, tensor_val(prologue.total))
        for reader in readers:
            reader.replace_input_with(prologue.total, total)
        erase_unused(
            [*casts, core.out, *core.nodes, *prologue.nodes, *prologue.views]
            + [n for n in (prologue.total, prologue.linear) if n is not None]
        )
        return fused

    return apply


def _casts_of_every_read(out: Node) -> list[Node]:
    """The readers of the norm's output `out` where every one casts it to one narrower float
    dtype the kernels write (autocast's cast before a matmul): the op writes that dtype itself,
    rounding the float32 result once as the cast would, and takes the gradient in it. None
    otherwise."""
    readers = list(out.users)
    if not readers or not all(is_call(r, aten.to.dtype) and len(r.args) == 2 for r in readers):
        return []
    dtypes = {r.args[1] for r in readers}
    own = tensor_val(out).dtype
    if len(dtypes) != 1 or own not in norm_op.DTYPES or not dtypes <= set(norm_op.DTYPES):
        return []
    (dtype,) = dtypes
    return readers if torch.finfo(dtype).bits < torch.finfo(own).bits else []


class NormPattern:
    family = FAMILY

    def find(self, node: Node, ctx: FuseContext) -> Rewrite | Reject | None:
        for read_core in CORES:
            core = read_core(node)
            if core is None:
                continue
            if isinstance(core, Reject):
                return core
            order = node_order(node.graph)
            if barrier_between(min([core.out, *core.nodes], key=order.__getitem__), core.out):
                return Reject("grad mode, autocast or an in-place op changes inside the norm")
            prologue = _read_prologue(core.input)
            placement = _placement(core, prologue, order)
            if prologue.total is not None:
                absorbed = [prologue.total, *prologue.nodes]
                absorbed += [prologue.linear] if prologue.linear is not None else []
                start = min(absorbed, key=order.__getitem__)
                # the fused op reads the sum's inputs where the norm is: nothing may change between
                if barrier_between(start, core.out) or placement is None:
                    prologue = Prologue(core.input)
                    placement = _placement(core, prologue, order)
            rejected = _check(core, prologue)
            return rejected or _rewrite(core, prologue, *placement, site_name(node))
        return None
