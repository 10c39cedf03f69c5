"""Stage 6's hand-off to the executor: a planned graph, each fused call implemented as chosen
(`lower/__init__.py`), becomes one callable taking its inputs as a list (the boxed way). Inductor
compiles it under the settings of the `torch.compile` mode (`"reduce-overhead"`: CUDA graphs;
`"max-autotune"`: autotuned matmuls and pointwise kernels, and CUDA graphs), the forward and
backward of one compile sharing Inductor's CUDA-graph state as its own compile shares it; the
eager executor runs the graph as it is."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx import GraphModule
from torch.fx.graph import _BoxedCodeGen

from seqcompile.options import OptionError

log = logging.getLogger("seqcompile")

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The `torch.compile` modes the backend takes (None: "default")."""

_graph_ids = itertools.count()


def default_rest(example_inputs: Sequence[Any]) -> str:
    """Inductor where it can compile: on CUDA, and on CPU where it finds a C++ compiler."""
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    return "inductor" if on_cuda or _cpu_compiler() else "eager"


@functools.cache
def _cpu_compiler() -> bool:
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
        return True
    except Exception as error:  # Inductor's own error for a missing or unusable compiler
        log.warning(
            "seqfast hands the rest of CPU graphs to eager: Inductor finds no C++ compiler (%s);"
            ' set options={"rest": "eager"} to silence this',
            error,
        )
        return False


def mode_settings(mode: str | None) -> dict[str, Any]:
    """Inductor's settings for `torch.compile`'s `mode`; an OptionError naming the modes for any
    other."""
    if mode is None:
        return {}
    if mode not in MODES:
        raise OptionError(
            f"torch.compile's mode must be one of {', '.join(map(repr, MODES))} or None with"
            f' backend="seqfast"; got {mode!r}'
        )
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


@dataclasses.dataclass
class Executor:
    """What runs the planned graphs of one compile: `name` ("inductor" or "eager"), Inductor's
    settings for the mode, and the CUDA-graph state its forward and backward share."""

    name: str
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    static_inputs: tuple[int, ...] = ()
    """Positions of the forward's inputs CUDA graphs may take as fixed (`static_inputs`)."""
    inputs: int = 0
    """How many inputs the forward takes (Dynamo's graph's): positions hold where it does."""
    _shared: dict[str, Any] | None = None

    def compile(
        self, gm: GraphModule, example_inputs: Sequence[Any], kind: str
    ) -> Callable[[list[Any]], Any]:
        """`gm` (a "forward", "backward", "backward_returning" or "inference" graph) as one
        callable."""
        if self.name != "inductor":
            if self.settings.get("triton.cudagraphs"):
                log.info("seqfast: the eager executor runs without CUDA graphs")
            return _boxed(gm)
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner, get_static_input_idxs

        with config.patch(self.settings):
            shared = self._cuda_graphs()
            backward = kind.startswith("backward")
            if backward:
                static = _saved_inputs(gm)
            elif len(example_inputs) == self.inputs:
                static = list(self.static_inputs)
            else:
                static = get_static_input_idxs(0)
            return compile_fx_inner(
                gm,
                example_inputs,
                is_backward=backward,
                is_inference=kind == "inference",
                static_input_idxs=static,
                **shared,
            )

    def _cuda_graphs(self) -> dict[str, Any]:
        """What Inductor's forward and backward compiles of one graph share for CUDA graphs:
        whether they are on, the forward's device and the graph's id (made at the first
        compile, under the mode's settings)."""
        if self._shared is None:
            from torch._inductor import config
            from torch._inductor.cudagraph_utils import BoxedDeviceIndex
            from torch._inductor.utils import BoxedBool

            self._shared = {
                "cudagraphs": BoxedBool(config.triton.cudagraphs),
                "boxed_forward_device_index": BoxedDeviceIndex(None),
                "graph_id": next(_graph_ids),
            }
        return self._shared


_NOT_SAVED = ("tangents", "bwd_seed", "bwd_base_offset", "bwd_rng_state")
"""What a backward input is named where the forward did not save it (as Inductor tells them)."""


def _saved_inputs(gm: GraphModule) -> list[int]:
    """The backward's leading inputs that the forward saved: under CUDA graphs they are the
    forward's outputs, at fixed addresses (Inductor's `count_tangents`, which asserts they all come
    first; an accumulating backward takes the `.grad` buffers after its tangents)."""
    static = []
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        if any(word in node.name for word in _NOT_SAVED):
            break
        static.append(i)
    return static


def static_inputs(gm: GraphModule) -> tuple[int, ...]:
    """The inputs of Dynamo's graph `gm` that Dynamo marks static (parameters and buffers), as
    Inductor's own compile reads them: under CUDA graphs they stay where they are instead of being
    copied in on every call."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    marked = [
        node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") for node in placeholders
    ]
    return tuple(i for i, static in enumerate(marked) if static)


def _boxed(gm: GraphModule) -> Callable[[list[Any]], Any]:
    """`gm` called the boxed way AOTAutograd prefers: it takes the list of inputs and empties it,
    so each input (a saved activation, in a backward) is freed after its last use rather than at
    the graph's end."""
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        return gm(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run
