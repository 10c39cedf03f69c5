"""Measuring a fused call's candidate implementations at its traced sizes: each runs on random
inputs on the call's device, is checked against the call's lowering run op by op (plain ATen, the
answer every path must give), and only then timed. A candidate that disagrees, or fails to compile
or run, is never timed; its disagreement or its error is the reason it was left out.

The timer is injected (`Measurer`): on CUDA Triton's `do_bench` median and the bytes allocated
while a candidate runs; tests give their own."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node
from torch.utils._pytree import tree_flatten, tree_map

from seqcompile.fx.nodes import concrete
from seqcompile.lower.inline import Traced, traced_body
from seqcompile.ops import registry

log = logging.getLogger("seqcompile")

Run = Callable[[], Any]

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
"""The largest difference from the reference a candidate's float output may have, relative to the
reference's largest finite magnitude (at least 1): loose enough for another order of summation,
tight enough for a wrong mask or a missing term."""


@dataclasses.dataclass(frozen=True)
class Measurer:
    """How candidates are timed: `time(name, run)` in milliseconds, and `allocated(name, run)`
    the bytes allocated while `run` runs beyond what it started with (None: not measured); `name`
    is the candidate's ("kernel", "lowering", "vendor")."""

    time: Callable[[str, Run], float]
    allocated: Callable[[str, Run], int] | None = None


def cuda_measurer() -> Measurer:
    """Triton's median over repeated runs, and the CUDA caching allocator's peak."""
    import triton.testing

    def time(name: str, run: Run) -> float:
        return triton.testing.do_bench(run, warmup=5, rep=25, return_mode="median")

    def allocated(name: str, run: Run) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    return Measurer(time, allocated)


@dataclasses.dataclass(frozen=True)
class Measured:
    """What measuring found: each candidate's time (ms) and bytes allocated, and the candidates
    left out with the reason."""

    times: dict[str, float]
    allocated: dict[str, int]
    rejected: dict[str, str]


def measure(
    node: Node,
    fake_mode: Any,
    compile_body: Callable[[Traced], Callable],
    measurer: Measurer,
    launches: Traced | None = None,
    bodies: Sequence[str] = ("lowering",),
) -> Measured:
    """Check and time, on one set of random inputs at `node`'s traced sizes, the kernels and each
    of `bodies` (traced, then compiled as the executor compiles them: `compile_body`); the kernels
    as their traced `launches` compiled the same way where given (what the executor runs), else
    the op as called."""
    traced = traced_body(node, fake_mode)
    entry = registry.entry_of(node)
    compared = entry.compared.get(node.target, lambda result: result)
    with unset_fake_temporarily():
        inputs = {arg: _random_like(arg.meta["val"]) for arg in dict.fromkeys(traced.inputs)}
        ordered = [inputs[arg] for arg in traced.inputs]
        candidates: dict[str, Callable[[], Run]] = {
            "kernel": (lambda: _called(node, inputs))
            if launches is None
            else (lambda: _boxed(compile_body(launches), ordered)),
        }
        for kind in bodies:
            candidates[kind] = lambda kind=kind: _boxed(
                compile_body(traced_body(node, fake_mode, kind)), ordered
            )
        reference = compared(traced.gm(*ordered))
        times, allocated, rejected = {}, {}, {}
        for name, make in candidates.items():
            try:
                run = make()
                result = run()
            except Exception as error:  # (any failure leaves the candidate out, and says so)
                log.warning("seqfast: %s of %s fails: %s", name, node.target, error)
                rejected[name] = f"fails: {type(error).__name__}: {str(error)[:200]}"
                continue
            problem = disagreement(compared(result), reference)
            if problem is not None:
                rejected[name] = f"differs from the reference: {problem}"
                continue
            times[name] = measurer.time(name, run)
            if measurer.allocated is not None:
                allocated[name] = measurer.allocated(name, run)
    return Measured(times, allocated, rejected)


