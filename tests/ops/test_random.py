"""The dropout streams: Philox4x32-10 against the published known-answer vectors, four elements per
evaluation in the reference, and the kernels drawing the reference's numbers: one evaluation per
element at any offset (the counter's high word included), and four per evaluation on a tile or a
row whose starts allow it; the grid of counters and attention's stream read from it (the
attention kernels' draws are tested with the op, in tests/ops/test_attention.py)."""

import importlib.util
import logging
import math
import tempfile
from pathlib import Path

import pytest
import torch
import triton
from torch.fx.experimental.proxy_tensor import make_fx

from seqcompile.codegen.render import _env
from seqcompile.ops import random_native
from seqcompile.ops.attention import dropout
from seqcompile.ops.random import (
    grid_words,
    grid_written_out,
    keep_mask,
    keep_mask_by_rows,
    padded_width,
    philox_words,
    uniforms,
    written_out,
)
from tests.conftest import needs_interpreter

# Random123's kat_vectors for philox4x32 with 10 rounds (the flat stream) and 7 (attention's):
# rounds, counter, key, output.
PI_COUNTER, PI_KEY = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
KNOWN_ANSWERS = [
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, PI_COUNTER, PI_KEY, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, PI_COUNTER, PI_KEY, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]


def int64_bits(low: int, high: int) -> torch.Tensor:
    """The 64-bit key (low word first) as the int64 seed tensor holding its bits."""
    return torch.tensor([(high << 32 | low) - (2**64 if high >> 31 else 0)])


@pytest.mark.parametrize("rounds,counter,key,expected", KNOWN_ANSWERS)
def test_philox_matches_the_published_vectors(rounds, counter, key, expected):
    seed = int64_bits(*key)
    words = philox_words(seed, tuple(torch.tensor([c]) for c in counter), rounds)
    assert tuple(int(w) for w in words) == expected
    z, i, stream, j = counter  # the grid's counter order, from the C function where it builds
    grid = grid_words(seed, z + 1, i + 1, j + 1, stream, rounds) if max(counter) < 2**4 else None
    if grid is not None:
        assert tuple(int(w) & 0xFFFFFFFF for w in grid[z, i, j]) == expected


def at_offsets(seed: torch.Tensor, offsets: torch.Tensor, stream: int) -> torch.Tensor:
    """The stream's numbers at arbitrary flat offsets, as the module docstring defines them."""
    blocks = offsets >> 2
    counter = (blocks & 0xFFFFFFFF, blocks >> 32, torch.full_like(blocks, stream), 0 * blocks)
    words = torch.stack(philox_words(seed, counter), dim=-1)
    word = words.gather(-1, (offsets & 3)[..., None]).squeeze(-1)
    return (word >> 8).to(torch.float32) / 2**24


def test_one_evaluation_serves_four_neighbours():
    seed = torch.tensor(0x1234_5678_9ABC_DEF0 % 2**62)
    for count in (0, 1, 3, 4, 5, 37):
        drawn = uniforms(seed, count, stream=5)
        assert drawn.shape == (count,) and drawn.dtype == torch.float32
        assert torch.equal(drawn, at_offsets(seed, torch.arange(count), 5))
    mask = keep_mask(seed, torch.Size((3, 0, 2)), 1, 0.5)
    assert mask.shape == (3, 0, 2) and mask.dtype == torch.bool
    drawn = uniforms(seed, 4000, stream=2)
    assert 0.45 < float((drawn < 0.5).float().mean()) < 0.55
    assert len(drawn.unique()) > 3990  # the four words of a block differ


KERNEL = """
import triton
import triton.language as tl


{philox}


@triton.jit
def draw(SEED, OFFSETS, OUT, n, stream, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    inside = i < n
    offsets = tl.load(OFFSETS + i, mask=inside, other=0)
    tl.store(OUT + i, philox_uniform(tl.load(SEED), offsets, stream), mask=inside)


@triton.jit
def draw_tile(SEED, STARTS, OUT, col_start, stream, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.arange(0, ROWS)
    u = philox_uniform_rows(tl.load(SEED), tl.load(STARTS + r), col_start, stream, ROWS, COLS)
    tl.store(OUT + r[:, None] * COLS + tl.arange(0, COLS)[None, :], u)


@triton.jit
def draw_row(SEED, OUT, start, N, stream, BLOCK_N: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    u = row_dropout_numbers(tl.load(SEED), start, stream, BLOCK_N)
    tl.store(OUT + cols, u, mask=cols < N)
"""


