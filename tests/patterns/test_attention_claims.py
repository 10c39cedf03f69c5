"""What the attention family reads from a mask's or bias's code is checked against that code:
programs whose mask looks like a reading but is not give eager's answer, and for every kind of
reading a wrong conclusion (injected into the reader) is refuted by evaluating the model's own
sub-graph, reported, and replaced by reading the tensor as it is. Each test runs on both paths,
the reference and the generated kernels, which must compute what the check confirmed (the kernel
path of all but the table of mask spellings in the slow tier)."""

import math

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion
from conftest import KERNELS_IN_SLOW_TIER

from seqcompile.patterns.attention import fold, index_masks, links, masks
from seqcompile.patterns.attention.positions import HalfPlane, Prefix
from seqcompile.patterns.attention.relative_bias import RelativeBias
from seqcompile.report import collecting

B, H, L, D = 2, 2, 9, 8
NEG_INF = float("-inf")
TRAINING_KERNELS = (
    "attention_fwd",
    "attention_bwd_delta",
    "attention_bwd_dkdv:with_dq",
)
pytestmark = pytest.mark.kernels(*TRAINING_KERNELS)
"""Every test runs on both paths (`impl`): what the kernels compute must be what was checked."""


def qkv(length=L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, length, D, generator=g).requires_grad_() for _ in range(3)]


def scores(q, k):
    return q @ k.transpose(-1, -2) / math.sqrt(D)


def attend(s, v):
    return torch.softmax(s, dim=-1) @ v


def positions(n):
    return torch.arange(n)[:, None], torch.arange(n)[None, :]


def fused(fn, inputs, **kwargs):
    return check_fusion(fn, inputs, counts={"attention": 1}, **kwargs)


def ones_tril(n, dtype=torch.bool):
    return torch.ones(n, n, dtype=dtype).tril()


# ---------------------------------------------------------------------------------------------
# masks that look like a reading but are not


@pytest.mark.parametrize(
    "bias",
    [
        lambda n: ones_tril(n).masked_fill(~ones_tril(n), NEG_INF),
        lambda n: torch.zeros(n, n, dtype=torch.bool).masked_fill(~ones_tril(n), NEG_INF),
        lambda n: torch.where(ones_tril(n), torch.tensor(False), torch.tensor(NEG_INF).bool()),
        lambda n: torch.full((n, n), NEG_INF, dtype=torch.bool).triu(1).float(),
        lambda n: torch.full((n, n), -0.4, dtype=torch.int64).triu(1) * -1e9,
    ],
    ids=["bool_filled", "bool_zeros_filled", "bool_where", "bool_full_triangle", "int_full"],
)
@KERNELS_IN_SLOW_TIER
def test_a_fill_the_mask_dtype_cannot_hold_is_read_as_the_values_it_holds(impl, bias):
    """A boolean triangle filled with -inf holds True (1) there: added to the scores it adds
    ones, it masks nothing (and an integer fill of -0.4 holds 0)."""

    def fn(q, k, v):
        return attend(scores(q, k) + bias(q.shape[-2]), v)

    fused(fn, qkv())


@pytest.mark.parametrize(
    "mask",
    [
        lambda n: (torch.ones(n, n).tril() * 0.5).long().bool(),
        lambda n: (torch.ones(n, n).tril() * 256).to(torch.uint8).bool(),
    ],
    ids=["half_truncated", "wraps_to_zero"],
)
@KERNELS_IN_SLOW_TIER
def test_a_triangle_a_product_and_cast_empty_is_not_read_as_causal(impl, mask):
    """`tril(ones) * 0.5` cast to an integer is all zeros: every score masked, not causal."""

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(q.shape[-2]))

    with collecting() as report:
        torch.compile(fn, backend="seqfast")(*qkv())
    assert report.counts["attention"] == 1
    assert not any("causal" in line for line in report.sites), report.sites
    fused(fn, qkv())


# ---------------------------------------------------------------------------------------------
# each kind of reading, concluded wrongly, is refuted by the model's code


