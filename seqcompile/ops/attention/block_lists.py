"""Block lists: per block of rows (queries, or keys for dk and dv), which column blocks the
attention kernels visit and how, made on the device by `attention_blocks` on each call from the
tensor that hides scores: a boolean mask, or where there is none, an additive bias shared along
batch or heads (a causal or padding mask given as 0 and -inf). Blocks where it hides every score
are skipped (with -inf), those where it hides none are visited without reading it, those where it
holds the causal triangle compute the triangle from positions, and the rest read it. Being made
from the tensor on each call, they follow any edit of a buffer in place."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton
from torch.fx.experimental.symbolic_shapes import statically_known_true

from seqcompile.codegen import KernelSpec, kernel_function
from seqcompile.ops.attention.layout import scores_shape4, strides4
from seqcompile.ops.fused_op import Call
from seqcompile.run import runtime

Tensor = torch.Tensor
BLOCKS = KernelSpec.of("attention_blocks")


def walked(call: Mapping[str, Any]) -> bool:
    """Whether the kernels walk block lists: those of a boolean mask, alone or with causal
    masking and a sliding window (which the lists take in), or where there is no mask, those of
    an additive bias shared along batch or heads (`_shared`), so the lists say every block a
    program visits. Packed documents and a prefix keep their own loops."""
    if call["doc_q"] is not None or call["prefix"] is not None:
        return False
    return call["mask"] is not None or (call["bias"] is not None and _shared(_value(call, "bias")))


def of_bias(call: Mapping[str, Any]) -> bool:
    """Whether the block lists the kernels walk are the bias's (there is no mask)."""
    return call["mask"] is None and walked(call)


def skip_empty(call: Mapping[str, Any]) -> bool:
    """Whether the block lists leave out blocks where no score is allowed: a bias's -inf, and a
    mask's where masked scores take -inf (a finite fill still counts in the softmax)."""
    return walked(call) and (of_bias(call) or call["masked_value"] == -math.inf)


def _shared(bias: Tensor) -> bool:
    """Whether an additive bias is one plane for several batch elements or heads (a size-1, zero
    stride or missing dimension before its last two): its block lists cost a read of its own
    elements, fewer than the kernels' reads of it. A bias at the scores' full size is not listed:
    the lists would read it once more."""
    if bias.dim() < 4:
        return True
    return any(
        statically_known_true(size == 1) or stride == 0
        for size, stride in zip(bias.shape[:-2], bias.stride()[:-2], strict=True)
    )


def _value(call: Mapping[str, Any], name: str) -> Any:
    """An argument's value: the fake value of a graph's call, the launcher's argument itself."""
    return call.value(name) if isinstance(call, Call) else call[name]


def arguments(call: Mapping[str, Any], rows_block: int, cols_block: int, keys=False) -> list:
    """The block lists of the mask (of the bias where there is none) for a kernel whose programs
    take `rows_block` queries (keys, with `keys`) and walk blocks of `cols_block` keys (queries),
    made now, as that kernel's arguments: the lists and their counts (flat, a row block's lists
    twice as long as there are column blocks, three counts each: `attention_blocks`), their
    strides along batch and heads in row blocks (0 where the mask broadcasts); none where the
    kernels do not walk them. `call`: the launcher's arguments by the schema's names."""
    if not walked(call):
        return []
    q, k = call["q"], call["k"]
    listed = call["bias"] if of_bias(call) else call["mask"]
    shape = scores_shape4(q, k)
    stride_b, stride_h, stride_m, stride_n = strides4(listed, shape)
    lists_b, lists_h = (shape[0] if stride_b else 1), (shape[1] if stride_h else 1)
    rows, cols = (shape[3], shape[2]) if keys else (shape[2], shape[3])
    stride_r, stride_c = (stride_n, stride_m) if keys else (stride_m, stride_n)
    row_blocks, col_blocks = triton.cdiv(rows, rows_block), triton.cdiv(cols, cols_block)
    # flat (batch, head, row block, column block) and one element over: at symbolic sizes a
    # dimension that may be 1 makes a trace decide on it (torch's contiguity test asks)
    row_lists = lists_b * lists_h * row_blocks
    lists = runtime.empty((row_lists * 2 * col_blocks + 1,), torch.int32, q.device)
    counts = runtime.empty((row_lists * 3 + 1,), torch.int32, q.device)
    kernel_function(BLOCKS)[(row_lists,)](
        listed, lists, counts, stride_b, stride_h, stride_r, stride_c, lists_h, rows, cols,
        call["window"], SKIP_EMPTY=skip_empty(call), BIAS=of_bias(call), CAUSAL=call["causal"],
        KEYS=keys, BLOCK_R=rows_block, BLOCK_C=cols_block,
    )  # fmt: skip
    return [lists, counts, lists_h * row_blocks if lists_b > 1 else 0, row_blocks * (lists_h > 1)]
