"""Run time of an `accumulate_grads` graph: where each backward call puts the parameters' gradients,
added into their `.grad` (the accumulating backward) or handed to autograd (the backward as traced).

Autograd must get the gradients when something reads them on their way to `.grad`:
- a gradient hook on a parameter (`register_hook`, `register_post_accumulate_grad_hook`);
- a backward that writes no `.grad` for some parameter (`torch.autograd.grad`, or
  `backward(inputs=...)` naming only some tensors);
- DistributedDataParallel on a step it synchronizes: its reducer takes each gradient from
  autograd. Under `no_sync()` nothing does, and the micro-batch accumulates; the last micro-batch
  hands its gradients to the reducer, which averages what `.grad` then holds, as in eager;
- any other wrapper under torch.distributed that seqfast does not know. FSDP2 (`fully_shard`) is
  known: it reads `.grad` of its unsharded parameters after their backward, so every micro-batch
  accumulates, with or without `set_requires_gradient_sync(False)`;
- a saved parameter that comes back from saved-tensor hooks without its gradient accumulator.
  (A copy that keeps it, as `save_on_cpu` gives back, leads to the parameter, and accumulates.)

The forward decides what concerns the wrapper (DDP decides there too); the backward checks the
rest. The choice is logged once per graph and reason.

A `.grad` keeps its object and layout, as autograd's accumulation keeps them. An executor that
compiled the accumulating backward to the layout of its inputs (Inductor asserts their strides)
takes each `.grad` as `zeros_like` lays out the parameter; one the user laid out otherwise
(transposed, a slice of a larger buffer) is accumulated in a copy so laid out, then copied back
(counted by `run/copies.py`, logged once per graph and layout).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from seqcompile.run import copies

log = logging.getLogger("seqcompile")

DDP_SYNC = "DistributedDataParallel synchronizes this step's gradients (outside no_sync())"
UNKNOWN_WRAPPER = (
    "torch.distributed is initialized and the parameters belong to neither DistributedData"
    "Parallel under no_sync() nor FSDP2 (fully_shard), so something may take their gradients"
    " from autograd"
)


def forward_choice(parameters: list[Tensor]) -> str | None:
    """Why the backward of this forward call must hand its gradients to autograd (None: it may
    accumulate), as far as a wrapper around the model decides it."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel._get_active_ddp_module()
    if ddp is not None:
        return DDP_SYNC if ddp.require_backward_grad_sync else None
    if parameters and _fully_sharded(parameters):
        return None
    return UNKNOWN_WRAPPER


