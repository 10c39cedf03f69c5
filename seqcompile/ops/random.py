"""Dropout randomness shared by fused operators: a per-graph int64 seed tensor and the reference
Philox4x32-10 generator, bit-identical to `philox_uniform` in the kernel templates, so the reference
implementation and the kernels drop the same elements.

The flat stream: the element at offset `o` takes word `o % 4` of the Philox block whose counter is
(`o // 4` low word, `o // 4` high word, `stream`, 0) under the 64-bit key `seed`, and its top 24
bits as a float in [0, 1). One Philox evaluation gives the numbers of four neighbouring offsets.
A pointwise region numbers its elements by flat index; row-wise kernels (attention's scores, the
norms) number the element at column `c` of row `r` as `r * padded_width(n) + c`, so every row
starts a block and one evaluation serves four neighbouring columns of any width.

A grid of counters (`grid_words`): the block on the counter (z, i, stream, j) for every plane z,
row i and column j of a grid, in as many rounds as its reader asks; an operator maps its elements
onto the grid's words (attention: `ops/attention/dropout.py`)."""

from __future__ import annotations

import functools

import torch

from seqcompile.ops import random_native

_M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
SEED_HIGH = 2**62
"""Seeds are drawn from [0, SEED_HIGH) by `torch.randint`, so torch's generator governs them."""
WORDS = 4
"""Elements served by one Philox evaluation."""


def _mul_hi_lo(const: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # const * x for a 32-bit constant and 32-bit values held in int64, split into 32-bit halves:
    # the 64-bit product wraps around in int64, which keeps its bits (its high word is read
    # through an arithmetic shift and a mask).
    product = const * x
    return (product >> 32) & _M32, product & _M32


def philox_words(
    seed: torch.Tensor, counter: tuple[torch.Tensor, ...], rounds: int = 10
) -> tuple[torch.Tensor, ...]:
    """Philox4x32 in `rounds` rounds (Philox4x32-10 unless told) of the four 32-bit counter words
    (int64 tensors) under the 64-bit key `seed` (its low word first): the four output words, as
    int64 tensors."""
    seed = seed.to(torch.int64)
    steps = torch.arange(rounds, device=seed.device, dtype=torch.int64)
    keys0 = ((seed & _M32) + steps * _KEY_A) & _M32  # each round's key, made at once
    keys1 = (((seed >> 32) & _M32) + steps * _KEY_B) & _M32
    c0, c1, c2, c3 = counter
    for r in range(rounds):
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        c0, c1, c2, c3 = hi_b ^ c1 ^ keys0[r], lo_b, hi_a ^ c3 ^ keys1[r], lo_a
    return c0, c1, c2, c3


def uniforms(seed: torch.Tensor, count: int, stream: int) -> torch.Tensor:
    """The stream's first `count` numbers (float32 in [0, 1)), those of flat offsets 0..count-1:
    on CPU from the stream's C function where this machine compiles it (one op in a traced graph),
    else written out in torch integer ops (`written_out`)."""
    if seed.device.type == "cpu" and random_native.available():
        return torch.ops.seqfast.philox_uniforms(seed, count, stream)
    return written_out(seed, count, stream)


def written_out(seed: torch.Tensor, count: int, stream: int) -> torch.Tensor:
    """`uniforms` in torch integer ops, on any device."""
    blocks = torch.arange((count + WORDS - 1) // WORDS, device=seed.device, dtype=torch.int64)
    counter = (blocks & _M32, blocks >> 32, torch.full_like(blocks, stream & _M32))
    words = philox_words(seed, (*counter, torch.zeros_like(blocks)))
    flat = torch.stack(words, dim=-1).flatten()
    flat = flat[:count] if count % WORDS else flat
    return (flat >> 8).to(torch.float32) * (1.0 / 16777216.0)


def grid_words(
    seed: torch.Tensor, planes: int, rows: int, cols: int, stream: int, rounds: int
) -> torch.Tensor:
    """The four words of Philox4x32 in `rounds` rounds on the counter (z, i, stream, j) for
    z < planes, i < rows and j < cols, as int32 (the words' bits): (planes, rows, cols, 4). On CPU
    from the C function where this machine compiles it, else written out in torch integer ops."""
    if seed.device.type == "cpu" and random_native.available():
        return torch.ops.seqfast.philox_grid(seed, planes, rows, cols, stream, rounds)
    return grid_written_out(seed, planes, rows, cols, stream, rounds)


def grid_written_out(
    seed: torch.Tensor, planes: int, rows: int, cols: int, stream: int, rounds: int
) -> torch.Tensor:
    """`grid_words` in torch integer ops, on any device."""
    shape = (planes, rows, cols)
    arange = functools.partial(torch.arange, device=seed.device, dtype=torch.int64)
    counter = (
        arange(planes)[:, None, None].expand(shape),
        arange(rows)[:, None].expand(shape),
        torch.full(shape, stream & _M32, device=seed.device, dtype=torch.int64),
        arange(cols).expand(shape),
    )
    words = torch.stack(philox_words(seed, counter, rounds), dim=-1)
    return words.to(torch.int32)  # the low 32 bits of each


def keep_mask(seed: torch.Tensor, shape: torch.Size, stream: int, p: float) -> torch.Tensor:
    """Which elements of a contiguous tensor of `shape` dropout keeps (offset = flat index)."""
    return (uniforms(seed, shape.numel(), stream) >= p).view(shape)


def padded_width(n: int) -> int:
    """A row's share of the row-wise stream: its width rounded up to a multiple of 4."""
    return -(-n // WORDS) * WORDS


def keep_mask_by_rows(seed: torch.Tensor, shape: torch.Size, stream: int, p: float) -> torch.Tensor:
    """Which elements of a tensor of `shape` dropout keeps, numbered by rows of the last
    dimension, each row starting at a multiple of 4 (`padded_width`)."""
    n = shape[-1] if len(shape) else 1
    if n == 0 or shape.numel() == 0:
        return torch.ones(shape, dtype=torch.bool, device=seed.device)
    rows = shape.numel() // n
    drawn = uniforms(seed, rows * padded_width(n), stream).view(rows, padded_width(n))
    return (drawn[:, :n] >= p).reshape(shape)
