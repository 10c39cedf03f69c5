"""Kernel and end-to-end benchmarks (`python -m benchmarks.<name>`); results go to `results/`."""

KERNEL_BENCHMARKS = {
    "attention": "benchmarks.attention",
    "add_norm": "benchmarks.norm_kernels",
    "cross_entropy": "benchmarks.loss",
    "linear_cross_entropy": "benchmarks.loss",
    "pointwise": "benchmarks.pointwise_kernels",
}
"""The benchmark that times each registry entry's kernels against eager and Inductor
(`tests/ops/test_registry.py` checks that every entry has one)."""
MODEL_BENCHMARKS = ("benchmarks.train_step", "benchmarks.memory_budget")
"""Whole-model benchmarks: a training step, and the memory budget's plans."""
