"""Launch configurations of the attention kernels: per kernel and head dim, the space each is
tuned over on CUDA (`codegen/tuning.py`), its default first; the interpreter's one small tile
elsewhere.

The defaults are what the sm_90 compile (`python -m benchmarks.kernel_resources`) shows clean:
no spills with or without causal masking and dropout, matrix products on wgmma where the tile
allows (64 rows per warpgroup), and the fewest loop instructions per score among those. The
other candidates are the nearest tiles and the earlier fixed tiles, so that tuning can trade
occupancy for tile size on the device and never does worse than those did, and FlexAttention's
sm_90 forward default where our kernel compiles it without spilling (128 x 64, 8 warps, 3 stages
at head dim 128; its 128 x 128 with 4 warps at head dim 64 spills 80 bytes here, and the same tile
with 8 warps is a candidate); the space stays small, since the first launch at each size times
all of it.
"""

from __future__ import annotations

import torch
import triton

from seqcompile.codegen.tuning import Config

KERNELS = ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dkdv:with_dq", "attention_bwd_dq")
"""The kernels by name (`KernelSpec.name`): dk and dv's kernel adding dq (`with_dq`) takes its own
tiles, its dq tile beside dk's and dv's holding more registers."""


def block_d(head_dim: int) -> int:
    """The head dim padded to a power of two, at least 16 (what tl.dot takes)."""
    return max(16, triton.next_power_of_2(head_dim))


def space(
    kernel: str, head_dim: int, dtype: torch.dtype, device_type: str, dropout: bool = False
) -> list[Config]:
    """The configurations `kernel` may launch with at `head_dim` and `dtype` on `device_type`,
    default first. Tiles are chosen by the bytes of a row of q (float32 takes the tiles of twice
    the head dim in 16 bits); with dropout, whose Philox rounds hold more registers, some sizes
    default to a smaller tile of the same space."""
    d = block_d(head_dim)
    if device_type != "cuda":  # the interpreter runs each program in Python: small tiles
        return [Config.of(BLOCK_M=16, BLOCK_N=16, BLOCK_D=d)]
    width = d * dtype.itemsize // 2
    tiles, with_dropout = next((t, i) for limit, t, i in _TABLES[kernel] if width <= limit)
    if dropout:
        tiles = [tiles[with_dropout], *(t for i, t in enumerate(tiles) if i != with_dropout)]
    return [
        Config.of(BLOCK_M=m, BLOCK_N=n, BLOCK_D=d, num_warps=w, num_stages=s)
        for m, n, w, s in tiles
    ]


def one_launch_first(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the backward runs in one launch by default (`kernels.backward_variants`): where the
    sm_90 compile shows dk and dv's kernel adding dq issuing fewer instructions per score than
    dk/dv's and dq's kernels together (head dims up to 64 in 16 bits: 20-21 against 23.6, five
    matrix products against seven). Wider, its dq tile beside dk's and dv's takes 32-row tiles or
    spills, and the two launches come first (the device may still measure one faster)."""
    return block_d(head_dim) * dtype.itemsize // 2 <= 64


# Per kernel, rows of (largest head dim in 16-bit elements, [(BLOCK_M, BLOCK_N, warps, stages),
# ...], the default's index with dropout): BLOCK_M query rows by BLOCK_N key columns. The forward
# and dq walk key blocks for a block of queries, dkdv query blocks for a block of keys.
_TABLES = {
    "attention_fwd": [
        (64, [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)], 0),
        (128, [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (128, 64, 8, 1)], 3),
        (256, [(64, 32, 8, 1), (64, 16, 4, 1), (32, 32, 4, 1), (64, 32, 4, 1)], 2),
        (512, [(32, 32, 4, 1), (64, 32, 8, 1), (16, 32, 4, 1)], 2),
    ],
    "attention_bwd_dkdv": [
        (64, [(64, 64, 4, 2), (128, 64, 8, 2), (32, 64, 4, 3), (64, 64, 4, 1)], 3),
        (128, [(128, 64, 8, 1), (64, 64, 8, 1), (64, 32, 8, 2), (32, 64, 8, 1)], 3),
        (256, [(32, 32, 4, 1), (16, 32, 4, 1), (32, 32, 8, 1)], 0),
        (512, [(16, 32, 4, 1), (32, 32, 4, 1)], 0),
    ],
    "attention_bwd_dkdv:with_dq": [
        (64, [(64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 1)], 3),
        (128, [(32, 64, 8, 1), (64, 64, 8, 1), (128, 64, 8, 1), (64, 64, 4, 1)], 0),
        (256, [(16, 32, 4, 1), (32, 32, 4, 1), (32, 32, 8, 1)], 0),
        (512, [(16, 32, 4, 1), (32, 32, 4, 1)], 0),
    ],
    "attention_bwd_dq": [
        (64, [(64, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (32, 64, 4, 3)], 0),
        (128, [(128, 64, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2)], 0),
        (256, [(32, 32, 4, 1), (16, 32, 4, 1), (32, 32, 8, 1)], 1),
        (512, [(16, 32, 4, 1), (32, 32, 4, 1), (16, 32, 8, 1)], 2),
    ],
}
