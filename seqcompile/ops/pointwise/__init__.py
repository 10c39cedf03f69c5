"""The fused pointwise region operator: `seqfast::pointwise` and its derived backward
`seqfast::pointwise_backward`.

    pointwise(inputs, seed, stream, region) -> outputs

runs region `region` (see `region.py`) over the broadcast shape of `inputs`; every output
has that shape, contiguous. Dropout number k of the region draws random stream `stream + k` of the
graph's seed at the element's flat index, so the backward regenerates the same mask. The backward
saves only the inputs its derived graph reads, never an intermediate and never a mask.

Its parts: `op.py` declares the ops (schema, fake implementations, autograd), `region.py` traces
and registers regions and derives their backward, `kernels.py` renders and launches their kernels
(from `templates/`), `reference.py` is the plain-ATen definition (and the lowering as it is),
`sharding.py` the sharding rules and `samples.py` the sample inputs.
"""

from __future__ import annotations

from seqcompile.ops.fused_op import FusedOp
from seqcompile.ops.pointwise import kernels, op, reference, sharding
from seqcompile.ops.pointwise import region as regions

ENTRY = FusedOp(
    name="pointwise",
    family="pointwise",
    package=__name__,
    forward=op.FORWARD,
    backward=(op.BACKWARD,),
    reference=reference.forward,
    lowering={op.FORWARD: reference.forward, op.BACKWARD: reference.backward},
    kernels={op.FORWARD: kernels.forward_kernels_of, op.BACKWARD: kernels.backward_kernels_of},
    sharding={op.FORWARD: sharding.forward, op.BACKWARD: sharding.backward},
    saves="the inputs its derived backward reads (and the seed), never an intermediate or a mask",
    label=lambda call: regions.lookup(call["region"]).name,
    benchmark="benchmarks.pointwise_kernels",
)