def _fully_sharded(parameters: list[Tensor]) -> bool:
    """Every parameter is an unsharded parameter of an FSDP2 (`fully_shard`) module."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return False
    unsharded = set()
    for entry in list(_module_state_mapping.values()):
        state = entry() if isinstance(entry, weakref.ref) else entry
        if isinstance(state, FSDPState):
            for group in _param_groups(state):
                for fsdp_param in group.fsdp_params:
                    if hasattr(fsdp_param, "_unsharded_param"):
                        unsharded.add(id(fsdp_param._unsharded_param))
    return all(id(p) in unsharded for p in parameters)


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups (one, or several where parameters are sharded on
    several meshes, in torch versions that have them)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def owners(received: list[Tensor]) -> list[Tensor] | str:
    """The parameters whose `.grad` the backward adds into, from the saved ones it received (the
    same tensors, or copies that saved-tensor hooks such as `save_on_cpu` gave back, which keep
    the parameter's gradient accumulator); or why there are none to be found."""
    found = []
    for saved in received:
        try:
            found.append(get_gradient_edge(saved).node.variable)
        except (RuntimeError, AttributeError):
            return "a saved parameter came back from the saved-tensor hooks without its gradient"
    return found


def backward_choice(parameters: list[Tensor]) -> str | None:
    """Why this backward call must hand its gradients to autograd (None: it may accumulate)."""
    for p in parameters:
        if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
            return "a parameter has a gradient hook, which must see its gradient"
        try:
            writes = torch._C._will_engine_execute_node(get_gradient_edge(p).node)
        except RuntimeError:  # raised for a leaf while autograd.grad runs: it writes no .grad
            writes = False
        if not writes:
            return (
                "this backward writes no .grad for some parameter (torch.autograd.grad, or"
                " backward(inputs=...) naming only some tensors)"
            )
    return None


class GradientDestination:
    """Where the backward calls of one compiled `accumulate_grads` graph put the parameters'
    gradients. Each forward call notes what its wrappers decide (`forward`); each backward call
    then runs `accumulating`, which takes the backward's inputs and each parameter's `.grad` after
    them (zeros created where there is none), or `returning`, which takes the same inputs without
    them (`backward`). `inputs` and `arguments` say where the forward's and the backward's inputs
    hold the parameters."""

    def __init__(self, graph: str, inputs: tuple[int, ...], arguments: tuple[int, ...]) -> None:
        self.graph = graph
        self.inputs = inputs
        self.arguments = arguments
        self.from_forward: str | None = None
        """Why the last forward call's backward must hand its gradients to autograd (see
        `forward_choice`)."""
        self._logged: set[str] = set()

    def forward(self, run: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """The boxed forward `run`, noting at each call what `forward_choice` says."""

        def forward(args: list[Any]) -> Any:
            self.from_forward = forward_choice([args[i] for i in self.inputs])
            return run(args)

        forward._boxed_call = True  # type: ignore[attr-defined]
        return forward

    def backward(
        self,
        accumulating: Callable[[list[Any]], Any],
        returning: Callable[[list[Any]], Any],
        fixed_layouts: bool = False,
    ) -> Callable[[list[Any]], Any]:
        """The boxed backward: each call runs `returning` where autograd must get the gradients,
        `accumulating` where they may be added into `.grad`. With `fixed_layouts`, `accumulating`
        takes each `.grad` only as `zeros_like` lays out its parameter (the layout it was
        compiled at); a `.grad` laid out otherwise goes through a copy."""

        def backward(args: list[Any]) -> Any:
            parameters = owners([args[i] for i in self.arguments])
            reason = self.from_forward or (
                parameters if isinstance(parameters, str) else backward_choice(parameters)
            )
            if reason is not None:
                self._log(f"gradients go to autograd for this backward: {reason}")
                return returning(args)
            for p in parameters:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in parameters]
            if fixed_layouts:
                taken = [self._as_compiled(p, g) for p, g in zip(parameters, grads, strict=True)]
            else:
                taken = grads
            args.extend(taken)
            result = accumulating(args)
            for grad, written in zip(grads, taken, strict=True):
                if written is not grad:
                    grad.copy_(written)
            return result

        backward._boxed_call = True  # type: ignore[attr-defined]
        return backward

    def _as_compiled(self, parameter: Tensor, grad: Tensor) -> Tensor:
        """`grad`, or where its strides are not those `zeros_like(parameter)` gives (the layout
        the accumulating backward was compiled at), a copy of it so laid out, which the caller
        copies back after the backward added into it."""
        if parameter.is_contiguous():
            compiled = parameter.stride()
        else:
            compiled = torch.empty_like(parameter, device="meta").stride()
        if grad.stride() == compiled:
            return grad
        self._log(
            f"a .grad of shape {tuple(grad.shape)} with strides {grad.stride()} is accumulated"
            f" in a copy at the strides the compiled backward takes, {compiled}, then copied back"
        )
        return copies.for_kernel(
            grad, "accumulate_grads", ".grad", lambda g: torch.empty_like(parameter).copy_(g)
        )

    def _log(self, message: str) -> None:
        """Say `message` at INFO level, once per graph."""
        if message not in self._logged:
            self._logged.add(message)
            log.info("%s: %s", self.graph, message)
