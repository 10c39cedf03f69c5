"""Readers of softmax, log_softmax and logsumexp written out, each computed stably from x less
a value of x alone (its max along the dim, with or without guards):

- softmax: `exp(x - m) / sum(exp(x - m), d, keepdim=True)`;
- log_softmax: `y - log(sum(exp(y), d, keepdim=True))` and `y - logsumexp(y, d, keepdim=True)`,
  read from x where y is `x - m`;
- logsumexp: `m + log(sum(exp(x - m), d, keepdim))` (squeezed without keepdim).

Each gives a `Candidate`, or None."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node

from seqcompile.fx.nodes import (
    arg,
    is_call,
    rank_of,
)
from seqcompile.normalize.candidate import Candidate, from_only, one_dim

aten = torch.ops.aten


def _shifted_input(y: Node, dim: int) -> Node | None:
    """x where `y` is `x - m`, m computed from x alone: the stable form's input."""
    if is_call(y, aten.sub.Tensor) and arg(y, 2, "alpha", 1) == 1:
        x, m = y.args[:2]
        if isinstance(x, Node) and from_only(m, x):
            return x
    return None


def _exp_sum(s: Any, keepdim: bool | None = True) -> tuple[Node, int] | None:
    """(y, d) where `s` is `sum(exp(y), d)` (with `keepdim` where it is given)."""
    if not is_call(s, aten.sum.dim_IntList) or arg(s, 3, "dtype") is not None:
        return None
    e = s.args[0]
    if not is_call(e, aten.exp.default):
        return None
    if keepdim is not None and bool(arg(s, 2, "keepdim", False)) != keepdim:
        return None
    dim = one_dim(s, rank_of(e))
    return None if dim is None else (e.args[0], dim)


def softmax(node: Node) -> Candidate | None:
    """`exp(y) / sum(exp(y), d, keepdim=True)` (or times its reciprocal), y = x - m."""
    if is_call(node, aten.div.Tensor):
        e, s = node.args[:2]
    elif is_call(node, aten.mul.Tensor) and is_call(node.args[1], aten.reciprocal.default):
        e, s = node.args[0], node.args[1].args[0]
    else:
        return None
    found = _exp_sum(s)
    if not is_call(e, aten.exp.default) or found is None or s.args[0] is not e:
        return None
    y, dim = found
    return _along(node, _shifted_input(y, dim) or y, dim, torch.softmax, aten.softmax.int)


def log_softmax(node: Node) -> Candidate | None:
    """`y - log(sum(exp(y), d, keepdim=True))` or `y - logsumexp(y, d, keepdim=True)`."""
    if not is_call(node, aten.sub.Tensor) or arg(node, 2, "alpha", 1) != 1:
        return None
    y, lse = node.args[:2]
    if is_call(lse, aten.log.default):
        found = _exp_sum(lse.args[0])
        if found is None or found[0] is not y:
            return None
        dim = found[1]
    elif is_call(lse, aten.logsumexp.default) and lse.args[0] is y and arg(lse, 2, "keepdim"):
        dim = one_dim(lse, rank_of(y))
        if dim is None:
            return None
    else:
        return None
    x = _shifted_input(y, dim) or y
    return _along(node, x, dim, torch.log_softmax, aten.log_softmax.int)


def _along(node: Node, x: Node, dim: int, function: Callable, op: Any) -> Candidate:
    """`node` read as `function(x, dim)`, the aten `op`."""
    name = op.__name__.split(".")[0]
    return Candidate(
        name, node, (x,), (dim,),
        lambda t: function(t, dim),
        lambda ctx: ctx.call(op, x, dim),
        f"{name}({x.name}, dim={dim})",
    )  # fmt: skip


def logsumexp(node: Node) -> Candidate | None:
    """`m + log(sum(exp(x - m), d, keepdim))`, m computed from x alone; or `log(sum(exp(x), d,
    keepdim))` where x is no such difference (evaluation refutes it: it overflows)."""
    found = None
    if is_call(node, aten.add.Tensor) and arg(node, 2, "alpha", 1) == 1:
        readings = (_shifted_log_sum(m, log) for m, log in _both_orders(node))
        found = next(filter(None, readings), None)
    elif is_call(node, aten.log.default):
        summed = _exp_sum(node.args[0], keepdim=None)
        if summed is not None and _shifted_input(*summed) is None:
            found = (*summed, bool(arg(node.args[0], 2, "keepdim", False)))
    if found is None:
        return None
    x, dim, keepdim = found
    return Candidate(
        "logsumexp", node, (x,), (dim,),
        lambda t: torch.logsumexp(t, dim, keepdim),
        lambda ctx: ctx.call(aten.logsumexp.default, x, [dim], keepdim),
        f"logsumexp({x.name}, dim={dim}, keepdim={keepdim})",
    )  # fmt: skip


def _both_orders(node: Node) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    return (node.args[0], node.args[1]), (node.args[1], node.args[0])


def _shifted_log_sum(m: Any, log: Any) -> tuple[Node, int, bool] | None:
    """(x, d, keepdim) where `log` is `log(sum(exp(x - m'), d, keepdim))`, and `m` and m' are
    computed from x alone."""
    if not is_call(log, aten.log.default):
        return None
    found = _exp_sum(log.args[0], keepdim=None)
    if found is None:
        return None
    x = _shifted_input(*found)
    if x is None or not from_only(m, x):
        return None
    return x, found[1], bool(arg(log.args[0], 2, "keepdim", False))
