"""Traced launches planned for an executor that runs the graph op by op (the eager executor on
CUDA): each `triton_kernel_wrapper_functional` node the launch trace left
(`traced_launches.py`) becomes a call of a `Launch`, which launches the kernel directly.

A fused call then costs, per call, the allocations and the views its outputs need and one
`kernel[grid](...)` per launch: the op's checks, layouts, kernel specs, configuration lookups and
grids were settled when it was traced, once per call signature, and neither the higher-order op's
dispatch nor its copies of what a kernel writes run. A kernel writes only buffers its call
allocated (a fused op that writes over an argument is never traced), so a `Launch` copies nothing;
were a written tensor to share memory with the call's arguments, it would be copied first, as the
functional launch does."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._higher_order_ops.triton_kernel_wrap import (
    kernel_side_table,
    triton_kernel_wrapper_functional,
)
from torch.fx import Graph, GraphModule, Node
from torch.multiprocessing.reductions import StorageWeakRef
from triton.runtime.autotuner import Autotuner

from seqcompile.codegen.launches import counted_kernel

aten = torch.ops.aten

__all__ = ["Launch", "launches_planned", "plan_launches"]


def launches_planned(device: torch.device, executor: str) -> bool:
    """Whether calls on `device` whose launches trace run them as planned `Launch`es: under the
    eager executor on CUDA, which would dispatch each traced launch (a higher-order op that copies
    what it writes) slower than the op's own launcher."""
    return device.type == "cuda" and executor == "eager"


class Launch:
    """One traced launch: the kernel (counted where it is one of seqcompile's), the launch's
    constant arguments, which tensors it writes (returned by name, as the functional launch
    returns them), and which of those to copy first."""

    def __init__(
        self, kernel: Any, constants: Mapping[str, Any], written: Sequence[str], copied: set[str]
    ) -> None:
        self.kernel = kernel
        self.constants = dict(constants)
        self.written = tuple(written)
        self.copied = frozenset(copied)
        self.__name__ = f"launch_{getattr(kernel, 'stem', type(kernel).__name__)}"

    def __call__(self, grid: Sequence[Any], tensors: dict[str, Any]) -> dict[str, torch.Tensor]:
        for name in self.copied:
            tensors = {**tensors, name: tensors[name].clone()}
        self.kernel[tuple(grid)](**tensors, **self.constants)
        return {name: tensors[name] for name in self.written}

    def __repr__(self) -> str:
        return self.__name__


def plan_launches(traced: GraphModule) -> GraphModule:
    """A copy of a call's traced launches (`traced`, whose placeholders are the call's arguments)
    with each launch a `Launch` call (one whose grid lists a configuration per autotuner choice
    stays as it is)."""
    graph = Graph()  # new nodes; values and metadata shared with `traced`, which stays as it is
    value, output = graph.graph_copy(traced.graph, {}, return_output_node=True)
    graph.output(value, type_expr=output.type)
    graph.set_codegen(traced.graph._codegen)
    arguments = _argument_storages(graph)
    for node in list(graph.nodes):
        if node.target is not triton_kernel_wrapper_functional or len(node.kwargs["grid"]) != 1:
            continue
        tensors = node.kwargs["kwargs"]
        written = node.kwargs["tensors_to_clone"]
        traceable, constants = _unwrapped(
            kernel_side_table.get_kernel(node.kwargs["kernel_idx"]),
            kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]),
        )
        launch = Launch(
            counted_kernel(traceable) or traceable,
            constants,
            written,
            {name for name in written if _storage(tensors[name]) in arguments},
        )
        bases = {name: _base(value) for name, value in tensors.items()}
        with graph.inserting_before(node):
            planned = graph.call_function(launch, (tuple(node.kwargs["grid"][0]), bases))
        planned.meta.update(node.meta)
        node.replace_all_uses_with(planned)
        graph.erase_node(node)
    _drop_views(graph)
    _allocate_as_viewed(graph)
    return GraphModule(traced, graph)


