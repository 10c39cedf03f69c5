"""Choosing the partitioner that splits AOTAutograd's joint graph into forward and backward."""

from __future__ import annotations

from typing import Any

from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.fx import GraphModule


def choose_partitioner(option: str, rest: str) -> str:
    """`auto` recomputes cheap ops (min-cut) when Inductor fuses the recompute into its kernels,
    and saves what eager saves when the rest runs eagerly."""
    if option != "auto":
        return option
    return "min_cut" if rest == "inductor" else "default"


def partition(
    joint: GraphModule, joint_inputs: Any, *, strategy: str, **kwargs: Any
) -> tuple[GraphModule, GraphModule]:
    if strategy == "min_cut":
        return min_cut_rematerialization_partition(
            joint, joint_inputs, compiler="inductor", **kwargs
        )
    return default_partition(joint, joint_inputs, **kwargs)
