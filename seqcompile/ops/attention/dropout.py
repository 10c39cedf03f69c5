"""Attention's dropout stream: which scores dropout keeps.

One Philox4x32-7 block gives eight 16-bit numbers; a score is kept where its number is at least
`threshold(p)`, so p is resolved to 2^-16 (the fraction kept is within 2^-17 of 1 - p); kept
scores are scaled by 1 / (1 - p), as torch's dropout scales them. The eight numbers of a block go
to the eight scores one GPU thread holds in a matrix product's accumulator (two rows eight apart,
two pairs of columns eight apart), so the kernels draw them where they use them. For scores of
shape (..., Lq, Lk), the score of query row r and key column c in plane z (the leading dimensions
flattened) takes

    the block on the counter (z, i, stream, j) of `random.grid_words`, with
        i = (r // 16) * 8 + r % 8,   j = (c // 16) * 4 + (c % 8) // 2,
    its word 2 * ((r // 8) % 2) + (c // 8) % 2, and of that word
    the low 16 bits if c is even, the high 16 bits if c is odd.

The kernels' `attention_dropout_keep` (in `attention_scores.py.jinja`) draws the same numbers on
tiles whose rows and columns start at multiples of 16."""

from __future__ import annotations

import math
import struct

import torch

from seqcompile.ops.random import grid_words

BITS = 16
"""Bits of each number: eight numbers per Philox block."""
ROUNDS = 7
"""Philox rounds per block: seven, as FlashAttention-2's dropout takes them (Philox4x32-7 passes
TestU01's BigCrush; ten, the flat stream's count, is Random123's margin above that)."""
TILE = 16
"""Rows (and columns) of the square a grid's 8 x 4 blocks cover."""


def threshold(p: float) -> int:
    """The least number dropout keeps: p in float32 (as the kernels receive it) times 2^16,
    rounded to nearest; exact in float32, so the kernels compute the same integer."""
    p32 = struct.unpack("f", struct.pack("f", p))[0]
    return math.floor(p32 * 2**BITS + 0.5)


def keep_mask(seed: torch.Tensor, shape: torch.Size, stream: int, p: float) -> torch.Tensor:
    """Which scores of `shape` (..., Lq, Lk) dropout keeps (the module docstring's stream)."""
    *lead, lq, lk = shape
    planes = math.prod(lead)
    row_tiles, col_tiles = -(-lq // TILE), -(-lk // TILE)
    words = grid_words(seed, planes, row_tiles * 8, col_tiles * 4, stream, ROUNDS)
    numbers = torch.stack((words & 0xFFFF, (words >> BITS) & 0xFFFF), dim=-1)
    # (z, i, j, word, half) as (z, r // 16, r % 8, c // 16, (c % 8) // 2, (r // 8) % 2,
    # (c // 8) % 2, c % 2), put in the order of (z, r, c)
    numbers = numbers.view(planes, row_tiles, 8, col_tiles, 4, 2, 2, 2)
    numbers = numbers.permute(0, 1, 5, 2, 3, 6, 4, 7).reshape(
        planes, row_tiles * TILE, col_tiles * TILE
    )
    return (numbers[:, :lq, :lk] >= threshold(p)).reshape(shape)
