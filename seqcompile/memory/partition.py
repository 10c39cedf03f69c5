"""Choosing the partitioner that splits AOTAutograd's joint graph into forward and backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch.fx import GraphModule
from torch.utils.checkpoint import CheckpointPolicy

from seqcompile.options import Options


def choose_partitioner(option: str, checkpoint: str, rest: str) -> str:
    """`auto` recomputes cheap ops (min-cut) when Inductor fuses the recompute into its kernels,
    and saves what eager saves when the rest runs eagerly. Torch's memory budget needs min-cut."""
    if checkpoint == "torch":
        return "min_cut"
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


@contextlib.contextmanager
def torch_budget(joint: GraphModule, options: Options) -> Iterator[None]:
    """With `checkpoint="torch"`, torch's min-cut partitioner meets the memory budget itself.
    Random ops are tagged to be kept: under a budget its knapsack would otherwise recompute
    them, and a recomputed seed draws other dropout masks than the forward's."""
    if options.checkpoint != "torch" or options.memory_budget.unlimited:
        yield
        return
    for node in joint.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and is_random(node.target):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    with functorch_config.patch(activation_memory_budget=options.memory_budget.fraction):
        yield


def is_random(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags
