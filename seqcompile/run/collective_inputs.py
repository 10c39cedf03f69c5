"""Graph inputs that are, or hold, the pending result of a collective (`AsyncCollectiveTensor`:
what DTensor's `to_local` returns after an asynchronous reduction, scatter or gather, as tensor
parallelism hands a block its activations): compiled as the tensors they wait for, and waited
for before each call, with their gradient kept.

AOTAutograd (torch 2.13) waits for such an input before it traces, and traces the tensor it
waits for, which never requires grad: the compiled graph returns no gradient for that input,
and the gradient of everything before it is lost (the embedding's, in a block compiled alone;
DTensor's `Redistribute.backward` then gets a plain tensor of zeros and fails, or under FSDP2,
whose hook hands zeros on, the embedding's gradient is silently zero). Given the waited tensor
instead, with the input's `requires_grad`, it returns the gradient; each call hands the graph
the waited tensor through `Waited`, whose backward passes the gradient on to the input.

A DTensor whose local tensor is pending reaches the graph unwaited: AOTAutograd unwraps it to
the collective's buffer, which the graph would read before the collective is done. Its wait
comes before each call; its gradient is the DTensor's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqcompile.fx.nodes import is_dtensor

try:  # a torch built without distributed support has no collectives
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
except ImportError:  # pragma: no cover
    AsyncCollectiveTensor = None  # type: ignore[assignment,misc]


def pending(example_inputs: Sequence[Any]) -> list[int]:
    """Positions of the inputs that are a collective's pending result."""
    if AsyncCollectiveTensor is None:
        return []
    return [i for i, t in enumerate(example_inputs) if isinstance(t, AsyncCollectiveTensor)]


def as_waited(
    example_inputs: Sequence[Any], fake_inputs: Sequence[Any], positions: Sequence[int]
) -> list[Any]:
    """The example inputs for AOTAutograd, each pending one at `positions` as the fake tensor
    its fake value holds (so sizes stay the symbols Dynamo traced), requiring grad as the
    input does."""
    inputs = list(example_inputs)
    for i in positions:
        inner = fake_inputs[i].elem
        with inner.fake_mode:
            inputs[i] = inner.detach().requires_grad_(example_inputs[i].requires_grad)
    return inputs


def waiting(
    compiled: Callable[..., Any], example_inputs: Sequence[Any], positions: Sequence[int]
) -> Callable[..., Any]:
    """`compiled`, called with each pending input at `positions` waited for through `Waited`,
    and the pending local tensor of each DTensor activation (a DTensor input that is not a
    parameter) waited for in place."""
    activations = [
        i
        for i, t in enumerate(example_inputs)
        if is_dtensor(t) and not isinstance(t, torch.nn.Parameter)
    ]
    if not positions and not activations:
        return compiled

    @functools.wraps(compiled)
    def run(*args: Any) -> Any:
        args = list(args)
        for i in positions:
            if isinstance(args[i], AsyncCollectiveTensor):
                args[i] = Waited.apply(args[i])
        for i in activations:
            if isinstance(local := args[i]._local_tensor, AsyncCollectiveTensor):
                local.trigger_wait()
        return compiled(*args)

    return run


class Waited(torch.autograd.Function):
    """The tensor a pending collective result holds, once the collective is done, as a new
    tensor whose gradient is the input's."""

    @staticmethod
    def forward(ctx: Any, pending: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        done = pending.trigger_wait()
        return done.view_as(done)  # a fresh tensor: autograd writes its history into it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad
