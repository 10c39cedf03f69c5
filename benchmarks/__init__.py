"""Kernel and end-to-end benchmarks (`python -m benchmarks.<name>`); results go to `results/`."""

from seqcompile.ops import registry

KERNEL_BENCHMARKS = {entry.name: entry.benchmark for entry in registry.ENTRIES}
"""The benchmark that times each registry entry's kernels against eager and Inductor, as its
entry names it (`FusedOp.benchmark`)."""
MODEL_BENCHMARKS = (
    "benchmarks.step_profile",
    "benchmarks.train_step",
    "benchmarks.memory_budget",
    "benchmarks.cpu_step",
)
"""Whole-model benchmarks: a training step, the memory budget's plans, a training step on CPU."""
