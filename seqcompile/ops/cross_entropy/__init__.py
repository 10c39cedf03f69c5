"""The fused cross-entropy operator: `seqfast::cross_entropy` and its backward
`seqfast::cross_entropy_backward`.

    cross_entropy(logits (M, V), target (M,), ignore_index, smoothing) -> (loss (M,), lse (M,))

returns each row's loss and log-sum-exp in float32, reading the logits in their own dtype (an
upcast to float32 before the loss costs nothing). The backward saves the logits, the targets and
the log-sum-exp, never a softmax or log-probability matrix, and writes the gradient of the logits
in one pass, over the saved logits themselves when the backward reads them nowhere else
(`cross_entropy_backward_in_place`, swapped in by `memory/in_place.py`). Reductions stay
outside, in the graph: `sum`, or `sum / count` with the count of non-ignored targets computed on
the device.

Its parts: `op.py` declares the ops (schema, fake implementations, autograd), `kernels.py` launches
the generated kernel of `templates/`, `reference.py` is the plain-ATen definition and the
lowerings, `sharding.py` the sharding rule and `samples.py` the sample inputs.
"""

from __future__ import annotations

from seqcompile.ops.cross_entropy import kernels, op, reference, sharding
from seqcompile.ops.fused_op import FusedOp, InPlace

ENTRY = FusedOp(
    name="cross_entropy",
    family="loss",
    package=__name__,
    forward=op.FORWARD,
    backward=(op.BACKWARD,),
    reference=reference.forward,
    lowering={
        op.FORWARD: reference.lower_forward,
        op.BACKWARD: reference.lower_backward,
        op.BACKWARD_IN_PLACE: reference.lower_backward_in_place,
    },
    kernels={
        op.FORWARD: lambda call: [kernels.spec("forward", call["smoothing"])],
        op.BACKWARD: lambda call: [kernels.spec("backward", call["smoothing"])],
        op.BACKWARD_IN_PLACE: lambda call: [kernels.spec("backward", call["smoothing"])],
    },
    sharding={o: sharding.RULE for o in (op.FORWARD, op.BACKWARD, op.BACKWARD_IN_PLACE)},
    saves="the logits, the targets and each row's log-sum-exp, never the probabilities",
    in_place=InPlace(functional=op.BACKWARD, twin=op.BACKWARD_IN_PLACE, over="logits"),
    benchmark="benchmarks.loss",
)
