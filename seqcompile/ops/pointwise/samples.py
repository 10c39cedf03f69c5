"""Sample inputs of `seqfast::pointwise`: regions made from plain functions (a broadcast bias, two
full operands, a selection with two outputs), each function run eagerly being its answer; every
dimension 0, 1 and odd, a region over more than one block, and non-finite rows."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from seqcompile.ops.samples import Sample, generator, randn

Tensor = torch.Tensor
SHAPE = (3, 5, 7)


def _select(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    return torch.where(x > 0, x * y, torch.exp(y)), x - y


FUNCTIONS: dict[str, tuple[Callable[..., Tensor | tuple[Tensor, ...]], bool]] = {
    "bias-gelu": (lambda x, b: F.gelu(x + b), True),
    "swiglu": (lambda a, b: F.silu(a) * b, False),
    "select": (_select, False),
}
"""Name -> (function, whether its second input is a bias over the last dimension)."""


def _eager(fn: Callable) -> Callable[..., Sequence[Tensor]]:
    def eager(inputs, **_) -> Sequence[Tensor]:
        result = fn(*inputs)
        return result if isinstance(result, tuple) else (result,)

    return eager


@functools.cache
def _region(fn_name: str) -> str:
    """The key of the region `fn_name` makes (float32 inputs; its program fits every shape)."""
    from seqcompile.patterns.pointwise_cut import region_of_function  # (patterns import ops)

    fn, bias = FUNCTIONS[fn_name]
    example = [torch.ones(2, 3), torch.ones(3) if bias else torch.ones(2, 3)]
    return region_of_function(fn, example).key


def _sample(name: str, fn_name: str, shape: tuple[int, ...], g) -> Sample:
    fn, bias = FUNCTIONS[fn_name]
    inputs = [randn(g, *shape), randn(g, *(shape[-1:] if bias else shape))]
    args = dict(inputs=inputs, seed=None, stream=0, region=_region(fn_name))
    outputs = tuple(range(2 if fn_name == "select" else 1))
    return Sample(name, args, _eager(fn), grads=("inputs[0]", "inputs[1]"), outputs=outputs)


def samples() -> Iterator[Sample]:
    """The base samples, every tensor contiguous."""
    g = generator(2)
    for fn_name in FUNCTIONS:
        yield _sample(fn_name, fn_name, SHAPE, g)
    for dim in range(len(SHAPE)):
        for size in (0, 1):
            shape = tuple(size if d == dim else n for d, n in enumerate(SHAPE))
            yield _sample(f"bias-gelu-dim{dim}-{size}", "bias-gelu", shape, g)
    yield _sample("swiglu-over-two-blocks", "swiglu", (3, 347), g)
    for name, value in (("nan", math.nan), ("inf", math.inf), ("neg-inf", -math.inf)):
        for fn_name in ("bias-gelu", "select"):
            sample = _sample(f"{fn_name}-{name}-row", fn_name, SHAPE, g)
            sample.args["inputs"][0][1, 2] = value
            yield sample
