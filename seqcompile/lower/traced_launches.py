"""A fused call that runs its kernels, handed to the executor as its kernels' launches: the op's own
implementation traced at the call's fake values with each launch a
`triton_kernel_wrapper_functional` node (`wrap_triton`) and its outputs allocated in the graph. The
executor launches the kernels from its own code, so none of the op's Python runs per call: its
checks, layouts, launch configurations and grids are settled once, at compile time (once per call
signature: `inline.memoized`).

Launches are traced where the executor can make them (`launches_inlined`): on CUDA under Inductor,
whose wrapper launches them (and captures them in CUDA graphs under `mode="reduce-overhead"`), and
on CPU under Triton's interpreter with the eager executor, which runs what CUDA runs, op by op.
Under the eager executor on CUDA they are traced too, and run as planned launches
(`planned_launches.py`). A
call whose launches do not trace (a host read at fake values, a launcher that decides by a
symbolic size's exact value, an op that writes over its argument) stays a call, and the report
says why. At symbolic sizes the grids stay expressions of the sizes, launch configurations are
those chosen at the sizes traced (their hints), and bounds the launcher checks (an index past
2**31) become guards, so one compile serves every size within them. On CUDA a call's kernels are
tuned at its sizes before the trace, which times nothing (`codegen/tuning.py`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator
from typing import Any

import sympy
import torch
from torch._higher_order_ops import triton_kernel_wrap
from torch._library.custom_ops import _maybe_get_opdef
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx import GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef

from seqcompile.codegen import tuning
from seqcompile.codegen.launches import tracing_launches
from seqcompile.fx.nodes import device_of
from seqcompile.lower.inline import Traced, call_inputs, inline_traced, memoized, traced_call
from seqcompile.lower.measure import run_on_random_inputs
from seqcompile.lower.planned_launches import plan_launches
from seqcompile.run import runtime

__all__ = ["inline_launches", "launch_trace", "launches_inlined"]

log = logging.getLogger("seqcompile")


def launches_inlined(device: torch.device, executor: str) -> bool:
    """Whether the kernel launches of calls on `device` are traced into the graph `executor` runs
    (Inductor on CPU makes no Triton launches; the eager executor on CUDA would dispatch each
    traced launch slower than the op's own launcher)."""
    if device.type == "cuda":
        return executor == "inductor"
    return device.type == "cpu" and runtime.interpreting() and executor == "eager"


def launch_trace(node: Node, fake_mode: Any) -> Traced | str:
    """The launches of the fused call `node` traced at its fake values, or why they do not
    trace."""
    traced = memoized("launches", node, fake_mode, lambda: _trace(node, fake_mode))
    return traced if isinstance(traced, str) else Traced(traced, call_inputs(node))


def inline_launches(
    gm: GraphModule, fake_mode: Any, nodes: list[Node], planned: Collection[Node] = ()
) -> dict[Node, str]:
    """Replace each call of `nodes` in `gm` by its traced launches (as planned `Launch`es for
    those in `planned`: `planned_launches.py`); those left calls, with why."""
    kept = {}
    for node in nodes:
        traced = launch_trace(node, fake_mode)
        if isinstance(traced, str):
            kept[node] = traced
            continue
        if node in planned:
            traced = Traced(plan_launches(traced.gm), traced.inputs)
        inline_traced(gm, node, traced)
    gm.recompile()
    return kept


def _trace(node: Node, fake_mode: Any) -> GraphModule | str:
    why = _not_traceable(node)
    if why is not None:
        return why
    if tuning.autotuning(device_of(node)):
        _tune(node)
    try:
        with tracing_launches(), _writes_known(node), _no_specialization(fake_mode):
            gm = traced_call(node, _maybe_get_opdef(node.target)._init_fn, fake_mode).gm
    except DataDependentOutputException:
        return "its launcher reads a tensor on the host, which a trace at fake values cannot"
    except Specializes as size:
        return f"its launcher decides by the exact value of a symbolic size ({size})"
    except Exception as error:  # any failure of the trace: the op is still called
        first = f"{type(error).__name__}: {error}".splitlines()[0][:240]
        return f"its launches do not trace ({first})"
    _drop_argument_copies(gm)
    return gm


def _tune(node: Node) -> None:
    """Run the call once on random inputs at its sizes, which tunes its launches there (the
    trace times nothing); where that fails (the device out of memory, say), its launches take
    their default configurations."""
    try:
        run_on_random_inputs(node)
    except Exception as error:  # tuning is an optimization: the trace goes on without it
        log.warning(
            "seqfast: %s was not tuned at its sizes (%s); its launches take their"
            " default configurations",
            node.name,
            str(error).splitlines()[0][:200],
        )


def _drop_argument_copies(gm: GraphModule) -> None:
    """Where Triton's analysis cannot tell which tensors a kernel writes (as under the
    interpreter), the traced launch writes copies of them all and copies those of the call's
    arguments back; the op writes none of its arguments, so the copies back are dropped."""
    graph = gm.graph
    for inner in list(graph.nodes):
        if inner.target is torch.ops.aten.copy_.default and inner.args[0].op == "placeholder":
            graph.erase_node(inner)
    graph.eliminate_dead_code()
    gm.recompile()


def _not_traceable(node: Node) -> str | None:
    if node.target._schema.is_mutable:
        return "it writes over an argument"
    return None


class Specializes(Exception):
    """A trace would fix a symbolic size to one value."""


@contextlib.contextmanager
def _no_specialization(fake_mode: Any) -> Iterator[None]:
    """Within it, a trace that would decide anything but a bound from a symbolic size (its
    `int()`, a branch on its equality) raises `Specializes` before the guard is kept: such a
    launcher stays a call, so the compile keeps serving every size instead of one per size.
    A bound (a size below 2**31, say) is kept as a guard, as Inductor keeps its own."""
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        yield
        return
    evaluate = shape_env.evaluate_expr

    def evaluate_bounds_only(expr, *args: Any, **kwargs: Any):
        if shape_env._maybe_evaluate_static(expr) is None and not _is_bound(expr):
            raise Specializes(str(expr))
        return evaluate(expr, *args, **kwargs)

    shape_env.evaluate_expr = evaluate_bounds_only
    try:
        yield
    finally:
        del shape_env.evaluate_expr  # (the method again)


def _is_bound(expr: Any) -> bool:
    """An inequality (`<`, `<=`, `>`, `>=`) between sizes and constants."""
    return isinstance(expr, sympy.Rel) and not isinstance(expr, sympy.Eq | sympy.Ne)


@contextlib.contextmanager
def _writes_known(node: Node) -> Iterator[None]:
    """Under the interpreter, Triton's analysis of what a traced launch writes always fails (it
    compiles the kernel, whose library functions the interpreter replaced), and torch then takes
    every argument for written: copies of them all, and of the views among them. There, a launch
    is taken to write the tensors it is given that are not (views of) the call's arguments: the
    op writes none of its arguments, so those are what its launcher allocated for it."""
    if not runtime.interpreting():
        yield
        return
    arguments = {
        StorageWeakRef(v.untyped_storage())
        for v in (a.meta.get("val") for a in node.all_input_nodes)
        if isinstance(v, torch.Tensor)
    }

    def written(kernel_idx, constant_args_idx, kwargs, tma_descriptor_metadata) -> list[str]:
        return [
            name
            for name, v in kwargs.items()
            if isinstance(v, torch.Tensor) and StorageWeakRef(v.untyped_storage()) not in arguments
        ]

    analysis = triton_kernel_wrap.get_mutated_tensors
    triton_kernel_wrap.get_mutated_tensors = written
    try:
        yield
    finally:
        triton_kernel_wrap.get_mutated_tensors = analysis
