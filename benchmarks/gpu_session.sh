#!/usr/bin/env bash
# Everything a GPU session checks and measures, in one call. Writes into ${OUT:-benchmarks/out}:
#   pytest_gpu.txt   the GPU test tier
#   results.md       the benchmark tables, ready for benchmarks/results/<device>.md
set -u
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/device.txt"
# The GPU machine has no network: install without dependencies or build isolation.
pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -2
python -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -40 | tee "$out/pytest_gpu.txt"
python -m benchmarks.norm_kernels --output "$out/results.md" 2>&1 | tail -60
python -m benchmarks.pointwise_kernels --output "$out/results.md" 2>&1 | tail -40
python -m benchmarks.loss --output "$out/results.md" 2>&1 | tail -50
python -m benchmarks.attention --output "$out/results.md" 2>&1 | tail -30
python -m benchmarks.attention_mods --output "$out/results.md" 2>&1 | tail -30
python -m benchmarks.train_step --output "$out/results.md" 2>&1 | tail -20
python -m benchmarks.memory_budget --output "$out/results.md" 2>&1 | tail -20
