"""Sharding rules of the fused operators, so a fused op called on DTensors (tensor and sequence
parallelism) runs on each rank's local tensors instead of failing for want of a rule.

Each entry declares, per op (forward, backward, in-place twin), a rule (`FusedOp.sharding`): a
function of the call (its tensor arguments as DTensor's specs, read by schema name, with `.shape`)
and of its outputs' shapes to the `Strategy`s the op computes correctly along one mesh dimension:
where each output lies (`Shard(d)`, `Replicate()`, or `Partial()` for a sum over the shards) for
given placements of its tensor arguments. Every op also takes the replicated strategy (each rank
computes the whole op), which is always right; DTensor expands the strategies to every dimension
of the mesh and picks the cheapest for the placements it was given, redistributing where none
matches. `register` hands the rules to DTensor's sharding propagator at import; `refusal` tells
the fuse stage why a fused call on DTensors placed as no rule takes them should not be made (it
would run, redistributed or replicated, where the unfused ops may not need to).

A rule offers what holds on every shard: rows (batch, sequence) for norms, regions and the losses;
batch and heads for attention; never the dimension an op reduces over; never a dropout draw,
whose seed each shard would repeat.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from seqcompile.fx.nodes import is_dtensor
from seqcompile.ops.fused_op import Call
from seqcompile.ops.samples import tensor_slots

OpOverload = torch._ops.OpOverload
Shape = tuple[int, ...]

try:  # a torch built without distributed support has no DTensor
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import Placement
except ImportError:  # pragma: no cover  (the rules are then never called)
    Placement = Any  # type: ignore[misc,assignment]
    Partial = Replicate = Shard = None  # type: ignore[assignment,misc]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Placements of one op call's outputs (in the schema's order, one per tensor of a list)
    and of its tensor arguments by name (a list argument takes one per tensor). A tensor
    argument not named is replicated."""

    outputs: Sequence[Placement]
    inputs: Mapping[str, Placement | Sequence[Placement]] = dataclasses.field(default_factory=dict)


Rule = Callable[[Call, Sequence[Shape]], Iterable[Strategy]]
"""`rule(call, output_shapes)`: the strategies beyond replicating everything (`shards` names
them, for the fuse stage's refusals); `NoSharding` where there are none."""


def shards(what: str) -> Callable[[Rule], Rule]:
    """Names what a rule shards (`rows (any dimension but the last)`), for the refusal of a
    call placed otherwise."""

    def name(rule: Rule) -> Rule:
        rule.shards = what  # type: ignore[attr-defined]
        return rule

    return name


class NoSharding(Exception):
    """Raised by a rule for a call no shard can compute alone (a dropout draw, a mean over every
    shard's rows), with the reason: the call runs replicated."""


def placed(shape: Shape | None, placement: Placement) -> Placement:
    """`placement` for an output of shape `shape`, or `Replicate()` for an empty placeholder (an
    output of shape (0,), which the op returns where it has nothing to give)."""
    return Replicate() if shape is None or tuple(shape) == (0,) else placement


def along(shape: Shape, full: Shape, dim: int, *, reduced: bool = False) -> Placement:
    """Where a tensor of `shape` that broadcasts against `full` lies when `full` is sharded along
    `dim`: sharded along its own matching dimension, or, where it is broadcast along `dim`,
    replicated (as an input) or partial (`reduced`: a gradient summed over the broadcast)."""
    if tuple(shape) == (0,):
        return Replicate()
    own = dim - (len(full) - len(shape))
    if own >= 0 and shape[own] == full[dim]:
        return Shard(own)
    return Partial() if reduced else Replicate()


def shape_of(spec: Any) -> Shape:
    return tuple(spec.shape)


