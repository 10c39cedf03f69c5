"""Stage 5, plan memory, as a named list of passes over AOTAutograd's joint graph:

    joint_passes -> budget -> partition -> gradient_sums -> in_place -> accumulation
    -> loss_chunks -> memory_analysis

Each pass takes the `Plan` (the joint graph, then the forward and backward graphs) and returns
notes: which variant a fused op's backward took, what the budget chose. The backend dumps the
graphs after every pass, with its notes, in this order.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection
from typing import Any, Protocol

import torch
from torch.fx import GraphModule, Node

from seqcompile.checks import structure
from seqcompile.codegen import KernelSpec, prepare_kernel
from seqcompile.fx.nodes import fake_values, site_name
from seqcompile.memory import accumulate, budget, norm_outputs
from seqcompile.memory.cost import node_cost, roofline_for, total_cost
from seqcompile.memory.gradient_sums import fold_gradient_sums
from seqcompile.memory.in_place import write_over_saved
from seqcompile.memory.liveness import step_memory
from seqcompile.memory.loss_chunks import choose as chosen_chunks
from seqcompile.memory.partition import choose_partitioner, partition, torch_budget
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call
from seqcompile.options import Options
from seqcompile.report import CompileReport, KernelUse, MemoryPlan

aten = torch.ops.aten
log = logging.getLogger("seqcompile")


class Compile(Protocol):
    """What the passes read of the compile they serve: what it was given, and the report they
    add to."""

    name: str
    options: Options
    rest: str
    example_inputs: Any
    report: CompileReport


@dataclasses.dataclass
class Plan:
    """The graphs stage 5 works on and what its passes found on the way; stage 5 returns it, and
    stage 6 lowers its forward and backward (as AOTAutograd hands them over) with `accumulation`."""

    joint: GraphModule
    joint_inputs: Any
    fake_mode: Any
    """The fake mode the graphs' values live in (the one capture traced the graph in)."""
    num_fwd_outputs: int
    partition_args: dict[str, Any]
    forward: GraphModule | None = None
    backward: GraphModule | None = None
    joint_forward: set[str] = dataclasses.field(default_factory=set)
    """Names of the joint graph's forward nodes (a backward node so named is recomputed)."""
    recompute: budget.RecomputePlan | None = None
    strategy: str = ""
    signatures: list[Any] = dataclasses.field(default_factory=list)
    written_over: dict[str, int] = dataclasses.field(default_factory=dict)
    variants: list[str] = dataclasses.field(default_factory=list)
    """Fused ops whose backward took another variant than the one autograd traced: the node
    and which variant."""
    accumulation: accumulate.Accumulation | None = None
    """With `accumulate_grads`: which parameters add their gradients into `.grad`, and the
    backward that returns them instead."""

    @property
    def graphs(self) -> list[GraphModule]:
        return [self.joint] if self.forward is None else [self.forward, self.backward]


Pass = Callable[[Plan, Compile], list[str]]


def joint_passes(plan: Plan, state: Compile) -> list[str]:
    """The executor's own passes over the joint graph."""
    plan.joint = checked_joint_passes("differentiate", plan.joint, plan.fake_mode, state)
    plan.joint_forward = {n.name for n in budget.forward_nodes(plan.joint)}
    return [] if state.rest != "inductor" else ["Inductor's joint-graph passes ran"]


def memory_budget(plan: Plan, state: Compile) -> list[str]:
    """With `checkpoint="auto"`, tag what the backward recomputes: what is cheap (no FLOPs) and
    frees kept bytes, and under a memory budget whatever else it takes to fit."""
    options = state.options
    if options.checkpoint != "auto":
        return []
    roofline = roofline_for(_device(state))
    offers = norm_outputs.offer(plan.joint, budget.forward_nodes(plan.joint), plan.fake_mode)
    found = budget.plan_recompute(plan.joint, plan.num_fwd_outputs, options.memory_budget, roofline)
    norm_outputs.withdraw(offers, found.recomputed)
    plan.joint_forward |= {n.name for n in budget.forward_nodes(plan.joint)}  # offers taken
    plan.recompute = found
    if not found.reachable:
        log.warning(
            "%s: memory budget %s (%d bytes) is not reachable; the plan keeps %d bytes",
            state.name,
            found.budget,
            found.target_bytes,
            found.planned_bytes,
        )
    return [f"recompute {len(found.recomputed)} nodes to keep {found.planned_bytes} bytes"]


