"""The `seqfast` torch.compile backend: Dynamo's graph goes through six named stages (`STAGES`),

    capture -> normalize -> fuse -> differentiate -> plan_memory -> lower

each one package's work: capture returns a `Captured` graph (with the fake mode and inputs it was
traced at), normalize the same rewritten, fuse a `Fused` graph (with the sites it fused).
AOTAutograd drives the last three: `differentiate` hands it `plan_memory` as the partitioner, which
returns a `Plan`, and stage 6's `lower` (`lower/graphs.py`), which lowers that plan's graphs, as the
compilers (`Handoff` passes the plan from the one call to the others). `GraphCompile` holds only
what the stages are given, and the report they add notes to.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.exc import ShortenTraceback
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx import GraphModule, Node

from seqcompile import capture as capture_mod
from seqcompile.capture.as_captured import (
    as_captured,
    captured_if_first_call_fails,
    first_line,
    subclass_in,
)
from seqcompile.checks import structure, verify
from seqcompile.codegen.cache import check_cache_dir
from seqcompile.dump import GraphDump
from seqcompile.fx.nodes import has_symbols
from seqcompile.lower import choose_implementations
from seqcompile.lower.executor import Executor, default_rest, mode_settings, static_inputs
from seqcompile.lower.gradient_destination import GradientDestination
from seqcompile.lower.graphs import lower
from seqcompile.memory.passes import PASSES, Plan, plan_inference
from seqcompile.normalize import normalize_graph
from seqcompile.options import OptionError, Options
from seqcompile.patterns import builtin_patterns
from seqcompile.patterns.engine import FuseContext, run_patterns
from seqcompile.patterns.pointwise import fuse_regions
from seqcompile.patterns.user import apply_user_patterns
from seqcompile.report import CompileReport, publish
from seqcompile.run import collective_inputs

log = logging.getLogger("seqcompile")
_graph_ids = itertools.count()


@dataclasses.dataclass
class GraphCompile:
    """What one compile is given before its stages run, and the report they add notes to."""

    name: str
    options: Options
    rest: str
    example_inputs: Sequence[Any]
    dump: GraphDump
    executor: Executor
    """What compiles the planned graphs (`rest`, under torch.compile's mode)."""
    report: CompileReport = dataclasses.field(default_factory=CompileReport)
    fuse_only: frozenset[str] | None = None
    """Keys of the sites the fuse stage may fuse (None: every site it can)."""


@dataclasses.dataclass(frozen=True)
class Captured:
    """What capture returns, and normalize after rewriting `gm`: the graph, the fake mode its
    values live in, the inputs it was traced at, and whether it draws random numbers (so `verify`
    cannot compare it with eager)."""

    gm: GraphModule
    fake_mode: Any
    fake_inputs: list[Any]
    draws_random: bool


@dataclasses.dataclass(frozen=True)
class Fused(Captured):
    """What fuse returns: the captured graph with fused calls, and the sites it fused (key to
    place in the source), which `verify` narrows."""

    sites: dict[str, str]


def capture(gm: GraphModule, state: GraphCompile) -> Captured:
    """Stage 1: pre-dispatch ATen under Dynamo's fake mode, symbolic sizes kept."""
    fake_mode, fake_inputs = capture_mod.fake_inputs(state.example_inputs)
    traced = capture_mod.trace_pre_dispatch(gm, fake_mode, fake_inputs)
    draws_random = verify.draws_random_numbers(traced)
    state.report.missed += traced.meta.pop("capture_notes")
    return Captured(traced, fake_mode, fake_inputs, draws_random)


def normalize(captured: Captured, state: GraphCompile) -> Captured:
    """Stage 2: one spelling per idea."""
    fired = normalize_graph(captured.gm, captured.fake_mode, report=state.report)
    log.debug("%s: normalization rules fired: %s", state.name, dict(fired))
    return captured


def fuse(captured: Captured, state: GraphCompile) -> Fused:
    """Stage 3: user patterns, then the built-in families, then the pointwise region fuser replace
    sub-graphs with seqfast ops and render their kernels; refusals go to the report."""
    training = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in state.example_inputs
    )
    gm = captured.gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    grad_inputs = frozenset(
        node
        for node, example in zip(placeholders, state.example_inputs, strict=False)
        if isinstance(example, torch.Tensor) and example.requires_grad
    )
    ctx = FuseContext(
        gm,
        captured.fake_mode,
        state.report,
        training,
        grad_inputs,
        state.options,
        fuse_only=state.fuse_only,
        static_values=_static_values(placeholders, state),
    )
    apply_user_patterns(ctx)
    run_patterns(builtin_patterns(), ctx)
    fuse_regions(ctx)
    return Fused(gm, captured.fake_mode, captured.fake_inputs, captured.draws_random, ctx.sites)