def register(rules: Mapping[OpOverload, Rule]) -> None:
    """Register each op's rule with DTensor's sharding propagator (every argument of the call is
    part of the key it caches a decision under). Where this torch keeps that registry elsewhere,
    a warning says so, and a graph that would run a fused op on DTensors runs as captured."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

        propagator = DTensor._op_dispatcher.sharding_propagator
        for op, rule in rules.items():
            info = RuntimeSchemaInfo(static_argnum=0, needs_pytree=True)
            propagator.register_op_strategy(op, functools.partial(_strategies, op, rule), info)
    except Exception as error:  # DTensor's internals moved: seqcompile still imports
        warnings.warn(f"seqcompile: fused ops get no sharding rules here: {error}", stacklevel=2)


def offered(op: OpOverload, rule: Rule, call: Call) -> list[Strategy]:
    """What `rule` offers for `call` (its tensors as DTensor specs); raises `NoSharding`."""
    return list(rule(call, _output_shapes(op, call)))


def refusal(op: OpOverload, rule: Rule, call: Call) -> str | None:
    """Why a call of `op` on DTensors (`call` holds fake values) cannot run on the shards as
    they are placed, or None where it can (no DTensor among its tensors, every one replicated,
    or their placements a strategy of the rule along every mesh dimension)."""
    tensors = dict(tensor_slots({name: call.value(name) for name in call}))
    dtensors = {slot: t for slot, t in tensors.items() if is_dtensor(t)}
    if not dtensors:
        return None
    plain = [slot for slot, t in tensors.items() if slot not in dtensors and t.numel() != 1]
    meshes = {t.device_mesh for t in dtensors.values()}
    if len(meshes) > 1:
        return "its DTensors lie on different meshes"
    specs = Call(op, (), {name: _as_spec(call[name]) for name in call})
    for dim in range(next(iter(meshes)).ndim):
        given = {slot: t.placements[dim] for slot, t in dtensors.items()}
        if all(isinstance(p, Replicate) for p in given.values()):
            continue
        try:
            strategies = offered(op, rule, specs)
        except NoSharding as reason:
            return f"its DTensors are sharded ({_listed(given)}), and {reason}"
        if not any(_takes(s, given) for s in strategies):
            takes = getattr(rule, "shards", "what its rule offers")
            return f"its DTensors are placed {_listed(given)}, and it shards only {takes}"
    if plain:
        return (
            f"it would take DTensors and plain tensors together ({', '.join(plain)} plain),"
            " which DTensor does not run"
        )
    return None


def _as_spec(value: Any) -> Any:
    """A call's argument with each DTensor (a graph node's fake value) as its spec."""
    value = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
    if isinstance(value, list | tuple):
        return [_as_spec(v) for v in value]
    return getattr(value, "_spec", value)


def _takes(strategy: Strategy, given: Mapping[str, Placement]) -> bool:
    """Whether `strategy` takes the tensors placed as `given` (slot names, `inputs[0]` in a
    list), every tensor it does not name replicated."""
    for slot, placement in given.items():
        name, _, index = slot.partition("[")
        wanted = strategy.inputs.get(name, Replicate())
        if index and not isinstance(wanted, Placement):
            wanted = wanted[int(index[:-1])]
        if wanted != placement:
            return False
    return True


def _listed(given: Mapping[str, Placement]) -> str:
    """The placements that are not replicated, by slot."""
    shown = {slot: p for slot, p in given.items() if not isinstance(p, Replicate)}
    return ", ".join(f"{slot} {placement!r}" for slot, placement in shown.items())


def _strategies(op: OpOverload, rule: Rule, op_schema: Any) -> Any:
    """DTensor's strategy function for `op`: the rule's strategies and the replicated one, over
    every mesh dimension."""
    from torch.distributed.tensor._op_schema import OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    def spec(item: Any) -> Any:
        if isinstance(item, OpStrategy):
            return item.strategies[0].output_spec
        if isinstance(item, TupleStrategy):
            return [spec(child) for child in item.children]
        return item

    call = Call(op, tuple(spec(a) for a in op_schema.args_schema),
                {k: spec(v) for k, v in op_schema.kwargs_schema.items()})  # fmt: skip
    shapes = _output_shapes(op, call)
    replicated = Strategy([Replicate()] * len(shapes))
    try:
        strategies = [replicated, *rule(call, shapes)]
    except NoSharding:
        strategies = [replicated]
    rows = [_placement_list(call, s, len(shapes)) for s in strategies]
    found = expand_to_full_mesh_op_strategy(
        op_schema.get_mesh_from_args(), op_schema, rows, input_index=len(shapes)
    )
    if _returns_list(op):  # DTensor wraps a list by a tuple of specs, even a list of one
        for option in found.strategies:
            if not isinstance(option.output_specs, tuple):
                option.output_specs = (option.output_specs,)
    return found


def _placement_list(call: Call, strategy: Strategy, outputs: int) -> list[Placement | None]:
    """The strategy as DTensor lists it: each output's placement, then each tensor argument's in
    the schema's order (a list argument's flattened)."""
    if len(strategy.outputs) != outputs:
        placed = len(strategy.outputs)
        raise ValueError(f"{call.op}: a strategy places {placed} of its {outputs} outputs")
    row: list[Placement | None] = list(strategy.outputs)
    for name in call:
        value, given = call[name], strategy.inputs.get(name)
        if isinstance(value, list | tuple):
            tensors = [v for v in value if is_spec(v)]
            row += list(given) if given is not None else [Replicate()] * len(tensors)
        elif is_spec(value):
            row.append(given if given is not None else Replicate())
    return row


def is_spec(value: Any) -> bool:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return isinstance(value, DTensorSpec)


def _returns_list(op: OpOverload) -> bool:
    returns = op._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.ListType)


def _output_shapes(op: OpOverload, call: Call) -> list[Shape]:
    """The global shape of each tensor the call returns, from the op's fake implementation."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    def fake(value: Any) -> Any:
        if is_spec(value):
            meta = value.tensor_meta
            return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype)
        if isinstance(value, torch.Tensor):  # a plain tensor beside the DTensors (a seed)
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
        return value

    mode = detect_fake_mode() or FakeTensorMode()
    with mode, disable_proxy_modes_tracing():
        arguments = pytree.tree_map(fake, call.arguments(), is_leaf=is_spec)
        result = op(*arguments)
    return [tuple(t.shape) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


ROWS = "rows (any dimension but the last, which it normalizes)"
DROPOUT = "it draws dropout: every shard would draw the same mask from the one seed"


def row_dims(call: Call, name: str) -> range:
    """The dimensions of argument `name` that index rows: all but the last."""
    return range(len(shape_of(call[name])) - 1)


def no_dropout(call: Call) -> None:
    """`NoSharding` for a call that draws dropout."""
    if call["seed"] is not None and call["p"] > 0:
        raise NoSharding(DROPOUT)


def rows_everywhere(anchor: str) -> Rule:
    """The rule of an op whose every tensor, argument and output, holds one entry per row of
    argument `anchor` (the cross-entropies and their backward ops: the logits)."""

    @shards("rows (any dimension but the last, the classes)")
    def rule(call: Call, outputs: Sequence[Shape]) -> list[Strategy]:
        tensors = [name for name in call if is_spec(call[name])]
        return [
            Strategy([placed(s, Shard(d)) for s in outputs], {n: Shard(d) for n in tensors})
            for d in row_dims(call, anchor)
        ]

    return rule
