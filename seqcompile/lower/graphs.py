"""Stage 6 on a planned graph: it becomes the callable AOTAutograd calls. Its fused calls are
implemented as chosen (`implement`: a lowering or a vendor's body inlined, kernels launched as the
executor makes them, or the op called), the rest compiled by the executor. Around a training
step's callables go the gradients' destination (`accumulate_grads`: `gradient_destination.py`)
and the copies a graph autograd keeps needs (`retained_graph.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch.fx import GraphModule

from seqcompile.dump import GraphDump
from seqcompile.lower import implement, retained_graph
from seqcompile.lower.executor import Executor
from seqcompile.lower.gradient_destination import GradientDestination
from seqcompile.options import Options
from seqcompile.report import CompileReport

_DIRECTIONS = {
    "forward": "forward",
    "backward": "backward",
    "backward_returning": "backward to autograd",
    "inference": "inference",
}
"""The report's name for each kind of lowered graph (as stage 5 lists their kernels)."""


class Compile(Protocol):
    """What stage 6 reads of the compile it serves."""

    name: str
    options: Options
    rest: str
    report: CompileReport
    dump: GraphDump
    executor: Executor


def lower(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    state: Compile,
    kind: str,
    returning: GraphModule | None = None,
    destination: GradientDestination | None = None,
) -> Callable[..., Any]:
    """Stage 6 for the graph of `kind` ("forward", "backward" or "inference"). With
    `accumulate_grads`, the forward notes at each call where its backward puts the gradients, and
    the backward is two, chosen per call: `gm` adds the parameters' gradients into `.grad`,
    `returning` returns them to autograd. A backward whose in-place twins write over saved tensors
    (`reuse_saved`) copies them first where autograd keeps the graph (`retain_graph=True`), so a
    second backward works."""
    if kind != "backward":
        run = _executable(gm, example_inputs, state, kind)
        return run if destination is None else destination.forward(run)
    written = retained_graph.written_inputs(gm)  # before the executor, which may change `gm`
    run = _executable(gm, example_inputs, state, "backward")
    if destination is not None and returning is not None:
        received = len(list(returning.graph.find_nodes(op="placeholder")))
        # made now, inside AOTAutograd's compile contexts, as Inductor needs
        returned = _executable(returning, example_inputs[:received], state, "backward_returning")
        # Inductor compiles to its inputs' strides: a .grad laid out otherwise goes through a copy
        run = destination.backward(run, returned, fixed_layouts=state.rest == "inductor")
    return retained_graph.keeping_saved(run, written)


def _executable(
    gm: GraphModule, example_inputs: Sequence[Any], state: Compile, kind: str
) -> Callable[[list[Any]], Any]:
    """`gm` on the chosen executor, its fused calls implemented as chosen, called the boxed
    way."""
    state.dump.stage(f"lower_{kind}", gm)
    where = (state.name, _DIRECTIONS[kind])
    if implement(gm, example_inputs, state.options, state.rest, state.report, where):
        state.dump.stage(f"lower_{kind}_inlined", gm)
    compiled = state.executor.compile(gm, example_inputs, kind)
    source = getattr(compiled, "source_code", None)
    if isinstance(source, str):
        state.dump.stage(f"lower_{kind}_inductor_code", source)
    return compiled