def refuted(fn, inputs, needle):
    """Compile `fn` (outputs and gradients equal eager's) and find `needle` among the readings
    the check refuted."""
    report = fused(fn, inputs)
    reasons = [m.reason for m in report.refuted]
    assert any(needle in r for r in reasons), f"no refuted reading mentions {needle!r}: {reasons}"
    return report


def window_mask(q_idx, kv_idx):
    return q_idx - kv_idx < 3


@KERNELS_IN_SLOW_TIER
def test_a_half_plane_read_wrongly_is_refuted(monkeypatch, impl):
    monkeypatch.setattr(index_masks, "half_plane", lambda *a, **k: HalfPlane(True, 0))

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(q_idx, kv_idx))

    refuted(fn, qkv(), "read as causal, but the model's mask keeps the score at (0, 1)")


@KERNELS_IN_SLOW_TIER
def test_a_triangle_read_wrongly_is_refuted(monkeypatch, impl):
    monkeypatch.setattr(index_masks, "triangle", lambda *a: [(True, 0)])

    def fn(q, k, v):
        band = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril().triu(-2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band)

    refuted(fn, qkv(), "read as causal, but the model's mask masks the score at (3, 0)")


@KERNELS_IN_SLOW_TIER
def test_a_mask_read_wrongly_as_keeping_every_score_is_refuted(monkeypatch, impl):
    monkeypatch.setattr(index_masks, "keeps_all", lambda *a: True)

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=kv_idx <= q_idx)

    refuted(fn, qkv(), "read as keeping every score, but the model's mask masks the score at")


@KERNELS_IN_SLOW_TIER
def test_a_prefix_read_wrongly_is_refuted(monkeypatch, impl):
    read = index_masks.prefix_of

    def one_more(factor, keeps, scores):
        prefix = read(factor, keeps, scores)
        return None if prefix is None else Prefix(prefix.length, prefix.offset + 1, factor, keeps)

    monkeypatch.setattr(index_masks, "prefix_of", one_more)

    def fn(q, k, v, lengths):
        q_idx, kv_idx = positions(q.shape[-2])
        prefix = (kv_idx <= q_idx) | (kv_idx < lengths[:, None, None, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=prefix)

    # the lengths are data: the check reads random ones, which the reading must hold for too
    refuted(fn, [*qkv(), torch.tensor([3, 6])], "read as causal after a prefix, but")


@KERNELS_IN_SLOW_TIER
def test_positions_read_wrongly_within_documents_are_refuted(monkeypatch, impl):
    read = index_masks.half_plane

    def window_instead(factor, keeps, lq, lk, runs=None):
        plane = read(factor, keeps, lq, lk, runs)
        return HalfPlane(False, -1) if plane is not None and runs else plane

    monkeypatch.setattr(index_masks, "half_plane", window_instead)

    def fn(q, k, v, pos):
        first = pos[:, :1] - 1
        doc = (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)
        b_idx = torch.arange(q.shape[0])[:, None, None, None]
        q_idx, kv_idx = torch.arange(L)[None, None, :, None], torch.arange(L)[None, None, None, :]
        same = doc[b_idx, q_idx] == doc[b_idx, kv_idx]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=same & (pos[b_idx, kv_idx] <= pos[b_idx, q_idx])
        )

    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    refuted(fn, [*qkv(), position_ids], "read as a sliding window of 2 keys within each document")


@KERNELS_IN_SLOW_TIER
def test_a_bias_read_wrongly_as_zeros_is_refuted(monkeypatch, impl):
    monkeypatch.setattr(links, "_zeros", lambda node: True)

    def fn(q, k, v, bias):
        return attend(scores(q, k) + torch.full_like(bias, 0.5), v)

    refuted(fn, [*qkv(), torch.randn(1, H, L, L)], "read as zeros, but the model's value")