def run_on_random_inputs(node: Node) -> None:
    """Call the op of `node` once on random inputs at its traced sizes: on CUDA its kernels'
    launch configurations are tuned at those sizes on the way, so a trace of its launches
    (`lower/inline.py`), which times nothing, finds them chosen."""
    with unset_fake_temporarily():
        inputs = {arg: _random_like(arg.meta.get("val")) for arg in node.all_input_nodes}
        _called(node, inputs)()


def compiled_by_inductor(traced: Traced) -> Callable[[list[Any]], Any]:
    """`traced` compiled by Inductor alone, in a tracing context of its own (the compile it is
    measured for keeps its own output strides and metadata), on a copy of its graph."""
    from torch._inductor.compile_fx import compile_fx_inner

    graph = torch.fx.Graph()
    result = graph.graph_copy(traced.gm.graph, {})  # (the trace stays as it is: it is shared)
    single = not isinstance(result, tuple | list)
    graph.output((result,) if single else result)  # Inductor's inner compile returns a tuple
    gm = torch.fx.GraphModule(traced.gm, graph)
    fakes = [p.meta["val"] for p in gm.graph.find_nodes(op="placeholder")]
    fake_mode = next(f.fake_mode for f in fakes if isinstance(f, torch.Tensor))
    with tracing(TracingContext(fake_mode)):
        compiled = compile_fx_inner(gm, fakes)
    return (lambda inputs: compiled(inputs)[0]) if single else compiled


def run_as_traced(traced: Traced) -> Callable[[list[Any]], Any]:
    """`traced` run op by op (what the eager executor does with a lowering)."""
    return lambda inputs: traced.gm(*inputs)


def disagreement(got: Any, want: Any) -> str | None:
    """Where `got` differs from the reference `want` beyond `TOLERANCE` (None: it agrees): as
    many values, the same shapes and dtypes, equal integers, the same elements finite, the same
    infinities, and finite values close."""
    got_leaves, want_leaves = tree_flatten(got)[0], tree_flatten(want)[0]
    if len(got_leaves) != len(want_leaves):  # (a list or a tuple alike: Inductor returns lists)
        return f"returns {len(got_leaves)} values where the reference returns {len(want_leaves)}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            want = f"{w.dtype} {tuple(w.shape)}"
            return f"output {i} is {g.dtype} {tuple(g.shape)} where it should be {want}"
        if not w.dtype.is_floating_point:
            if not torch.equal(g, w):
                return f"output {i} differs"
            continue
        tolerance = TOLERANCE.get(w.dtype, TOLERANCE[torch.float32])
        g, w = g.double(), w.double()
        finite = w.isfinite()
        if not torch.equal(finite, g.isfinite()):
            return f"output {i} is finite at other elements"
        if not torch.equal(g[~finite].nan_to_num(), w[~finite].nan_to_num()):
            return f"output {i} has other infinities"
        if not finite.any():
            continue
        error = (g[finite] - w[finite]).abs().max().item()
        scale = max(1.0, w[finite].abs().max().item())
        if error > tolerance * scale:
            return f"output {i} by {error:.3g} (largest value {scale:.3g})"
    return None


def _called(node: Node, inputs: dict[Node, Any]) -> Run:
    """The op of `node` called on `inputs` (its other arguments as the graph gives them)."""
    args, kwargs = tree_map(
        lambda a: inputs.get(a, a) if isinstance(a, Node) else a, (node.args, node.kwargs)
    )
    return lambda: node.target(*args, **kwargs)


def _boxed(compiled: Callable[[list[Any]], Any], inputs: Sequence[Any]) -> Run:
    return lambda: compiled(list(inputs))  # (a boxed callable empties the list it is given)


def _random_like(value: Any) -> Any:
    """A real value for a fake one, at its concrete sizes: floats from a normal distribution,
    integers zero (a valid index, position or seed), booleans True (every score kept)."""
    if not isinstance(value, torch.Tensor):
        return concrete(value) if isinstance(value, torch.SymInt) else value
    shape = [concrete(s) for s in value.shape]
    strides = [concrete(s) for s in value.stride()]
    out = torch.empty_strided(shape, strides, dtype=value.dtype, device=value.device)
    if value.dtype.is_floating_point:
        return out.normal_()
    return out.fill_(value.dtype == torch.bool)
