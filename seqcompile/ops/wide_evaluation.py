"""A traced element-wise graph made to give each op's mathematical value on any CPU: every
function of the math library (exp, erf, gelu, tanh, ...) is computed in float64 and rounded to its
own dtype, so the CPU paths (the references and the lowerings Inductor compiles) give what the
generated kernels and a float64 evaluation give.

torch's float32 and half CPU kernels answer differently at non-finite inputs and at the ends of
their range depending on the machine (vectorized or scalar lanes, instruction set, CPU vendor:
`gelu(+inf)` is NaN on some x86 machines and +inf on others); its float64 ones give the value the
mathematics gives. Ops IEEE arithmetic defines exactly (+, *, /, sqrt, comparisons, copies,
rounding to integers) give the same bits everywhere and stay in their own dtype.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

aten = torch.ops.aten

NARROW = (torch.float32, torch.float16, torch.bfloat16)
"""The float dtypes whose CPU kernels are evaluated in float64 instead."""

EXACT = frozenset(
    {
        aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Tensor,
        aten.rsub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar,
        aten.neg.default, aten.abs.default, aten.reciprocal.default,
        aten.sqrt.default, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
        aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
        aten.maximum.default, aten.minimum.default, aten.fmax.default, aten.fmin.default,
        aten.floor.default, aten.ceil.default, aten.trunc.default, aten.round.default,
        aten.sign.default, aten.sgn.default, aten.copysign.Tensor, aten.relu.default,
        aten.threshold_backward.default, aten.hardtanh.default, aten.leaky_relu.default,
        aten.ldexp.Tensor, aten._to_copy.default, aten.scalar_tensor.default, aten.full.default,
        aten.full_like.default, aten.zeros.default, aten.zeros_like.default,
        aten.ones_like.default, aten._efficientzerotensor.default,
        # defined by their own format: in float64 they would step a float64's bits, or put a
        # float64's largest value for an infinity
        aten.nextafter.default, aten.nan_to_num.default,
    }
)  # fmt: skip
"""Ops that compute the same bits on every machine in their own dtype, or only there."""


@functools.lru_cache(maxsize=1024)
def widened(gm: GraphModule) -> GraphModule:
    """`gm` with each op outside `EXACT` that makes a float32 or half value computed from its
    tensor arguments in float64 and rounded to that value's dtype. `gm` is left as it is."""
    graph = copy.deepcopy(gm.graph)
    for node in list(graph.nodes):
        value = node.meta.get("val")
        if node.op != "call_function" or node.target in EXACT:
            continue
        if not isinstance(value, torch.Tensor) or value.dtype not in NARROW:
            continue
        if not any(_is_tensor(a) for a in node.all_input_nodes):
            continue
        with graph.inserting_before(node):
            node.args, node.kwargs = map_arg(
                (node.args, node.kwargs), lambda a: _in_float64(graph, a)
            )
        with graph.inserting_after(node):
            rounded = graph.call_function(aten._to_copy.default, (node,), {"dtype": value.dtype})
        rounded.meta["val"] = value
        node.replace_all_uses_with(rounded, delete_user_cb=functools.partial(_other, rounded))
    graph.eliminate_dead_code()
    return GraphModule(gm, graph)


def _other(this: Node, user: Node) -> bool:
    return user is not this


def _is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _in_float64(graph: torch.fx.Graph, node: Node) -> Node:
    if not _is_tensor(node) or node.meta["val"].dtype is torch.float64:
        return node
    return graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float64})
