"""The fused attention operator: `seqfast::attention` and its backward
`seqfast::attention_backward`.

    scores = g(q @ k^T * scale), g the registered score modification `score_mod` (or none)
    biased = scores + bias + rel_bias[..., 0, j - i + Lq - 1]     (query i, key j)
    out = dropout(softmax(where(mask, biased, masked_value), causal, prefix, window, docs,
                          sink), p) @ v

q is (..., H, Lq, D) and k, v are (..., Hk, Lk, D). Batch dimensions broadcast as matmul's do,
except that the head dimension (the third from last) may also group: H a multiple of Hk, query head
h reading key/value head h // (H / Hk), as SDPA's `enable_gqa`. The kernels see 4-D (batch, heads,
length, head_dim) views. `bias` (float, may require grad) and `mask` (bool, True where a query may
attend) broadcast to the scores (..., H, Lq, Lk) and are read through zero strides, so a padding
mask (B, 1, 1, Lk) is read as one vector per batch. `causal` and `window` (query i sees keys j <=
i, and i - j < window when window > 0) are computed from the positions, never read, and the kernels
skip the key blocks they hide; `prefix` (..., 1, 1), integers, widens causal to a prefix LM's mask:
every query also sees the keys before the prefix's length. `doc_q` (..., Lq, 1) and `doc_kv` (...,
1, Lk), document ids of the queries and keys of packed sequences, are compared in the kernel (a key
of another document takes -inf, as above the causal diagonal), which skips the blocks where no
query shares a document with a key. `rel_bias` (..., 1, Lq + Lk - 1), a bias that depends only on
the key's position less the query's (T5's relative-position buckets, ALiBi by distance), is read
per diagonal, never spread to the scores' size, and its gradient is summed per diagonal in the
kernel. `sink` (..., Lq, 1), float, is one more logit in each row's softmax with no value
(attention sinks): the forward starts each row from it, and its gradient, minus its probability
times the row's delta, is summed in plain ATen after the backward's kernels. q @ k^T runs in q's
dtype and probs @ v in v's, with float32 accumulation. Returns `(out, row_max, log_sum)`, out in
v's dtype; the backward saves q, k, v, out and the two per-row statistics, never the
probabilities, and regenerates the dropout mask from the seed.

Its parts: `op.py` declares the ops (schema, fake implementations, checks, autograd), `kernels.py`
launches the generated kernels of `templates/`, `reference.py` is the plain-ATen definition (the
test oracle and the lowering), `vendor.py` the route through SDPA's flash kernels, `cost.py` the
FLOPs, workspace and blocks visited, `sharding.py` the sharding rules and `samples.py` the sample
inputs."""

from __future__ import annotations

from seqcompile.ops.attention import cost, kernels, op, reference, sharding, vendor
from seqcompile.ops.fused_op import FusedOp, Vendor

ENTRY = FusedOp(
    name="attention",
    family="attention",
    package=__name__,
    forward=op.FORWARD,
    backward=(op.BACKWARD,),
    reference=reference.forward,
    lowering={op.FORWARD: op.lower_forward, op.BACKWARD: op.lower_backward},
    kernels={op.FORWARD: kernels.forward_kernels_of, op.BACKWARD: kernels.backward_kernels_of},
    sharding={op.FORWARD: sharding.forward, op.BACKWARD: sharding.backward},
    saves="q, k, v, the output, two per-row statistics (row max, log-sum) and the biases and mask"
    " as given, never the probabilities; the dropout mask is regenerated from the seed",
    flops={op.FORWARD: cost.forward_flops, op.BACKWARD: cost.backward_flops},
    workspace={op.BACKWARD: cost.backward_workspace},
    describe=cost.describe,
    vendor=Vendor(
        bodies={op.FORWARD: op.vendor_forward, op.BACKWARD: op.vendor_backward},
        refusal=vendor.refusal,
    ),
    compared={op.FORWARD: vendor.compared},
    benchmark="benchmarks.attention",
)
