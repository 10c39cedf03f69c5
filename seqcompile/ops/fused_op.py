"""What the compiler knows about one fused operator, declared once: `FusedOp` is a registry entry
(its family, forward and backward ops, reference, CPU lowering, the kernels each launches, its
cost, what its backward keeps, its workspace, its in-place twin, its gradient-accumulation hook
and the folder that holds its parts and sample inputs), and `Call` reads a call of one of its ops
by argument name. An op is made from its schema, written once (`schema`, `define`). Every stage
asks the entry (through `ops/registry.py`), and every piece of an op's glue (fake implementation,
autograd, launcher) reads arguments through `Call`, `named`, `needs_grad` and `gradients`;
nothing indexes a fused op's positional arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
from torch.fx import Node

from seqcompile.codegen import KernelSpec
from seqcompile.fx.nodes import tensor_val
from seqcompile.ops.samples import Sample

OpOverload = torch._ops.OpOverload
R = TypeVar("R")


class Call(Mapping[str, Any]):
    """A call of a fused op (a graph node, or the arguments a kernel launcher was given) read by
    the names in the op's schema, defaults filled in. `call["x"]` is the argument (a node in a
    graph); `call.value("x")` its fake value (a tensor, or the literal)."""

    def __init__(
        self, op: OpOverload, args: tuple, kwargs: Mapping[str, Any], node: Node | None = None
    ) -> None:
        self.op = op
        self.node = node  # the graph's node of the call (None for a launcher's arguments)
        self.names = [a.name for a in op._schema.arguments]
        self._args: dict[str, Any] = {}
        for argument, value in zip(op._schema.arguments, args, strict=False):
            self._args[argument.name] = value
        for argument in op._schema.arguments:
            if argument.name in kwargs:
                self._args[argument.name] = kwargs[argument.name]
            elif argument.name not in self._args:
                self._args[argument.name] = argument.default_value

    @classmethod
    def of(cls, node: Node) -> Call:
        return cls(node.target, node.args, node.kwargs, node)

    def __getitem__(self, name: str) -> Any:
        return self._args[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def value(self, name: str) -> Any:
        """The argument's value at the traced sizes: a node's fake value, a list's element
        values, or the literal itself."""
        return _value(self._args[name])

    def arguments(self, **changes: Any) -> tuple:
        """The positional arguments of the op, with `changes` by name."""
        return by_name(self.op, **{**self._args, **changes})

    def arguments_of(self, op: OpOverload) -> tuple:
        """The positional arguments of `op` (an in-place twin, say), each taken from this call's
        argument of the same name."""
        takes = {a.name for a in op._schema.arguments}
        return by_name(op, **{name: v for name, v in self._args.items() if name in takes})

    def shown(self) -> dict[str, Any]:
        """The arguments worth printing: those that are not None."""
        return {name: v for name, v in self._args.items() if v is not None}


def by_name(op: OpOverload, **arguments: Any) -> tuple:
    """`op`'s positional arguments from `arguments` given by the names in its schema (defaults
    filled in); a TypeError for a name it does not take or one it needs that is missing."""
    schema = op._schema.arguments
    _check_names(op, arguments)
    missing = [a.name for a in schema if a.name not in arguments and not a.has_default_value()]
    if missing:
        raise TypeError(f"{op} needs the argument(s) {', '.join(missing)}")
    return tuple(arguments.get(a.name, a.default_value) for a in schema)


def gradients(op: OpOverload, **grads: Any) -> tuple:
    """What `op`'s autograd backward returns: the gradient of each argument named in `grads`, in
    the schema's order, None for every other (a list of tensors takes a list, of Nones where it
    has none)."""
    _check_names(op, grads)
    return tuple(grads.get(a.name) for a in op._schema.arguments)


def needs_grad(ctx: Any, op: OpOverload, name: str, inputs: tuple | None = None) -> Any:
    """Whether autograd wants the gradient of `op`'s argument `name` (a list of flags for a list
    of tensors). In `setup_context` pass the call's `inputs`: there autograd gives one flag per
    tensor of a list argument, which this regroups by argument."""
    flags = ctx.needs_input_grad
    if inputs is not None:
        flat = iter(flags)
        flags = [[next(flat) for _ in v] if _is_tensor_list(v) else next(flat) for v in inputs]
    return flags[_position(op, name)]


def named(op: OpOverload) -> Callable[[Callable[[Call], R]], Callable[..., R]]:
    """A function of a `Call` of `op` as one of `op`'s arguments, positional or by keyword, as the
    dispatcher passes them (a fake implementation, say)."""

    def wrap(fn: Callable[[Call], R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def called(*args: Any, **kwargs: Any) -> R:
            return fn(Call(op, args, kwargs))

        return called

    return wrap


def schema(*arguments: str, returns: str) -> str:
    """A custom op's schema from runs of its arguments in torch's schema language (`"Tensor q,
    int window=0"`), in their order, except that every argument with a default moves after those
    without (the schema's rule): an op that takes another's arguments and more (a backward) names
    that run once instead of retyping it."""
    pieces = [a.strip() for run in arguments for a in run.split(",") if a.strip()]
    required = [a for a in pieces if "=" not in a]
    defaulted = [a for a in pieces if "=" in a]
    return f"({', '.join(required + defaulted)}) -> {returns}"


def define(
    name: str, signature: str, run: Callable[[Call], R], *, mutates: tuple[str, ...] = ()
) -> Any:
    """The custom op `name` (`"seqfast::attention"`) of schema `signature`, each call running
    `run` on the `Call` of its arguments by name; a `torch.library.CustomOpDef`, for its fake
    implementation and autograd."""

    def op(*args: Any, **kwargs: Any) -> R:
        return run(Call(defined._opoverload, args, kwargs))

    op.__name__ = name.split("::")[1]
    defined = torch.library.custom_op(name, op, mutates_args=mutates, schema=signature)
    return defined


def _check_names(op: OpOverload, arguments: Mapping[str, Any]) -> None:
    unknown = arguments.keys() - {a.name for a in op._schema.arguments}
    if unknown:
        raise TypeError(f"{op} has no argument {', '.join(sorted(unknown))}")


def _position(op: OpOverload, name: str) -> int:
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == name:
            return i
    raise TypeError(f"{op} has no argument {name}")


def _is_tensor_list(value: Any) -> bool:
    """A list autograd flattens into its tensors (as `torch.library` does: lists, not tuples)."""
    return isinstance(value, list) and all(isinstance(t, torch.Tensor) for t in value)


def _value(arg: Any) -> Any:
    if isinstance(arg, Node):
        return tensor_val(arg) if tensor_val(arg) is not None else arg.meta.get("val")
    if isinstance(arg, list | tuple):
        return [_value(a) for a in arg]
    return arg


@dataclasses.dataclass(frozen=True)
class InPlace:
    """A functional backward op and its twin that writes its result over one argument."""

    functional: OpOverload
    twin: OpOverload
    over: str
    """The argument the twin writes over (it must be a saved tensor only this call reads)."""


Kernels = Callable[[Call], list[KernelSpec]]


@dataclasses.dataclass(frozen=True)
class Vendor:
    """A vendor library's kernels for the calls of a fused op they can express."""

    bodies: Mapping[OpOverload, Callable[..., Any]]
    """For each of the op's calls: plain ATen that calls the vendor's kernels, taking the op's
    arguments by name and returning what the op returns (as a lowering does)."""
    refusal: Callable[[Call], str | None]
    """Why the vendor cannot compute a call as the op defines it (None: it can)."""


IMPLEMENTATIONS = ("kernel", "lowering", "vendor")
"""What a call of a fused op may run: the op as called (its generated kernels; on CPU its
reference), its lowering compiled by the executor, or a vendor library's kernel."""


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """One fused operator's entry in the registry."""

    name: str
    """Its readable name, the stem of its ops and the label of its kernels in the report."""
    family: str
    """The pattern family that makes it (`attention`, `norm`, `loss` or `pointwise`): the key its
    sites are counted under in the report."""
    forward: OpOverload
    """The op the fuse stage inserts (a `torch.library` custom op): its fake implementation
    runs at compile time, its kernels on CUDA and under the interpreter."""
    reference: Callable[..., Any]
    """The plain-ATen implementation: the test oracle, and what the op runs on CPU."""
    kernels: Mapping[OpOverload, Kernels]
    """For the forward op and each backward op: the kernels a call of it launches, at the
    traced sizes (the same function its launcher uses, so the compile and the run agree)."""
    saves: str
    """What the forward keeps for the backward, in words (the op's autograd saves it); the
    report says it for each operator a compile launches."""
    package: str
    """The operator's folder as a package (`seqcompile.ops.attention`), which holds its parts
    (`docs/design.md`, "One folder per operator")."""
    benchmark: str
    """The module under `benchmarks/` that times its kernels against eager and Inductor
    (`python -m <module>`; `tests/test_benchmarks.py` runs it at toy sizes)."""
    backward: tuple[OpOverload, ...] = ()
    """The ops its backward graph calls."""
    lowering: Mapping[OpOverload, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    """For each of its ops (forward, backward, in-place twin): what a call computes on CPU, in
    plain ATen that `make_fx` traces at fake values (no data-dependent control flow, no
    `seqfast` op), taking the op's arguments by schema name and returning what the op returns
    (the same values, dtypes, shapes and strides as its fake implementation; a twin writes its
    argument and returns None). `tests/ops/test_lowering.py` traces each on every sample."""
    flops: Mapping[OpOverload, Callable[[Call], int]] = dataclasses.field(default_factory=dict)
    """For an op that does matmul-like work: the FLOPs of a call of it. An op absent is
    bandwidth-bound (it costs the bytes it moves)."""
    workspace: Mapping[OpOverload, Callable[[Call], int]] = dataclasses.field(default_factory=dict)
    """For an op that allocates temporaries: the bytes a call of it allocates and frees while it
    runs, beyond its outputs."""
    sharding: Mapping[OpOverload, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    """For each of its ops: its sharding rule on DTensors, `rule(call, output_shapes)` to the
    placements it computes correctly along one mesh dimension (`ops/sharding.py`); the
    replicated placement is always offered besides. `tests/ops/test_sharding.py` runs every
    placement a rule offers on every sample, on simulated ranks."""
    in_place: InPlace | None = None
    accumulate: Callable[..., bool] | None = None
    """`accumulate(graph, buffer, call, output)`: add output `output` of the backward `call`
    into the parameter gradient `buffer` inside the op, returning whether it could."""
    label: Callable[[Call], str | None] | None = None
    """The name a call's kernels go by where it is not `name` (a user pattern's region)."""
    describe: Callable[[Call], str | None] | None = None
    """What the report says about a forward call at the traced sizes, beyond its kernels (the
    masks attention computes or reads, and the blocks it skips)."""
    vendor: Vendor | None = None
    compared: Mapping[OpOverload, Callable[[Any], Any]] = dataclasses.field(default_factory=dict)
    """For an op whose results two correct implementations may give differently: what of them
    they must agree on (attention's row statistics, of which only the sum is defined)."""

    def samples(self) -> Iterable[Sample]:
        """The forward's sample inputs, each with the eager composition that defines its answer
        (`ops/samples.py`): sizes 0, 1 and odd in every dimension, non-finite values, masked rows;
        `tests/ops/test_samples.py` runs each in every layout on every path, and the reference on
        each. Read from the folder's `samples.py`, imported only when asked for."""
        return importlib.import_module(f"{self.package}.samples").samples()

    @property
    def implementations(self) -> tuple[str, ...]:
        """What its calls may run (`IMPLEMENTATIONS`): the op itself always, its lowering where
        every op of it has one, and a vendor's kernels where it declares them."""
        lowered = all(op in self.lowering for op in self.ops)
        return (
            "kernel",
            *(("lowering",) if lowered else ()),
            *(("vendor",) if self.vendor is not None else ()),
        )

    def vendor_refusal(self, call: Call) -> str | None:
        """Why `call` cannot run the vendor's kernels (None: it can)."""
        if self.vendor is None or call.op not in self.vendor.bodies:
            return f"{self.name} has no vendor kernel for {call.op}"
        return self.vendor.refusal(call)

    def label_of(self, call: Call) -> str:
        named = self.label(call) if self.label is not None else None
        return named or self.name

    @property
    def ops(self) -> tuple[OpOverload, ...]:
        twin = (self.in_place.twin,) if self.in_place is not None else ()
        return (self.forward, *self.backward, *twin)
