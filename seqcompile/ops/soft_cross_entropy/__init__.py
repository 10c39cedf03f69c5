"""The fused cross-entropy against probability targets `seqfast::soft_cross_entropy` and its
backward `seqfast::soft_cross_entropy_backward`.

    soft_cross_entropy(logits (M, V), target (M, V), smoothing) -> (loss (M,), lse (M,), mass (M,))

returns each row's loss, log-sum-exp and target mass (the sum of its smoothed targets) in float32,
reading the logits and targets in their own dtypes; `F.cross_entropy` with probability targets
(soft labels, mixup, a teacher's probabilities) is this loss plus its reduction. The backward saves
the logits, the targets and the two per-row statistics, never a softmax, and writes the gradient
of the logits, and of the targets when they require one, in one pass.

Its parts: `op.py` declares the ops (schema, fake implementations, autograd), `kernels.py` launches
the generated kernel of `templates/`, `reference.py` is the plain-ATen definition and the
lowerings, `sharding.py` the sharding rule and `samples.py` the sample inputs.
"""

from __future__ import annotations

from seqcompile.ops.fused_op import FusedOp
from seqcompile.ops.soft_cross_entropy import kernels, op, reference, sharding

ENTRY = FusedOp(
    name="soft_cross_entropy",
    family="loss",
    package=__name__,
    forward=op.FORWARD,
    backward=(op.BACKWARD,),
    reference=reference.forward,
    lowering={op.FORWARD: reference.forward, op.BACKWARD: reference.lower_backward},
    kernels={
        op.FORWARD: lambda call: [kernels.spec("forward")],
        op.BACKWARD: lambda call: [kernels.spec("backward", call["target_grad"])],
    },
    sharding={o: sharding.RULE for o in (op.FORWARD, op.BACKWARD)},
    saves="the logits, the targets and each row's log-sum-exp and target mass, never the"
    " probabilities",
    benchmark="benchmarks.loss",
)