def split(plan: Plan, state: Compile) -> list[str]:
    """The partitioner splits the joint graph into the forward and the backward."""
    options = state.options
    plan.strategy = choose_partitioner(options.partition, options.checkpoint, state.rest)
    with torch_budget(plan.joint, options):
        plan.forward, plan.backward = partition(
            plan.joint,
            plan.joint_inputs,
            strategy=plan.strategy,
            num_fwd_outputs=plan.num_fwd_outputs,
            **plan.partition_args,
        )
    plan.signatures = [structure.signature(g, paths=False) for g in plan.graphs]
    return [f"partitioner {plan.strategy}"]


def gradient_sums(plan: Plan, state: Compile) -> list[str]:
    """Region backwards add the gradient terms autograd would sum before them."""
    folded = fold_gradient_sums(plan.backward)
    plan.variants += folded
    return folded


def in_place(plan: Plan, state: Compile) -> list[str]:
    """Backward ops with an in-place twin write over saved tensors only they read."""
    if not state.options.reuse_saved:
        return []
    plan.written_over = write_over_saved(plan.forward, plan.backward, plan.num_fwd_outputs)
    swapped = [
        f"{name}: in-place variant, writes its result over a saved tensor ({size} bytes)"
        for name, size in plan.written_over.items()
    ]
    plan.variants += swapped
    return swapped


def accumulation(plan: Plan, state: Compile) -> list[str]:
    """With `accumulate_grads`, parameter gradients are added into `.grad` where they are made;
    the forward saves the parameters, and the backward that returns them is kept beside."""
    if not state.options.accumulate_grads:
        return []
    # the forward returns more saved tensors after this pass: check what it computed until now
    structure.check("plan_memory", plan.forward, plan.signatures[0])
    accumulation = accumulate.accumulate_into_grads(
        plan.forward, plan.backward, plan.num_fwd_outputs, parameter_positions(state)
    )
    plan.signatures[0] = structure.signature(plan.forward, paths=False)
    if not accumulation.positions:
        return ["no parameter among the inputs has a gradient: nothing accumulates"]
    plan.accumulation = accumulation
    hooked = [
        f"{name}: variant whose parameter gradients its accumulation hook adds into .grad"
        for name in accumulation.hooked
    ]
    two = (
        "backward: adds the parameters' gradients into .grad; a call whose gradients autograd"
        " must get (hooks, autograd.grad, DDP's synchronized step) runs the backward as traced"
    )
    plan.variants += [two, *hooked]
    return [f"inputs {list(accumulation.positions)} accumulate into their .grad", two, *hooked]


def loss_chunks(plan: Plan, state: Compile) -> list[str]:
    """On a GPU, the chunk of each linear + loss call that leaves it to seqcompile: as many even
    chunks as fill the device, within the step's planned peak (`memory/loss_chunks.py`)."""
    redone = budget.recomputed_in(plan.backward, plan.joint_forward)
    parameters = {f"primals_{i + 1}" for i in parameter_positions(state)}

    def peak() -> int:
        graphs = (plan.forward, plan.backward, plan.num_fwd_outputs)
        return step_memory(*graphs, parameters, redone).peak_bytes

    return chosen_chunks(plan.forward, peak)


def memory_analysis(plan: Plan, state: Compile) -> list[str]:
    """Check the final graphs, then record the step's memory and the kernels they launch."""
    for graph, signature in zip(plan.graphs, plan.signatures, strict=True):
        structure.check("plan_memory", graph, signature)
    redone = budget.recomputed_in(plan.backward, plan.joint_forward)
    parameters = {f"primals_{i + 1}" for i in parameter_positions(state)}
    step = step_memory(plan.forward, plan.backward, plan.num_fwd_outputs, parameters, redone)
    roofline = roofline_for(_device(state))
    seconds = sum(node_cost(n).seconds(roofline) for g in plan.graphs for n in g.graph.nodes)
    state.report.memory.append(
        MemoryPlan(
            state.name,
            plan.strategy,
            step,
            sum(plan.written_over.values()),
            plan.recompute,
            total_cost(redone),
            seconds,
        )
    )
    list_kernels(plan.forward, "forward", plan.fake_mode, state)
    list_kernels(plan.backward, "backward", plan.fake_mode, state)
    if plan.accumulation is not None:  # what a call handing gradients to autograd adds
        listed = {use.spec for use in state.report.kernels if use.graph == state.name}
        returning = plan.accumulation.returning
        list_kernels(returning, "backward to autograd", plan.fake_mode, state, listed)
    return [f"kept for the backward: {step.kept_bytes} bytes; peak {step.peak_bytes} bytes"]


