"""The program of a fused pointwise region: its forward traced to post-dispatch ATen with dropout
written as a mask input, the backward derived by tracing `torch.autograd.grad` through that forward,
and a process-wide registry that `seqfast::pointwise` looks regions up in by key.

Both graphs are traced on one-dimensional stand-ins of the region's inputs (every input expanded
to the region's shape), so the backward never reduces: the gradient of a broadcast input comes out
full-size and is summed to the input's shape by the caller.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence

import torch
from torch._decomp import core_aten_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functionalize
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import make_fx

from seqcompile.codegen.pointwise import PRINTABLE
from seqcompile.fx.custom_function import apply_one
from seqcompile.fx.nodes import in_own_thread

aten = torch.ops.aten
_STAND_IN = (2,)
"""Shape of every input while tracing: pointwise math does not depend on it."""
_IDENTITY = (
    aten.detach.default,
    aten.detach_copy.default,
    aten.alias_copy.default,
    aten.alias.default,
    aten.clone.default,
    aten.lift_fresh_copy.default,
)

_FILLS = {aten.zeros.default: 0, aten.ones.default: 1, aten._efficientzerotensor.default: 0}
"""Factories of a constant at a size, with their value (`full` and `full_like`: an argument)."""
_EMPTY = (aten.empty.memory_format, aten.empty_permuted.default, aten.empty_strided.default)


def _made_at_stand_in_size(node: Node) -> bool:
    """A constant the trace made at the stand-ins' size: a fill, `full`, or `full_like` of an
    empty tensor so made."""
    if node.op != "call_function":
        return False
    if node.target is aten.full_like.default:
        made = node.args[0]
        return made.op == "call_function" and made.target in _EMPTY and made.args[0] == [*_STAND_IN]
    fills = node.target in _FILLS or node.target is aten.full.default
    return fills and node.args[0] == [*_STAND_IN]


@dataclasses.dataclass(frozen=True)
class Region:
    """A fused pointwise region, shared by every site with the same math."""

    key: str
    forward: GraphModule
    """Placeholders: the region inputs, then one bool keep-mask per dropout; returns the outputs.
    Ops the kernel printer does not spell are written in terms of those it does (torch's
    decompositions)."""
    written: GraphModule
    """The same, each op as the program calls it (`softplus`, `lerp`, not their decompositions):
    what the reference computes, in float64 where torch's float32 kernels depend on the machine
    (`wide_evaluation`)."""
    input_dtypes: tuple[torch.dtype, ...]
    """Dtypes of the inputs when the region was captured (the graph is traced with them)."""
    weak: tuple[bool, ...]
    """Which inputs take part in type promotion as 0-d tensors do (weakly): 0-d inputs, and
    linear biases moved into the region (eager's linear casts them to the matmul's dtype)."""
    dropout_p: tuple[float, ...]
    """Drop probability of each dropout, in the order of the mask placeholders."""
    name: str | None = None
    """The user pattern the region is a match of (its kernels carry the name)."""
    program: GraphModule | None = None
    """The region's program before tracing, where it calls a custom autograd.Function: the
    backward is traced through it, so the Function's own backward is what the kernel computes."""

    @property
    def num_inputs(self) -> int:
        return len(self.input_dtypes)