@KERNELS_IN_SLOW_TIER
def test_a_triangle_of_a_fill_read_wrongly_is_refuted(monkeypatch, impl):
    monkeypatch.setattr(links, "filled_triangle", lambda node, scores: NEG_INF)

    def fn(q, k, v):
        n = q.shape[-2]
        return attend(scores(q, k) + torch.full((n, n), 3.0).triu(1), v)

    refuted(fn, qkv(), "read as a triangle filled with -inf, but the model's value at (0, 1) is 3")


@KERNELS_IN_SLOW_TIER
def test_a_fill_read_in_the_wrong_dtype_is_refuted(monkeypatch, impl):
    """The class behind the boolean fills above: with constants read as Python numbers again,
    the check catches what the reader concluded."""
    monkeypatch.setattr(masks, "_in_dtype", lambda value, dtype: value)

    def fn(q, k, v):
        n = q.shape[-2]
        return attend(scores(q, k) + ones_tril(n).masked_fill(~ones_tril(n), NEG_INF), v)

    refuted(fn, qkv(), "filled with -inf, but the model's value at (0, 1) is 1.0")


@KERNELS_IN_SLOW_TIER
def test_a_bias_read_wrongly_as_relative_is_refuted(monkeypatch, impl):
    monkeypatch.setattr(fold, "read_relative", lambda bias, lq, lk: RelativeBias(bias, {}, {}))

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return attend(scores(q, k) + (q_idx * kv_idx).float() / 50, v)

    refuted(fn, qkv(), "read as a bias by key - query position, but the model's bias differs")


@pytest.mark.kernels("attention_fwd")
@KERNELS_IN_SLOW_TIER
def test_a_reading_right_only_at_the_traced_length_is_refuted_at_another(monkeypatch, impl):
    """In a dynamic graph the check runs at a second length too: a key bound that equals the
    traced length keeps every score there, not at the next length."""
    monkeypatch.setattr(index_masks, "keeps_all", lambda factor, keeps, lq, lk: True)

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=kv_idx < 9 + 0 * q_idx)

    inputs = qkv()
    for t in inputs:
        torch._dynamo.mark_dynamic(t, 2)
    with collecting() as report:
        out = torch.compile(fn, backend="seqfast")(*inputs)
    torch.testing.assert_close(out, fn(*inputs))
    reasons = [m.reason for m in report.refuted]
    assert any("keeping every score, but the model's mask masks" in r for r in reasons), reasons


@KERNELS_IN_SLOW_TIER
def test_a_correct_reading_is_checked_and_stands(impl):
    """Causal from positions is checked (its claim evaluated) and computed in the kernel."""

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=kv_idx <= q_idx)

    report = fused(fn, qkv())
    assert not report.refuted
    (line,) = report.sites
    assert line.split(": ")[-1].startswith("causal"), line


# ---------------------------------------------------------------------------------------------
# every reading on both paths: the kernels are specialized by the reading the check confirmed

FLOAT_MIN = torch.finfo(torch.float32).min


def tril(n, dtype=torch.bool, diagonal=0):
    return torch.ones(n, n, dtype=dtype).tril(diagonal)


def below_or_on(n):
    return torch.arange(n)[:, None] >= torch.arange(n)[None, :]


def filled_with_itself_negated(mask, fill):
    """Inductor's test spelling: a boolean triangle filled where it is False (the fill, read
    as a boolean, is True: the result keeps every score)."""
    return mask.masked_fill(torch.logical_not(mask), fill)


