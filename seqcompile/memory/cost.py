"""What recomputing a node costs: its FLOPs and the bytes it moves, turned into seconds by a device
roofline (the slower of compute and memory traffic, plus a kernel launch). Views and tuple
selections cost nothing; matmuls and attention are compute-bound; norms and pointwise regions move
their inputs and outputs once and are cheap."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from seqcompile.fx.nodes import concrete, fake_values, val
from seqcompile.memory.estimate import tensor_bytes
from seqcompile.ops import registry


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A device's dense half-precision FLOP/s, memory bandwidth and kernel launch time."""

    flops_per_second: float = 989e12
    bytes_per_second: float = 3.35e12
    launch_seconds: float = 4e-6

    def seconds(self, flops: int, moved_bytes: int) -> float:
        if flops == 0 and moved_bytes == 0:
            return 0.0
        compute = flops / self.flops_per_second
        return max(compute, moved_bytes / self.bytes_per_second) + self.launch_seconds


ROOFLINES = {
    "H100": Roofline(989e12, 3.35e12),
    "H200": Roofline(989e12, 4.8e12),
    "A100": Roofline(312e12, 2.0e12),
}
"""Published dense bf16 peaks and HBM bandwidths, by a substring of the device name."""


def roofline_for(device: torch.device | None) -> Roofline:
    """The roofline of `device` when it is a known GPU, else the H100's: only the ratio of compute
    to bandwidth matters for choosing what to recompute."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        for key, roofline in ROOFLINES.items():
            if key in name:
                return roofline
    return Roofline()


@dataclasses.dataclass(frozen=True)
class NodeCost:
    flops: int
    moved_bytes: int

    def seconds(self, roofline: Roofline) -> float:
        return roofline.seconds(self.flops, self.moved_bytes)


FREE = NodeCost(0, 0)


def total_cost(nodes: list[Node], cost: Callable[[Node], NodeCost] | None = None) -> NodeCost:
    """The summed cost of `nodes`, each priced by `cost` (default `node_cost`)."""
    costs = [(cost or node_cost)(n) for n in nodes]
    return NodeCost(sum(c.flops for c in costs), sum(c.moved_bytes for c in costs))


def node_cost(node: Node) -> NodeCost:
    """The FLOPs and bytes of running `node` once, at the traced sizes."""
    target = node.target
    if node.op != "call_function" or target is operator.getitem:
        return FREE
    if not isinstance(target, torch._ops.OpOverload) or target.is_view:
        return FREE
    args, kwargs = fake_values(node.args), fake_values(node.kwargs)
    moved = sum(_bytes(leaf) for leaf in tree_flatten((args, kwargs))[0])
    moved += sum(_bytes(leaf) for leaf in tree_flatten(val(node))[0])
    fused = registry.flops_of(node)
    if fused is not None:
        return NodeCost(fused, moved)
    return NodeCost(_flops(target, args, kwargs, val(node)), moved)


def _flops(target: torch._ops.OpOverload, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs by torch's formula for `target`; 0 for ops it has none for (bandwidth-bound ones,
    fused ops whose registry entry gives no formula)."""
    formula = flop_registry.get(target.overloadpacket)
    if formula is None:
        return 0
    return concrete(formula(*args, **kwargs, out_val=out))


def _bytes(value: Any) -> int:
    return tensor_bytes(value) if isinstance(value, torch.Tensor) else 0