def _unwrapped(kernel: Any, constants: Mapping[str, Any]) -> tuple[Any, Mapping[str, Any]]:
    """A one-configuration autotuner (as a traced launch's options are wrapped) as the function it
    runs, its options among the constants: no autotuner's Python per launch."""
    if not isinstance(kernel, Autotuner) or len(kernel.configs) != 1:
        return kernel, constants
    config = kernel.configs[0]
    if config.pre_hook or getattr(kernel, "reset_to_zero", None) or kernel.restore_value:
        return kernel, constants
    return kernel.fn, {**constants, **config.all_kwargs()}


def _is_view(node: Any) -> bool:
    return isinstance(node, Node) and getattr(node.target, "is_view", False)


def _base(value: Any) -> Any:
    """What a kernel is given for `value`: the tensor it views where both start at the same
    element (a kernel reads a tensor's address alone; its strides are the launch's arguments)."""
    while _is_view(value) and _offset(value.args[0]) == _offset(value) is not None:
        value = value.args[0]
    return value


def _offset(node: Any) -> int | None:
    fake = node.meta.get("val") if isinstance(node, Node) else None
    return fake.storage_offset() if isinstance(fake, torch.Tensor) else None


def _drop_views(graph: Graph) -> None:
    """Remove the views nothing reads any more, and those that view a tensor as it is (same
    sizes, strides and start): each would cost a dispatch per call."""
    for node in reversed(list(graph.nodes)):
        if not _is_view(node):
            continue
        if node.users and _same_layout(node, node.args[0]):
            node.replace_all_uses_with(node.args[0])
        if not node.users:
            graph.erase_node(node)


RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
"""Views whose second argument is the sizes they give."""


def _allocate_as_viewed(graph: Graph) -> None:
    """Where a launch's output is read only through one reshape of the buffer it was given, and
    nothing else reads that buffer, allocate the buffer in that shape: the kernel reads its
    address alone, and the reshape (a dispatch per call) goes."""
    for view in list(graph.nodes):
        got = view.args[0] if view.target in RESHAPES else None
        if not isinstance(got, Node) or got.target is not operator.getitem or len(got.users) != 1:
            continue
        launch, name = got.args
        buffer = launch.args[1][name] if isinstance(launch.target, Launch) else None
        sizes = view.args[1]
        if (
            not isinstance(buffer, Node)
            or buffer.target is not aten.empty.memory_format
            or len(buffer.users) != 1
            or not all(isinstance(n, int) and n >= 0 for n in sizes)  # (static sizes only)
            or not _contiguous(buffer)
            or not _contiguous(view)
        ):
            continue
        with graph.inserting_before(buffer):
            shaped = graph.call_function(buffer.target, (list(sizes),), dict(buffer.kwargs))
        shaped.meta.update(view.meta)
        launch.update_arg(1, {**launch.args[1], name: shaped})
        graph.erase_node(buffer)
        got.meta.update(view.meta)
        view.replace_all_uses_with(got)
        graph.erase_node(view)


def _contiguous(node: Node) -> bool:
    fake = node.meta.get("val")
    return isinstance(fake, torch.Tensor) and fake.is_contiguous() and fake.storage_offset() == 0


def _same_layout(a: Node, b: Any) -> bool:
    x, y = a.meta.get("val"), b.meta.get("val") if isinstance(b, Node) else None
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return False
    same = (x.shape, x.stride(), x.storage_offset(), x.dtype)
    return same == (y.shape, y.stride(), y.storage_offset(), y.dtype)


def _argument_storages(graph: Graph) -> set[StorageWeakRef]:
    placeholders = (_storage(n) for n in graph.nodes if n.op == "placeholder")
    return {s for s in placeholders if s is not None}


def _storage(value: Any) -> StorageWeakRef | None:
    """The storage of a node's fake tensor value; None for anything else."""
    fake = value.meta.get("val") if isinstance(value, Node) else None
    return StorageWeakRef(fake.untyped_storage()) if isinstance(fake, torch.Tensor) else None
