"""The fused linear + row-wise loss operator: `seqfast::linear_row_loss`, which never builds the
full logits, and its backward `seqfast::linear_row_loss_backward`.

    linear_row_loss(hidden (M, D), weight (V, D), bias (V,)?, rows [(M, ...)], consts, post,
                    program, chunk, compute_dtype, needs_grad)
        -> (loss (), dhidden, dweight, dbias)

computes any loss the loss pattern reads as math on each row of the logits plus an affine
function of sums over the rows (cross-entropy with a z-loss, soft-capped logits, masked classes,
KL or JSD against a teacher's logits, ...): `program` names its traced graphs (`program.py`).
`rows` are the per-row inputs (targets, a teacher's logits, a mask), sliced with the chunks;
`consts` are read whole by every chunk; `post` are the other inputs of the loss's final affine
step (a count of targets).

Per chunk of `chunk` rows it forms the logits in `compute_dtype`, runs the program's joint (the
chunk's sums and the gradient by the logits of the loss they make), and adds the chunk's share
of the gradients as `seqfast::linear_cross_entropy` does. The loss's gradient by each sum is known
before the first chunk (the loss is affine in them), so each chunk's gradient is final and only
one chunk of logits (and of the joint's temporaries) is ever live. The backward multiplies the
gradients by the incoming gradient of the loss.

Its parts: `op.py` declares the op (schema; the fake implementation, backward and autograd from
`ops/linear_head.py`), `program.py` registers the loss programs, `reference.py` runs its chunks
(on every device) and is its lowering, `cost.py` the workspace and what the report says,
`sharding.py` the sharding rules and `samples.py` the sample inputs. It launches no generated
kernel of its own.
"""

from __future__ import annotations

from seqcompile.ops import linear_head as head
from seqcompile.ops.fused_op import FusedOp
from seqcompile.ops.linear_row_loss import cost, op, reference, sharding

ENTRY = FusedOp(
    name="linear_row_loss",
    family="loss",
    package=__name__,
    forward=op.FORWARD,
    backward=(op.BACKWARD,),
    reference=op.linear_row_loss,
    lowering={op.FORWARD: reference.lower_forward, op.BACKWARD: head.scaled},
    kernels={op.FORWARD: lambda call: [], op.BACKWARD: lambda call: []},
    sharding={op.FORWARD: sharding.forward, op.BACKWARD: sharding.backward},
    saves=head.SAVES,
    flops={op.FORWARD: head.flops},
    workspace={op.FORWARD: cost.workspace_bytes},
    accumulate=head.accumulate,
    benchmark="benchmarks.loss",
    describe=cost.describe,
)