PASSES: tuple[tuple[str, Pass], ...] = (
    ("joint_passes", joint_passes),
    ("budget", memory_budget),
    ("partition", split),
    ("gradient_sums", gradient_sums),
    ("in_place", in_place),
    ("accumulation", accumulation),
    ("loss_chunks", loss_chunks),
    ("memory_analysis", memory_analysis),
)
"""Stage 5's passes in the order they run, by the name their dump file carries."""


def plan_inference(gm: GraphModule, fake_mode: Any, state: Compile) -> GraphModule:
    """Stage 5 for a graph with no backward (AOTAutograd calls no partitioner for it): the
    executor's joint passes, and the kernels it launches listed."""
    gm = checked_joint_passes("plan_memory", gm, fake_mode, state)
    list_kernels(gm, "inference", fake_mode, state)
    return gm


def list_kernels(
    gm: GraphModule,
    direction: str,
    fake_mode: Any,
    state: Compile,
    listed: Collection[KernelSpec] = (),
) -> None:
    """Render the kernels the fused ops of `gm` launch and list them in the report, each with
    the node and source line it runs for (but those `listed` already)."""
    for node in gm.graph.nodes:
        entry = registry.entry_of(node)
        if entry is None:
            continue
        _give_values(node.all_input_nodes, fake_mode)
        call = Call.of(node)
        label = entry.label_of(call)
        if node.target is entry.forward and entry.describe is not None:
            description = entry.describe(call)
            if description:
                state.report.sites.append(f"{state.name} {label}: {site_name(node)}: {description}")
        state.report.saves.setdefault(entry.name, entry.saves)
        for spec in registry.kernels_of(node):
            if spec in listed:
                continue
            use = KernelUse(
                prepare_kernel(spec), spec, state.name, direction, label, node.name, site_name(node)
            )
            state.report.add_kernel(use)


def _give_values(nodes: list[Node], fake_mode: Any) -> None:
    """Fake values for nodes the partitioner made without one (a random op recomputed with
    its forward's generator state), so the kernels reading them are specialized as at run
    time."""
    for node in nodes:
        if "val" not in node.meta and node.op == "call_function":
            with fake_mode:
                node.meta["val"] = node.target(*fake_values(node.args), **fake_values(node.kwargs))


def checked_joint_passes(
    stage: str, gm: GraphModule, fake_mode: Any, state: Compile
) -> GraphModule:
    """The executor's joint passes on AOTAutograd's graph, with the structural check after."""
    given = structure.signature(gm, paths=False)
    gm = _executor_joint_passes(gm, fake_mode, state)
    structure.check(stage, gm, given)
    return gm


def _executor_joint_passes(gm: GraphModule, fake_mode: Any, state: Compile) -> GraphModule:
    """Inductor lowers a forward or backward graph only after its passes over the joint graph
    (random ops, for one, become its own seeded ops); they run here, where Inductor's own
    partitioner would run them. Where the graph still holds attention-shaped math (a batched
    matmul and a softmax seqfast did not fuse), the passes run without Inductor's pattern
    matcher: its rewrite of such math into SDPA takes a softmax over another dim for one over
    the keys and computes something else."""
    if state.rest != "inductor":
        return gm
    from torch._inductor import config
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.virtualized import V

    with V.set_fake_mode(fake_mode), config.patch(pattern_matcher=not _attention_shaped(gm)):
        return joint_graph_passes(gm) or gm


_SOFTMAX_PARTS = (aten.amax.default, aten._softmax.default, aten._safe_softmax.default)


def _attention_shaped(gm: GraphModule) -> bool:
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    return aten.bmm.default in targets and any(t in targets for t in _SOFTMAX_PARTS)


def parameter_positions(state: Compile) -> list[int]:
    return [i for i, t in enumerate(state.example_inputs) if isinstance(t, torch.nn.Parameter)]


def _device(state: Compile) -> torch.device | None:
    return next((t.device for t in state.example_inputs if isinstance(t, torch.Tensor)), None)