def _static_values(placeholders: list[Node], state: GraphCompile) -> dict[Node, torch.Tensor]:
    """The inputs Dynamo marks static (parameters and buffers) that hold values: plain tensors,
    not meta, fake or a subclass. Not copied: an evaluation reads what it needs where they are."""
    values = {}
    for i in state.executor.static_inputs:
        example = state.example_inputs[i] if i < len(placeholders) else None
        plain = type(example) in (torch.Tensor, torch.nn.Parameter)
        if plain and example.device.type != "meta":
            values[placeholders[i]] = example.detach()
    return values


def differentiate(fused: Fused, state: GraphCompile) -> Callable[..., Any]:
    """Stage 4: AOTAutograd traces forward and backward; fused ops enter both as opaque calls. It
    then calls stage 5 as its partitioner and stage 6 as its compilers (see `Handoff`). An input
    that is, or holds, a collective's pending result is waited for before each call; a pending
    local tensor is traced as the tensor it waits for (`run/collective_inputs.py`)."""
    decompositions = None
    if state.rest == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        decompositions = select_decomp_table()
    handoff = Handoff(state, fused.fake_mode)
    pending = collective_inputs.pending(state.example_inputs)
    compiled = aot_module_simplified(
        fused.gm,
        collective_inputs.as_waited(state.example_inputs, fused.fake_inputs, pending),
        fw_compiler=handoff.lower_forward,
        bw_compiler=handoff.lower_backward,
        inference_compiler=handoff.lower_inference,
        partition_fn=handoff.plan_memory,
        decompositions=decompositions,
    )
    return collective_inputs.waiting(compiled, state.example_inputs, pending)


def plan_memory(
    joint: GraphModule,
    joint_inputs: Any,
    *,
    state: GraphCompile,
    fake_mode: Any,
    num_fwd_outputs: int,
    **kwargs: Any,
) -> Plan:
    """Stage 5: the joint graph becomes the forward and backward graphs through `PASSES` (see
    `memory/passes.py`), each dumped with its notes; returns the plan stage 6 lowers."""
    state.dump.stage("differentiate", joint)
    plan = Plan(joint, joint_inputs, fake_mode, num_fwd_outputs, kwargs)
    for name, run in PASSES:
        notes = run(plan, state)
        state.dump.plan_pass(name, notes, plan.graphs)
    state.report.variants += [f"{state.name}: {variant}" for variant in plan.variants]
    graphs = [(plan.forward, "forward"), (plan.backward, "backward")]
    if plan.accumulation is not None:
        graphs.append((plan.accumulation.returning, "backward to autograd"))
    for gm, direction in graphs:
        where = (state.name, direction)
        choose_implementations(gm, fake_mode, state.options, state.rest, state.report, where)
    return plan


