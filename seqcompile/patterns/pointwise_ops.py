"""Which ops a pointwise region may hold, and why a node may not join one.

The ops are torch's own element-wise ops (the `torch.Tag.pointwise` tag of an overload), plus
the casts, `where` and `masked_fill` overloads, operator spellings and dropout the tag leaves out.
Whether the generated kernels compute one is decided by tracing it alone, forward and gradient (a
custom autograd.Function's gradient through its own backward), as
a region is traced (`pointwise_region.trace`: torch's decompositions into core ATen applied), and
printing the trace: an op whose trace holds an op without a Triton spelling (the special functions:
lgamma, digamma, Bessel functions, ...) is refused with the printer's reason. The answer is cached
per op, operand dtypes and constant arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any

import torch
from torch.fx import GraphModule, Node

from seqcompile.codegen.pointwise import Unprintable, jit_function
from seqcompile.fx.custom_function import apply_one
from seqcompile.fx.nodes import arg, tensor_val
from seqcompile.ops.pointwise import region as regions
from seqcompile.patterns.engine import Reject
from seqcompile.run import runtime

aten = torch.ops.aten
UNTAGGED = frozenset(
    [
        aten.to.dtype, aten._to_copy.default, aten.dropout.default, aten.rsub.Tensor,
        aten.where.Scalar, aten.where.ScalarSelf, aten.where.ScalarOther,
        aten.masked_fill.Tensor, aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor,
        apply_one,
    ]
)  # fmt: skip
"""Element-wise pre-dispatch ops without torch's pointwise tag that a region holds (a custom
autograd.Function with one output where its trace, forward and own backward, is element-wise)."""
_COMPARISONS = [
    getattr(getattr(aten, name), overload)
    for name in ("eq", "ne", "lt", "le", "gt", "ge")
    for overload in ("Tensor", "Scalar")
]
_SPELLED = frozenset(
    [
        aten.to.dtype, aten._to_copy.default, aten.clone.default,
        aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Tensor,
        aten.rsub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
        aten.neg.default, aten.reciprocal.default, aten.where.self, aten.where.ScalarOther,
        aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
        aten.logical_not.default, aten.logical_and.default, aten.logical_or.default,
        aten.logical_xor.default, aten.bitwise_not.default, aten.relu.default, aten.gelu.default,
        aten.silu.default, aten.sigmoid.default, aten.tanh.default, aten.exp.default,
        aten.log.default, aten.sqrt.default, aten.rsqrt.default, aten.erf.default,
        aten.abs.default, aten.sin.default, aten.cos.default, aten.sign.default, aten.sgn.default,
        aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.clamp.default, aten.clamp_min.default,
        aten.clamp_max.default, aten.maximum.default, aten.minimum.default, aten.square.default,
        aten.min.other, aten.max.other, aten.__and__.Tensor, aten.__or__.Tensor,
        aten.__xor__.Tensor, *_COMPARISONS,
    ]
)  # fmt: skip
"""Ops the printer spells, forward and gradient, at any arguments: not traced alone (dropout,
which a region's program makes a keep-mask before it is traced, is checked by its arguments)."""
DTYPES = frozenset(
    [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.int8,
     torch.uint8, torch.int16, torch.int32, torch.int64]
)  # fmt: skip


def element_wise(target: Any) -> bool:
    """Whether `target` computes each output element from the same element of its operands."""
    if target in UNTAGGED:
        return True
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.pointwise not in target.tags:
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False  # random (rrelu): the regions draw only dropout's numbers
    return not target._schema.is_mutable and target._overloadname not in ("out", "grad_input")


def refusal(node: Node) -> Reject | None:
    """Why `node` cannot join a pointwise region (None: it can)."""
    if not element_wise(node.target):
        return Reject("{} is not supported by the pointwise fuser", node.target)
    out = tensor_val(node)
    if out is None or out.dtype not in DTYPES or not runtime.runs_fused_ops(out.device):
        return Reject("{} produces a value the kernels do not take", node.target)
    for a in [*node.args, *node.kwargs.values()]:
        if isinstance(a, Node):
            v = tensor_val(a)
            if v is None or v.device != out.device or v.dtype not in DTYPES:
                return Reject("{} reads a non-tensor or another device's tensor", node.target)
        elif isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
            return Reject("{} has a symbolic scalar argument", node.target)
        elif isinstance(a, list | tuple) and node.target is not apply_one:
            return Reject("{} has a list argument", node.target)
    if node.target is aten._to_copy.default and node.kwargs.get("device", out.device) != out.device:
        return Reject("a copy to another device")
    if node.target is aten.dropout.default:
        p, train = arg(node, 1, "p"), arg(node, 2, "train")
        if not isinstance(p, numbers.Real) or not 0 < p < 1 or train is not True:
            return Reject("dropout with p={} train={}", p, train)
        return None
    if node.target in _SPELLED:
        return None
    why = _unspelled(node.target, _signature(node.args), _signature(node.kwargs))
    return None if why is None else Reject("{}", why)


def unsupported_ops(gm: GraphModule) -> list[str]:
    """The ops of `gm` that are not element-wise, each once."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return sorted({str(n.target) for n in calls if not element_wise(n.target)})


@dataclasses.dataclass(frozen=True)
class _Operand:
    """A tensor argument in a traced signature: its dtype."""

    dtype: torch.dtype


def _signature(args: Any) -> Any:
    """`args` with each tensor replaced by its dtype, hashable."""
    if isinstance(args, dict):
        return tuple(sorted((k, _signature(v)) for k, v in args.items()))
    if isinstance(args, list | tuple):
        return tuple(_signature(a) for a in args)
    if isinstance(args, Node):
        return _Operand(tensor_val(args).dtype)
    return args


@functools.lru_cache(maxsize=1024)
def _unspelled(target: Any, args: tuple, kwargs: tuple) -> str | None:
    """Why the kernels cannot compute `target` at this signature, forward or gradient (None:
    they can), found by tracing it alone and printing the trace."""
    operands = [a for a in (*args, *(v for _, v in kwargs)) if isinstance(a, _Operand)]

    def fill(values: Any, tensors: Any) -> Any:
        if isinstance(values, tuple):
            return [fill(v, tensors) for v in values]
        return next(tensors) if isinstance(values, _Operand) else values

    def alone(*tensors: torch.Tensor) -> list[torch.Tensor]:
        it = iter(tensors)
        out = target(*fill(args, it), **{k: fill(v, it) for k, v in kwargs})
        outs = list(out) if isinstance(out, tuple | list) else [out]
        floating = [o for o in outs if o.requires_grad]
        wrt = [t for t in tensors if t.requires_grad]
        if not floating or not wrt:
            return outs
        grads = torch.autograd.grad(
            floating, wrt, [torch.ones_like(o) for o in floating], allow_unused=True
        )
        return [*outs, *(g for g in grads if g is not None)]

    stand_ins = [(o.dtype, o.dtype.is_floating_point) for o in operands]
    try:
        jit_function(regions.trace(alone, stand_ins), "alone")
    except (regions.UnsupportedRegion, Unprintable) as error:
        return str(error) if str(target) in str(error) else f"{target}: {error}"
    return None
