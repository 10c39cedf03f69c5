"""A boolean mask split into its factors, the masks whose conjunction keeps a score: `&` splits a
mask where True keeps, `|` one where True masks, through views, casts and negations (`~m`,
`m == 0`); a test of a float mask made from a boolean one (`where(m, 0, finfo.min).to(bool)`, as
MPT reads Hugging Face's) is read as that mask.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.fx.nodes import is_call, tensor_val
from seqcompile.patterns.attention.index_arithmetic import integer
from seqcompile.patterns.attention.masks import constant

aten = torch.ops.aten
AND = (aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default)
OR = (aten.__or__.Tensor, aten.bitwise_or.Tensor, aten.logical_or.default)
_NOT = (aten.bitwise_not.default, aten.logical_not.default)
WHERE = (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
_SCALAR_TESTS = {
    aten.lt.Scalar: operator.lt,
    aten.le.Scalar: operator.le,
    aten.gt.Scalar: operator.gt,
    aten.ge.Scalar: operator.ge,
    aten.eq.Scalar: operator.eq,
    aten.ne.Scalar: operator.ne,
}


def factors(mask: Node, keeps: bool) -> list[tuple[Node, bool]]:
    """The masks whose conjunction is `mask` (with whether True keeps, for each): `&` splits a
    mask where True keeps, `|` one where True masks, a negation (`~m`, `m == 0`) flips; a
    constant that keeps everything is dropped."""
    node, keeps = _unwrapped(mask, keeps)
    if is_call(node, *(AND if keeps else OR)) and all(is_bool(a) for a in node.args[:2]):
        return [f for a in node.args[:2] for f in factors(a, keeps)]
    if is_bool(node) and tensor_val(node).dim() == 0 and constant(node) == float(keeps):
        return []
    if is_call(node, aten.new_ones.default, aten.ones.default) and list(node.args[-1]) == []:
        return [] if keeps else [(node, keeps)]
    return [(node, keeps)]


def _unwrapped(node: object, keeps: bool) -> tuple[object, bool]:
    """`node` through views, casts and negations (with whether True keeps there)."""
    while True:
        if is_call(node, aten.expand.default, aten.alias.default) or _bool_cast(node):
            node = node.args[0]
        elif leading_ones(node):
            node = node.args[0]
        elif is_call(node, *_NOT) and is_bool(node.args[0]):
            node, keeps = node.args[0], not keeps
        elif _compared_with_zero(node):  # mask == 0 (the Annotated Transformer), mask != 0
            node, keeps = node.args[0], keeps != is_call(node, aten.eq.Scalar)
        elif (tested := _test_of_where(node)) is not None:  # where(m, 0, min).to(bool): MPT
            node, flips = tested
            keeps = keeps != flips
        else:
            return node, keeps


def _test_of_where(node: object) -> tuple[Node, bool] | None:
    """For a test of `where(cond, a, b)` with constants a and b that tells them apart
    (`.to(bool)`, as MPT reads Hugging Face's float mask, or `< -1`, as Falcon does): cond, and
    whether the test is its negation."""
    if is_call(node, aten.to.dtype, aten._to_copy.default) and is_bool(node):
        where, test = node.args[0], (lambda x: x != 0)
    elif is_call(node, *_SCALAR_TESTS) and integer(node.args[1]) is not None:
        bound = integer(node.args[1])
        where, test = node.args[0], (lambda x: _SCALAR_TESTS[node.target](x, bound))
    else:
        return None
    while is_call(where, aten.expand.default, aten.alias.default):
        where = where.args[0]
    if not is_call(where, *WHERE):
        return None
    cond, a, b = where.args[:3]
    ca, cb = constant(a), constant(b)
    if ca is None or cb is None or test(ca) == test(cb) or not is_bool(cond):
        return None
    return cond, not test(ca)


def _compared_with_zero(node: object) -> bool:
    """`mask == 0` or `mask != 0` of a boolean mask: its negation, or itself."""
    return (
        is_call(node, aten.eq.Scalar, aten.ne.Scalar)
        and is_bool(node.args[0])
        and node.args[1] == 0  # (a Python number or bool: the Scalar overload's)
    )


def leading_ones(node: object) -> bool:
    """A view that only adds or removes leading size-1 dims (`m.view(1, 1, Lq, Lk)`)."""
    if not is_call(node, aten.view.default, aten.reshape.default, aten.unsqueeze.default):
        return False
    before, after = tensor_val(node.args[0]), tensor_val(node)
    if before is None or after is None or min(before.dim(), after.dim()) < 2:
        return False
    ones = all(statically_known_true(n == 1) for t in (before, after) for n in t.shape[:-2])
    return ones and all(statically_known_true(before.shape[d] == after.shape[d]) for d in (-2, -1))


def _bool_cast(node: object) -> bool:
    return (
        is_call(node, aten.to.dtype, aten._to_copy.default)
        and is_bool(node)
        and is_bool(node.args[0])
    )


def is_bool(node: object) -> bool:
    value = tensor_val(node)
    return value is not None and value.dtype == torch.bool
