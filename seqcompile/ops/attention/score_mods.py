"""Score modifications: an element-wise function g the fused attention applies to its scores
`q @ k^T * scale` before the biases and masks (Gemma 2's soft cap `50 * tanh(x / 50)`, a clamp),
with constants only. Registered once per process and looked up by key, as pointwise regions are:
g and its derivative are traced together to post-dispatch ATen on a float32 stand-in, the reference
implementation runs that graph, and the pointwise printer writes it into the attention kernels as
`score_mod(x) -> (g(x), g'(x))`, so the backward scales the scores' gradient by g'(x).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import torch
from torch.fx import GraphModule

from seqcompile.codegen.pointwise import Unprintable, jit_function
from seqcompile.ops.pointwise.region import UnsupportedRegion, trace
from seqcompile.ops.wide_evaluation import widened

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class ScoreMod:
    key: str
    graph: GraphModule
    """x -> (g(x), g'(x)), on float32."""
    kernel: tuple[str, ...]
    """The `@triton.jit` function `score_mod`, line by line."""
    description: str


_registry: dict[str, ScoreMod] = {}


def register(g: Callable[[Tensor], Tensor], description: str) -> str:
    """The key of `g` (traced with its derivative and printed); raises `UnsupportedRegion` when
    either cannot be traced or printed."""

    def with_slope(x: Tensor) -> tuple[Tensor, Tensor]:
        y = g(x)
        (slope,) = torch.autograd.grad(y, x, torch.ones_like(y))
        return y, slope

    graph = trace(with_slope, [(torch.float32, True)])
    key = hashlib.sha256(graph.code.encode()).hexdigest()[:16]
    if key not in _registry:
        try:
            kernel = jit_function(graph, "score_mod")
        except Unprintable as why:
            raise UnsupportedRegion(
                f"the score modification has no Triton spelling: {why}"
            ) from None
        _registry[key] = ScoreMod(key, graph, kernel, description)
    return key


def lookup(key: str) -> ScoreMod:
    try:
        return _registry[key]
    except KeyError:
        raise RuntimeError(
            f"seqfast::attention: score modification {key!r} is not registered in this process;"
            " modifications are registered when a graph that uses them is compiled"
        ) from None


def apply(key: str, x: Tensor) -> tuple[Tensor, Tensor]:
    """g(x) and g'(x) of float32 scores (the reference implementation's)."""
    y, slope = widened(lookup(key).graph)(x.float())
    return y.expand_as(x), slope.expand_as(x)