@dataclasses.dataclass(frozen=True)
class InputGrad:
    """How the backward produces one input's gradient: none, an incoming output gradient passed
    through unchanged, or a value the backward kernel computes."""

    kind: str  # "none" | "passthrough" | "computed"
    index: int = -1
    """Which output gradient (passthrough) or which computed value (computed)."""


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The derived backward of a region for one set of inputs needing and outputs carrying grads."""

    graph: GraphModule
    """Placeholders: region inputs, keep-masks, the terms of the output gradients; returns
    `computed`."""
    computed: tuple[Node, ...]
    """Distinct gradient values the kernel writes."""
    input_grads: tuple[InputGrad, ...]
    """One per region input."""
    saved: tuple[bool, ...]
    """Which region inputs the backward reads (the forward keeps only these)."""
    sums: tuple[int, ...]
    """For each output in `written`, the index in `computed` of its summed gradient."""


class UnsupportedRegion(Exception):
    """The region cannot be traced or printed; the message says why."""


_registry: dict[str, Region] = {}


def lookup(key: str) -> Region:
    try:
        return _registry[key]
    except KeyError:
        raise RuntimeError(
            f"seqfast::pointwise: region {key!r} is not registered in this process; regions are "
            "registered when a graph that uses them is compiled"
        ) from None


StandIn = tuple[torch.dtype, bool]
"""A traced input: its dtype and whether it requires grad."""


def _clean(gm: GraphModule) -> GraphModule:
    """Drop identity ops and dead code from a traced graph; a constant made at the stand-ins'
    shape (a decomposition's `zeros`) becomes a 0-d one, which broadcasts at any shape."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _IDENTITY:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif _made_at_stand_in_size(node):
            value = _FILLS[node.target] if node.target in _FILLS else node.args[1]
            dtype = node.meta["val"].dtype
            with gm.graph.inserting_before(node):
                scalar = gm.graph.call_function(
                    aten.scalar_tensor.default, (value,), {"dtype": dtype}
                )
            scalar.meta["val"] = node.meta["val"].new_empty(()).to(dtype)
            node.replace_all_uses_with(scalar)
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


@functools.cache
def _decompositions() -> dict:
    """Torch's decompositions into core ATen of the ops the Triton printer does not spell itself
    (softplus, elu's backward, logaddexp, ...): a region's graph holds only the printer's ops
    where torch writes an op in terms of them."""
    return {
        op: fn
        for op, fn in core_aten_decompositions().items()
        if op not in PRINTABLE and not op._schema.is_mutable  # functionalize takes those
    }


def trace(fn, inputs: Sequence[StandIn], decompose: bool = True) -> GraphModule:
    """Trace `fn` on fake stand-ins for `inputs`, in a thread of its own (`in_own_thread`), with
    the ops the printer does not spell decomposed where `decompose`."""
    table = _decompositions() if decompose else {}

    def traced_here() -> GraphModule:
        with FakeTensorMode(), torch.enable_grad():
            stand_ins = [
                torch.empty(_STAND_IN, dtype=dtype, requires_grad=grad) for dtype, grad in inputs
            ]
            traced = make_fx(fn, decomposition_table=table)(*stand_ins)
            # autograd's formulas may write in place (clamp's mask): retrace without mutations
            plain = [t.detach() for t in stand_ins]
            functional = functionalize(traced, remove="mutations_and_views")
            return _clean(make_fx(functional, decomposition_table=table)(*plain))

    try:
        return in_own_thread(traced_here)
    except Exception as error:  # a region op that fake tensors or autograd cannot trace
        raise UnsupportedRegion(f"tracing the region failed: {error}") from error


def register(
    graph: Graph,
    input_dtypes: Sequence[torch.dtype],
    weak: Sequence[bool],
    dropout_p: Sequence[float],
    name: str | None = None,
) -> Region:
    """Trace `graph` (placeholders: inputs, then keep-masks; output: a list) and register it.
    A `name` (a user pattern's) starts the key, so the kernels rendered for the region carry it."""
    module = GraphModule(torch.nn.Module(), graph)
    inputs = [(d, False) for d in input_dtypes] + [(torch.bool, False) for _ in dropout_p]
    forward, written = trace(module, inputs), trace(module, inputs, decompose=False)
    text = f"{forward.code}|{written.code}|{tuple(input_dtypes)}|{tuple(weak)}|{tuple(dropout_p)}"
    # a Function's forward traces inline: its key (its own backward) must tell the regions apart
    calls = [n for n in graph.nodes if n.target is apply_one]
    text += "".join(f"|{n.args[0]}" for n in calls)
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    if name is not None:
        key = f"{name}_{key}"
    region = _registry.get(key)
    if region is None:
        region = Region(
            key, forward, written, tuple(input_dtypes), tuple(weak), tuple(dropout_p), name,
            module if calls else None,
        )  # fmt: skip
        _registry[key] = region
    return region


@functools.lru_cache(maxsize=512)
def backward_plan(
    key: str,
    needs_grad: tuple[bool, ...],
    grad_terms: tuple[int, ...],
    written: tuple[bool, ...],
) -> BackwardPlan:
    """Differentiate region `key` for the inputs in `needs_grad`. Output j's gradient arrives as
    the sum of `grad_terms[j]` tensors (0: it has none; more than one when autograd's sum of a
    value read twice is folded into this backward), and for the outputs in `written` the kernel
    also writes that sum. Gradients the trace leaves as a lone incoming term pass through."""
    region = lookup(key)
    out_dtypes = [n.meta["val"].dtype for n in _outputs(region.forward)]
    grad_terms = tuple(
        n if d.is_floating_point else 0 for n, d in zip(grad_terms, out_dtypes, strict=True)
    )
    num_masks, count = len(region.dropout_p), region.num_inputs

    def joint(*flat):
        inputs, masks, terms = (
            flat[:count],
            flat[count : count + num_masks],
            iter(flat[count + num_masks :]),
        )
        outs = (region.program or region.forward)(*inputs, *masks)
        grads = [_sum([next(terms) for _ in range(n)]) for n in grad_terms]
        # an output no differentiated input reaches (a weight of a constant) gets a gradient
        # when the fused op's other outputs require one; it adds nothing to the inputs'
        flowing = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
        flowing = [(o, g) for o, g in flowing if o.requires_grad]
        wrt = [x for x, need in zip(inputs, needs_grad, strict=True) if need]
        input_grads = (
            torch.autograd.grad(
                [o for o, _ in flowing], wrt, [g for _, g in flowing], allow_unused=True
            )
            if flowing and wrt
            else [None] * len(wrt)
        )
        return [*input_grads, *(g for g, w in zip(grads, written, strict=True) if w)]

    inputs = [
        (d, need and d.is_floating_point)
        for d, need in zip(region.input_dtypes, needs_grad, strict=True)
    ]
    masks = [(torch.bool, False)] * num_masks
    terms = [(d, False) for d, n in zip(out_dtypes, grad_terms, strict=True) for _ in range(n)]
    graph = trace(joint, (*inputs, *masks, *terms))

    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    term_placeholders = placeholders[region.num_inputs + num_masks :]
    results = iter(_outputs(graph))
    computed: list[Node] = []

    def write(value: Node) -> int:
        if value not in computed:
            computed.append(value)
        return computed.index(value)

    input_grads = []
    for need in needs_grad:
        result = next(results) if need else None
        if result is None:
            input_grads.append(InputGrad("none"))
        elif result in term_placeholders:
            input_grads.append(InputGrad("passthrough", term_placeholders.index(result)))
        else:
            input_grads.append(InputGrad("computed", write(result)))
    sums = tuple(write(result) for result in results)
    output = next(n for n in graph.graph.nodes if n.op == "output")
    output.args = (list(computed),)
    graph = _clean(graph)
    saved = tuple(bool(p.users) for p in placeholders[: region.num_inputs])
    return BackwardPlan(graph, tuple(computed), tuple(input_grads), saved, sums)


def _sum(terms: list[torch.Tensor]) -> torch.Tensor | None:
    return functools.reduce(torch.add, terms) if terms else None


def _outputs(gm: GraphModule) -> list[Node | None]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return list(output.args[0])


def output_dtypes(region: Region, input_dtypes: Sequence[torch.dtype]) -> list[torch.dtype]:
    """Output dtypes for inputs of `input_dtypes`, by torch's own type promotion: the forward runs
    on meta tensors shaped like the inputs (0-d where the input is 0-d)."""
    return list(_output_dtypes(region.key, tuple(input_dtypes)))


@functools.lru_cache(maxsize=1024)
def _output_dtypes(key: str, input_dtypes: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
    region = lookup(key)
    inputs = [
        torch.empty(() if weak else (1,), dtype=dtype, device="meta")
        for dtype, weak in zip(input_dtypes, region.weak, strict=True)
    ]
    masks = [torch.empty((1,), dtype=torch.bool, device="meta") for _ in region.dropout_p]
    return tuple(out.dtype for out in region.forward(*inputs, *masks))
