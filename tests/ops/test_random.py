"""The dropout stream: Philox4x32-10 against the published known-answer vectors, four elements per
evaluation in the reference, and the kernels' `philox_uniform` drawing the reference's numbers at
any offset, the counter's high word included."""

import importlib.util

import pytest
import torch

from seqcompile.codegen.render import _env
from seqcompile.ops.random import keep_mask, philox_words, uniforms
from tests.conftest import needs_interpreter

# Random123's kat_vectors for philox4x32 with 10 rounds: counter, key, output.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_philox_matches_the_published_vectors(counter, key, expected):
    low, high = key
    seed = torch.tensor([(high << 32 | low) - (2**64 if high >> 31 else 0)])  # int64 bits
    words = philox_words(seed, tuple(torch.tensor([c]) for c in counter))
    assert tuple(int(w) for w in words) == expected


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
"""


@needs_interpreter
def test_the_kernels_draw_the_references_numbers_at_any_offset(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = tmp_path / "draw_kernel.py"
    path.write_text(KERNEL.format(philox=_env.get_template("philox.py.jinja").render()))
    spec = importlib.util.spec_from_file_location("draw_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generator = torch.Generator().manual_seed(0)
    far = torch.randint(2**44, (23,), generator=generator)
    offsets = torch.cat([torch.arange(9), far, torch.tensor([2**34 + 3])])
    seed = torch.randint(2**62, (1,), generator=generator)
    out = torch.empty(len(offsets))
    module.draw[(1,)](seed, offsets, out, len(offsets), 11, BLOCK=64)
    assert torch.equal(out, at_offsets(seed, offsets, 11))