@dataclasses.dataclass
class Handoff:
    """AOTAutograd calls stage 5 as its partitioner, then stage 6 as the forward's compiler and,
    at the first backward, the backward's: this hands the plan stage 5 returned to stage 6, and
    with `accumulate_grads` the run-time `GradientDestination` the forward and backward calls
    share. A graph with no backward goes to its compiler alone, through stage 5 first. Stage 5
    works in `fake_mode`, the one capture traced the graph in."""

    state: GraphCompile
    fake_mode: Any
    plan: Plan | None = None
    destination: GradientDestination | None = None

    def plan_memory(self, joint: GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.plan = plan_memory(
            joint, joint_inputs, state=self.state, fake_mode=self.fake_mode, **kwargs
        )
        if (accumulation := self.plan.accumulation) is not None:
            self.destination = GradientDestination(
                self.state.name, accumulation.inputs, accumulation.arguments
            )
        return self.plan.forward, self.plan.backward

    def lower_forward(self, gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return lower(gm, example_inputs, self.state, "forward", destination=self.destination)

    def lower_backward(self, gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        accumulation = self.plan.accumulation
        returning = None if accumulation is None else accumulation.returning
        return lower(gm, example_inputs, self.state, "backward", returning, self.destination)

    def lower_inference(self, gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        planned = plan_inference(gm, self.fake_mode, self.state)
        state = self.state
        where = (state.name, "inference")
        choose_implementations(
            planned, self.fake_mode, state.options, state.rest, state.report, where
        )
        return lower(planned, example_inputs, state, "inference")


STAGES = (capture, normalize, fuse, differentiate, plan_memory, lower)
"""The six stages in the order data flows, one package each (`capture/`, `normalize/`,
`patterns/`, AOTAutograd, `memory/`, `lower/`). The first three run in turn on Dynamo's graph,
each taking the value the one before returned, and differentiate returns the compiled callable:
it hands the last two to AOTAutograd, which calls them back (`CALLED_BACK`): `plan_memory` as its
partitioner, `lower` as its compilers (through `Handoff`)."""
CALLED_BACK = (plan_memory, lower)


class _PassThroughOptionError(ShortenTraceback, OptionError):
    """Dynamo wraps backend errors in BackendCompilerFailed, except ShortenTraceback ones: this
    lets `torch.compile` callers catch a bad option as the ValueError it is."""


def _configure_log(level: str) -> None:
    """Set the level; print to stderr unless something (e.g. TORCH_LOGS) already handles it."""
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[seqcompile] %(message)s"))
        log.addHandler(handler)


def seqfast(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The backend Dynamo calls (registered as "seqfast" through the `torch_dynamo_backends` entry
    point). `options` come from `torch.compile(..., options=...)`; `mode` (torch.compile's) sets
    Inductor's settings for the graphs it compiles (`lower/executor.py`)."""
    # Dynamo calls a backend at the compiled function's first call, not at torch.compile: the
    # options, and the folders they and SEQFAST_CACHE_DIR name, are checked here, before any work
    try:
        opts = Options.resolve(options)
        settings = mode_settings(mode)
        if not opts.disable:
            check_cache_dir()
    except OptionError as error:
        raise _PassThroughOptionError(str(error), first_useful_frame=None) from None
    if opts.log is not None:
        _configure_log(opts.log)
    if opts.disable:
        return gm.forward
    name = f"graph_{next(_graph_ids)}"
    try:
        compiled, state, fused = _compile(gm, example_inputs, opts, name=name, settings=settings)
    except capture_mod.Uncompilable as reason:
        return as_captured(gm, str(reason), name)
    except Exception as error:  # on a tensor subclass the stages do not know, never a crash
        subclass = subclass_in(gm, example_inputs)
        if subclass is None:
            raise
        return as_captured(gm, f"it holds a {subclass}, on which {first_line(error)}", name)
    if opts.verify:
        compiled = _verify(gm, opts, compiled, state, fused)
    subclass = subclass_in(gm, example_inputs)
    if subclass is not None:
        compiled = captured_if_first_call_fails(compiled, gm, name, subclass)
    _release(state)
    state.report.graphs.append(state.name)
    state.dump.report(state.report)
    publish(state.report)
    log.info("%s compiled:\n%s", state.name, state.report)
    return compiled


def _compile(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    opts: Options,
    fuse_only: frozenset[str] | None = None,
    name: str | None = None,
    settings: dict[str, Any] | None = None,
) -> tuple[Callable[..., Any], GraphCompile, Fused]:
    """The stages, run on Dynamo's graph; `fuse_only` limits which sites are fused, `settings`
    are Inductor's for torch.compile's mode. Returns the compiled graph, what the compile was
    given (with its report) and what fuse returned."""
    name = name or f"graph_{next(_graph_ids)}"
    rest = opts.rest or default_rest(example_inputs)
    state = GraphCompile(
        name=name,
        options=opts,
        rest=rest,
        executor=Executor(
            rest,
            dict(settings or {}),
            static_inputs(gm),
            len(gm.graph.find_nodes(op="placeholder")),
        ),
        example_inputs=example_inputs,
        dump=GraphDump(opts.dump_dir, name),
        fuse_only=fuse_only,
    )
    state.dump.stage("dynamo", gm)
    state.dump.rerun(gm, example_inputs, opts)
    shape = structure.signature(gm, meta_key="example_value")
    value: Any = gm
    try:
        for stage in STAGES:
            if stage in CALLED_BACK:  # AOTAutograd calls them, from differentiate
                continue
            result = stage(value, state)
            if not isinstance(result, Captured):  # differentiate's compiled callable
                return result, state, value
            value = result
            state.dump.stage(stage.__name__, value.gm)
            shape = structure.check(stage.__name__, value.gm, shape)
        raise AssertionError(f"no stage of {STAGES} returned a compiled callable")
    except BaseException as error:
        state.dump.unfinished(error)
        raise


def _release(state: GraphCompile) -> None:
    """The lazily compiled backward keeps `state` alive: drop the first call's inputs from it."""
    state.example_inputs = ()


def _verify(
    gm: GraphModule,
    opts: Options,
    compiled: Callable[..., Any],
    state: GraphCompile,
    fused: Fused,
) -> Callable[..., Any]:
    """`compiled`, compared with Dynamo's graph on its first call's inputs (`checks/verify.py`);
    recompiled without the fused sites that made them differ, quietly, at the symbolic sizes
    where the sizes are symbolic, so the result serves every size."""
    quiet = dataclasses.replace(opts, dump_dir=None, verify=False)
    symbolic = list(fused.fake_inputs) if has_symbols(fused.fake_inputs) else None

    def recompile(only: frozenset[str] | None, args: Sequence[Any]) -> verify.Recompiled:
        name = f"{state.name}_without_some_sites"
        settings = state.executor.settings
        again, again_state, again_fused = _compile(
            gm, symbolic or args, quiet, only, name=name, settings=settings
        )
        _release(again_state)
        return again, again_state.report, again_fused.sites

    return verify.on_first_call(gm, compiled, state, fused, recompile)