def _kernels(tmp_path, monkeypatch):
    """The test kernels above, with the Philox functions every template includes."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = tmp_path / "draw_kernel.py"
    path.write_text(KERNEL.format(philox=_env.get_template("philox.py.jinja").render()))
    spec = importlib.util.spec_from_file_location("draw_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_interpreter
def test_the_kernels_draw_the_references_numbers_at_any_offset(tmp_path, monkeypatch):
    module = _kernels(tmp_path, monkeypatch)
    generator = torch.Generator().manual_seed(0)
    far = torch.randint(2**44, (23,), generator=generator)
    offsets = torch.cat([torch.arange(9), far, torch.tensor([2**34 + 3])])
    seed = torch.randint(2**62, (1,), generator=generator)
    out = torch.empty(len(offsets))
    module.draw[(1,)](seed, offsets, out, len(offsets), 11, BLOCK=64)
    assert torch.equal(out, at_offsets(seed, offsets, 11))


@needs_interpreter
def test_a_tile_drawn_four_per_evaluation_has_the_references_numbers(tmp_path, monkeypatch):
    """Rows starting at far multiples of 4, columns from a multiple of 4: each Philox evaluation's
    four words land on four neighbouring columns, as the stream defines them."""
    module = _kernels(tmp_path, monkeypatch)
    generator = torch.Generator().manual_seed(1)
    starts = torch.randint(2**42, (4,), generator=generator) * 4
    seed = torch.randint(2**62, (1,), generator=generator)
    out = torch.empty(4, 16)
    module.draw_tile[(1,)](seed, starts, out, 8, 3, ROWS=4, COLS=16)
    offsets = starts[:, None] + 8 + torch.arange(16)
    assert torch.equal(out, at_offsets(seed, offsets.flatten(), 3).view(4, 16))


@needs_interpreter
@pytest.mark.parametrize("width", [12, 13, 2], ids=["multiple_of_4", "odd", "narrow"])
def test_a_row_draws_the_references_numbers_at_any_width(tmp_path, monkeypatch, width):
    """Row 1001 of rows of `width`, numbered from its padded start as the norms number them."""
    module = _kernels(tmp_path, monkeypatch)
    seed = torch.tensor([2**40 + 7])
    out = torch.empty(width)
    start = 1001 * padded_width(width)
    module.draw_row[(1,)](seed, out, start, width, 5, BLOCK_N=triton.next_power_of_2(width))
    assert torch.equal(out, at_offsets(seed, start + torch.arange(width), 5))


@pytest.mark.parametrize("shape", [(3, 5, 13), (2, 8), (4, 1), (0, 6), (3, 0)])
def test_a_mask_by_rows_starts_each_row_at_a_multiple_of_4(shape):
    seed, p = torch.tensor([12345]), 0.5
    mask = keep_mask_by_rows(seed, torch.Size(shape), 9, p)
    assert mask.shape == shape
    n = shape[-1]
    for row, values in enumerate(mask.reshape(-1, n) if n else []):
        offsets = row * padded_width(n) + torch.arange(n)
        assert torch.equal(values, at_offsets(seed, offsets, 9) >= p)


NATIVE_CASES = [
    (seed, count, stream)
    for seed in (0, 1, 2**62 - 1, 0x1234_5678_9ABC_DEF0 % 2**62)
    for count in (0, 1, 3, 63, 64, 65, 1000)
    for stream in (0, 5, 2**31 + 1, 2**32 - 1)
]


def test_the_c_stream_draws_the_written_out_numbers():
    """Every count around the C function's 64-element steps, seeds with their high bits set, and
    streams using all 32 bits: the same numbers bit for bit (the kernels' tests above pin those)."""
    assert random_native.available() or random_native._compiler() is None
    if not random_native.available():
        pytest.skip("no C compiler on this machine")
    for seed, count, stream in NATIVE_CASES:
        seed = torch.tensor(seed)
        drawn = torch.ops.seqfast.philox_uniforms(seed, count, stream)
        assert torch.equal(drawn, written_out(seed, count, stream)), (seed, count, stream)
    torch.library.opcheck(torch.ops.seqfast.philox_uniforms, (torch.tensor([7]), 37, 2))


def test_the_c_grid_draws_the_written_out_words():
    """Grids around the C function's 16-column steps, seeds with their high bits set, streams
    using all 32 bits: the same words bit for bit, each that of its counter (z, i, stream, j)."""
    if not random_native.available():
        pytest.skip("no C compiler on this machine")
    for seed, (planes, rows, cols), stream in [
        (0, (1, 1, 1), 0),
        (2**62 - 1, (2, 3, 17), 2**31 + 1),
        (0x1234_5678_9ABC_DEF0 % 2**62, (3, 5, 33), 2**32 - 1),
        (7, (0, 4, 4), 3),
    ]:
        seed = torch.tensor(seed)
        for rounds in (7, 10):
            drawn = torch.ops.seqfast.philox_grid(seed, planes, rows, cols, stream, rounds)
            assert drawn.shape == (planes, rows, cols, 4) and drawn.dtype == torch.int32
            expected = grid_written_out(seed, planes, rows, cols, stream, rounds)
            assert torch.equal(drawn, expected)
    seed = torch.tensor(99)
    words = grid_words(seed, 2, 3, 5, 4, 7)
    counter = tuple(torch.tensor([c]) for c in (1, 2, 4, 4))  # (z, i, stream, j) of [1, 2, 4]
    assert [int(w) & 0xFFFFFFFF for w in words[1, 2, 4]] == [
        int(w) for w in philox_words(seed, counter, 7)
    ]
    torch.library.opcheck(torch.ops.seqfast.philox_grid, (torch.tensor([7]), 2, 3, 5, 1, 7))


@pytest.mark.parametrize("shape", [(2, 3, 37, 45), (1, 16, 16), (5, 1), (2, 0, 3), (17, 40)])
def test_attentions_stream_is_what_its_module_says(shape):
    """Each score's number, found one by one from the grid as `ops/attention/dropout.py` words
    it, against the keep mask (which reshapes the grid at once); odd sizes cut the last tiles."""
    seed, stream, p = torch.tensor(2**61 + 5), 11, 0.3
    shape = torch.Size(shape)
    mask = dropout.keep_mask(seed, shape, stream, p)
    assert mask.shape == shape and mask.dtype == torch.bool
    *lead, lq, lk = shape
    planes = math.prod(lead)
    words = grid_words(seed, planes, -(-lq // 16) * 8, -(-lk // 16) * 4, stream, dropout.ROUNDS)
    words = words.long() & 0xFFFFFFFF
    z, r, c = torch.meshgrid(
        torch.arange(planes), torch.arange(lq), torch.arange(lk), indexing="ij"
    )
    word = words[z, r // 16 * 8 + r % 8, c // 16 * 4 + c % 8 // 2, 2 * (r // 8 % 2) + c // 8 % 2]
    number = torch.where(c % 2 == 1, word >> 16, word & 0xFFFF)
    assert torch.equal(mask.reshape(planes, lq, lk), number >= dropout.threshold(p))
    if mask.numel() > 1000:
        assert abs(mask.float().mean().item() - (1 - p)) < 0.03


def test_attentions_threshold_rounds_p_as_the_kernels_receive_it():
    """p in float32, times 2^16, to nearest: a float64 p just below a half-step rounds up in
    float32 and so takes the step above, as the kernels (given p in float32) do."""
    assert dropout.threshold(0.5) == 32768 and dropout.threshold(0.1) == 6554
    assert dropout.threshold(13109 / 131072 - 1e-10) == 6555  # 6554.5 in float32
    assert dropout.threshold(1e-9) == 0 and dropout.threshold(1 - 1e-9) == 65536


def test_a_cpu_trace_keeps_the_stream_as_one_call():
    """What Inductor compiles on CPU: the stream one opaque call, not Philox's rounds."""
    if not random_native.available():
        pytest.skip("no C compiler on this machine")
    seed = torch.tensor(3)
    graph = make_fx(lambda s: keep_mask_by_rows(s, torch.Size((4, 6)), 2, 0.1))(seed).graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.seqfast.philox_uniforms.default) == 1
    assert torch.ops.aten.bitwise_xor.Tensor not in targets
    attention = make_fx(lambda s: dropout.keep_mask(s, torch.Size((2, 20, 30)), 2, 0.1))(seed)
    targets = [n.target for n in attention.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.seqfast.philox_grid.default) == 1
    assert torch.ops.aten.bitwise_xor.Tensor not in targets


def test_without_a_compiler_the_stream_is_written_out(monkeypatch, caplog):
    monkeypatch.setenv(random_native.COMPILER_ENV, "/nonexistent/cc")
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(Path(tempfile.mkdtemp())))  # nothing built there
    random_native._library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="seqcompile"):
            assert not random_native.available()
        assert "did not compile" in caplog.text
        seed = torch.tensor(11)
        assert torch.equal(uniforms(seed, 37, 4), at_offsets(seed, torch.arange(37), 4))
        mask = dropout.keep_mask(seed, torch.Size((2, 5, 19)), 4, 0.5)  # from the grid, written out
        assert mask.shape == (2, 5, 19) and 0 < mask.sum() < mask.numel()
    finally:
        random_native._library.cache_clear()
