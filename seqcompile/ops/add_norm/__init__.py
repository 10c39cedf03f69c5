"""The fused residual + normalization operator: `seqfast::add_norm` and its backward
`seqfast::add_norm_backward`.

With every input but `x` optional, the forward computes

    sum = residual + dropout(x + branch_bias, p)        rounded to `sum_dtype`
    out = norm(sum) * weight + bias                      LayerNorm or RMSNorm over the last dim

and returns `(out, sum, mean, rstd)`. `sum` is empty when there is nothing to add (the norm reads
`x` itself); `mean` is empty for RMSNorm. The backward saves the sum (or `x`) and the per-row
statistics, and regenerates the dropout mask from the seed.

Its parts: `op.py` declares the ops (schema, fake implementations, autograd), `kernels.py` launches
the generated kernels of `templates/`, `reference.py` is the plain-ATen definition (the test
oracle, and the lowering as it is), `sharding.py` the sharding rules and `samples.py` the sample
inputs.
"""

from __future__ import annotations

from seqcompile.ops.add_norm import kernels, op, reference, sharding
from seqcompile.ops.fused_op import FusedOp

ENTRY = FusedOp(
    name="add_norm",
    family="norm",
    package=__name__,
    forward=op.FORWARD,
    backward=(op.BACKWARD,),
    reference=reference.forward,
    lowering={op.FORWARD: reference.forward, op.BACKWARD: reference.backward},
    kernels={op.FORWARD: kernels.forward_kernels_of, op.BACKWARD: kernels.backward_kernels_of},
    sharding={op.FORWARD: sharding.forward, op.BACKWARD: sharding.backward},
    saves="the sum (or x when nothing is added) and the per-row mean and 1/std; the dropout"
    " mask is regenerated from the seed",
    benchmark="benchmarks.norm_kernels",
)