MASK_SPELLINGS = {
    # boolean fills a boolean triangle cannot hold: added to the scores, they add ones
    "bool_tril_filled_inf": lambda s, n: s + filled_with_itself_negated(tril(n), NEG_INF),
    "bool_tril_filled_min": lambda s, n: s + filled_with_itself_negated(tril(n), FLOAT_MIN),
    "bool_compare_filled_inf": lambda s, n: s + filled_with_itself_negated(below_or_on(n), NEG_INF),
    "bool_triu_filled_inf": lambda s, n: s + (~tril(n)).masked_fill(~tril(n), NEG_INF),
    "bool_tril_filled_zero": lambda s, n: s + tril(n).masked_fill(~tril(n), 0),
    # fills a float, half or integer mask holds: causal
    "float_tril_filled_inf": lambda s, n: (
        s + tril(n, torch.float32).masked_fill(tril(n, torch.float32) == 0, NEG_INF)
    ),
    "float_zeros_filled_min": lambda s, n: s + torch.zeros(n, n).masked_fill(~tril(n), FLOAT_MIN),
    "half_zeros_filled_inf": lambda s, n: (
        s + torch.zeros(n, n, dtype=torch.float16).masked_fill(~tril(n), NEG_INF)
    ),
    "long_zeros_filled": lambda s, n: (
        s + torch.zeros(n, n, dtype=torch.long).masked_fill(~below_or_on(n), -(10**9))
    ),
    "float_zeros_filled_zero": lambda s, n: s + torch.zeros(n, n).masked_fill(~tril(n), 0.0),
    # the scores filled through a mask
    "scores_masked_fill_tril": lambda s, n: s.masked_fill(~tril(n), NEG_INF),
    "scores_where_compare": lambda s, n: torch.where(below_or_on(n), s, FLOAT_MIN),
    "scores_masked_fill_bool_of_inf": lambda s, n: s.masked_fill(
        torch.full((n, n), NEG_INF).triu(1).bool(), NEG_INF
    ),
}

TRAINING_KERNELS = (
    "attention_fwd",
    "attention_bwd_delta",
    "attention_bwd_dkdv:with_dq",
)
MODES = [
    pytest.param("inference", marks=[pytest.mark.kernels("attention_fwd"), pytest.mark.slow]),
    pytest.param("training", marks=pytest.mark.kernels(*TRAINING_KERNELS)),
    pytest.param("checkpointed", marks=[pytest.mark.kernels(*TRAINING_KERNELS), pytest.mark.slow]),
    pytest.param("dropout", marks=[pytest.mark.kernels(*TRAINING_KERNELS), pytest.mark.slow]),
]


def masked_attention(spelling, q, k, v, p=0.0):
    s = spelling(scores(q, k), q.shape[-2])
    return F.dropout(torch.softmax(s, -1), p, training=p > 0) @ v


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("spelling", MASK_SPELLINGS.values(), ids=MASK_SPELLINGS.keys())
def test_a_mask_spelling_gives_eager_answer_on_both_paths(impl, spelling, mode):
    """A triangle read as causal only where the model's code makes it one; in a boolean that
    holds every fill as True, the mask keeps every score. Inference, training, a checkpointed
    attention, and dropout (whose kept scores must carry eager's probabilities)."""
    if mode == "dropout":
        return check_dropout_keeps_eager_probabilities(spelling)
    q, k, v = qkv()
    if mode == "inference":
        q, k, v = (t.detach() for t in (q, k, v))

    def fn(q, k, v):
        if mode == "checkpointed":
            return torch.utils.checkpoint.checkpoint(
                masked_attention, spelling, q, k, v, use_reentrant=False
            )
        return masked_attention(spelling, q, k, v)

    fused(fn, [q, k, v])


def check_dropout_keeps_eager_probabilities(spelling, p=0.5):
    """With v the identity each output row shows its probabilities after dropout: a kept one is
    eager's probability over 1 - p, and about 1 - p of the probabilities eager leaves nonzero
    are kept."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, H, L, L, generator=g).requires_grad_() for _ in range(2))
    v = torch.eye(L).expand(B, H, L, L).requires_grad_()
    probs = masked_attention(spelling, q, k, v.detach())
    with collecting() as report:
        torch.manual_seed(0)
        out = torch.compile(
            lambda q, k, v: masked_attention(spelling, q, k, v, p), backend="seqfast"
        )(q, k, v)
    assert report.counts["attention"] == 1, report.missed
    kept = out != 0
    torch.testing.assert_close(out[kept], probs[kept] / (1 - p))
    possible = probs != 0
    assert not (kept & ~possible).any()
    ratio = kept.sum().item() / possible.sum().item()
    assert abs(ratio - (1 - p)) < 4 * math.sqrt(p * (1 - p) / possible.sum().item()), ratio
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
