"""The fused linear + cross-entropy operator: `seqfast::linear_cross_entropy`, which never builds
the full logits, and its backward `seqfast::linear_cross_entropy_backward`.

    linear_cross_entropy(hidden (M, D), weight (V, D), bias (V,)?, target (M,), ignore_index,
                         smoothing, mean, chunk, compute_dtype, needs_grad)
        -> (loss (), dhidden, dweight, dbias)

walks the tokens in chunks of `chunk` rows. Per chunk it forms the logits in `compute_dtype` (the
linear's dtype, autocast's included), computes each row's loss and overwrites the logits with their
gradient (one kernel), then adds the chunk's share of the gradients: `dlogits @ weight` into
`dhidden`, `dlogits^T @ hidden` into a float32 weight gradient, and column sums into a float32 bias
gradient. The loss is the sum over non-ignored rows, divided by their count (kept on the device)
when `mean`. The gradients are those of this loss; the backward only multiplies them by the
incoming gradient, so the loss can be scaled, summed with other terms or divided for gradient
accumulation. Peak extra memory is one chunk of logits.

Its parts: `op.py` declares the op (schema, checks; the fake implementation, backward and autograd
from `ops/linear_head.py`), `kernels.py` runs its chunks (the cross-entropy operator's kernel on
each), `reference.py` is the lowering, `cost.py` the workspace, `sharding.py` the sharding rules and
`samples.py` the sample inputs.
"""

from __future__ import annotations

from seqcompile.ops import linear_head as head
from seqcompile.ops.cross_entropy import kernels as ce_kernels
from seqcompile.ops.fused_op import FusedOp
from seqcompile.ops.linear_cross_entropy import cost, op, reference, sharding

ENTRY = FusedOp(
    name="linear_cross_entropy",
    family="loss",
    package=__name__,
    forward=op.FORWARD,
    backward=(op.BACKWARD,),
    reference=op.linear_cross_entropy,
    lowering={op.FORWARD: reference.lower_forward, op.BACKWARD: head.scaled},
    kernels={
        op.FORWARD: lambda call: [ce_kernels.spec("forward_grad", call["smoothing"])],
        op.BACKWARD: lambda call: [],
    },
    sharding={op.FORWARD: sharding.forward, op.BACKWARD: sharding.backward},
    saves=head.SAVES,
    flops={op.FORWARD: head.flops},
    workspace={op.FORWARD: cost.workspace_bytes},
    accumulate=head.accumulate,
    benchmark="benchmarks.loss",
    describe=cost.describe,
)
