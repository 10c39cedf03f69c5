"""The attention family end to end: every spelling fuses into one seqfast::attention, its output
and every gradient match eager (dropout off), dropout behaves like dropout, and near-misses are
refused with the reason."""

import math

import pytest
import torch
import torch.nn.functional as F
from checks import attention_flags, check_fusion, kernel_flags
from conftest import KERNELS_IN_SLOW_TIER

import seqcompile
from seqcompile.memory.saved import saved_tensors
from seqcompile.ops.attention.cost import key_blocks, visible_pairs
from seqcompile.ops.attention.reference import diagonal_keep
from seqcompile.report import collecting

B, H, LQ, LK, D = 2, 2, 5, 7, 8
MIN = torch.finfo(torch.float32).min


def qkv(lq=LQ, lk=LK, heads=H, kv_heads=None, d=D, batch=B, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(shape, generator=g).to(dtype).requires_grad_()

    kv_heads = kv_heads or heads
    return t(batch, heads, lq, d), t(batch, kv_heads, lk, d), t(batch, kv_heads, lk, d)


def padding(lk=LK, batch=B, seed=1):
    """A (B, 1, 1, Lk) boolean padding mask, True where a key is real; every row keeps key 0."""
    keep = torch.rand(batch, 1, 1, lk, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[..., 0] = True
    return keep


def fused(fn, inputs, **kwargs):
    return check_fusion(fn, inputs, counts={"attention": 1}, **kwargs)


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention


def test_sdpa_plain():
    fused(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), qkv())


def test_sdpa_boolean_padding_mask():
    fused(
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        [*qkv(), padding()],
    )


def test_sdpa_float_mask_with_gradient():
    bias = torch.randn(B, 1, LQ, LK).requires_grad_()
    fused(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b), [*qkv(), bias])


def test_sdpa_causal_self_attention_and_explicit_scale():
    fused(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
        qkv(lq=6, lk=6),
    )


def test_sdpa_grouped_query_heads():
    fused(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        qkv(heads=4, kv_heads=2),
    )


def test_sdpa_three_dimensional_operands():
    q, k, v = (t.detach().flatten(0, 1).requires_grad_() for t in qkv())
    fused(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [q, k, v])


# ---------------------------------------------------------------------------------------------
# written out: how the scores are formed and scaled


def softmax_v(s, v):
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize(
    "spelling",
    [
        lambda q, k: (q @ k.transpose(-1, -2)) / math.sqrt(D),
        lambda q, k: torch.matmul(q, k.transpose(-2, -1)) * D**-0.5,
        lambda q, k: (q / math.sqrt(D)) @ k.transpose(-1, -2),
        lambda q, k: (q * D**-0.25) @ (k * D**-0.25).transpose(-1, -2),
        lambda q, k: q @ k.transpose(-1, -2),
        lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.3,
        lambda q, k: (q @ k.permute(0, 1, 3, 2)) / torch.full([], math.sqrt(D)),
    ],
    ids=["div", "mul", "scaled_q", "scaled_q_and_k", "unscaled", "einsum", "permute_tensor_div"],
)
@pytest.mark.rotating(2)  # a sweep of spellings: half per run, in turn
def test_written_out_scores(spelling):
    fused(lambda q, k, v: softmax_v(spelling(q, k), v), qkv())


def test_einsum_with_heads_second():
    def fn(q, k, v):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)

    q, k, v = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in qkv())
    fused(fn, [q, k, v])


def test_einsum_over_grouped_query_heads():
    """Query heads grouped per key head as a dim of their own (b h g i d): the keys and values
    broadcast over the groups."""
    groups = 2

    def fn(q, k, v):
        q = q.view(B, H, groups, LQ, D)
        s = torch.einsum("b h g i d, b h j d -> b h g i j", q, k) * D**-0.5
        return torch.einsum("b h g i j, b h j d -> b h g i d", s.softmax(-1), v)

    q, k, v = qkv(heads=H * groups, kv_heads=H)
    fused(fn, [q, k, v])


def test_einsum_with_keys_first():
    def fn(q, k, v):
        s = torch.einsum("bhkd,bhqd->bhqk", k, q) * 0.3
        return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)

    fused(fn, qkv())


def test_baddbmm_with_a_scale_and_a_bias():
    def fn(q, k, v, bias):
        qf, kf, vf = (t.reshape(B * H, -1, D) for t in (q, k, v))
        s = torch.baddbmm(bias, qf, kf.transpose(1, 2), beta=0.5, alpha=D**-0.5)
        return torch.bmm(s.softmax(-1), vf)

    fused(fn, [*qkv(), torch.randn(B * H, 1, LK)])


def test_baddbmm_into_an_uninitialized_buffer_with_beta_zero():
    """Megatron-LM's core attention: baddbmm ignores its input at beta 0, whatever it holds."""

    def fn(q, k, v):
        qf, kf, vf = (t.reshape(B * H, -1, D) for t in (q, k, v))
        buffer = torch.full((B * H, LQ, LK), math.nan)
        s = torch.baddbmm(buffer, qf, kf.transpose(1, 2), beta=0.0, alpha=D**-0.5)
        return torch.bmm(s.softmax(-1), vf)

    fused(fn, qkv())


def test_bmm_on_flattened_heads_with_a_per_head_mask():
    def fn(q, k, v, bias):
        qf, kf, vf = (t.reshape(B * H, -1, D) for t in (q, k, v))
        s = torch.bmm(qf, kf.transpose(1, 2)) * D**-0.5 + bias
        return torch.bmm(F.softmax(s, dim=-1), vf).view(B, H, LQ, D)

    fused(fn, [*qkv(), torch.randn(B * H, LQ, LK)])


def test_softmax_upcast_and_cast_back_in_half_precision():
    def fn(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

    fused(fn, qkv(dtype=torch.float16), dtype=torch.float16)


# ---------------------------------------------------------------------------------------------
# written out: masks and biases


def test_additive_padding_mask_built_from_an_attention_mask():
    def fn(q, k, v, attention_mask):
        extended = (1.0 - attention_mask[:, None, None, :].float()) * MIN
        return softmax_v(q @ k.transpose(-1, -2) / math.sqrt(D) + extended, v)

    fused(fn, [*qkv(), padding().view(B, LK).long()])


def bias_grads_key(report) -> dict:
    """The key of the backward kernel that writes the biases' gradients (dq's kernel, or dk and
    dv's where it adds dq too)."""
    (kernel,) = [k for k in report.kernels if "bias_grad" in dict(k.key)]
    return dict(kernel.key)


def test_learned_per_head_bias_gets_its_gradient():
    bias = (torch.randn(1, H, LQ, LK) * 0.5).requires_grad_()
    report = fused(lambda q, k, v, b: softmax_v(q @ k.transpose(-1, -2) + b, v), [*qkv(), bias])
    assert bias_grads_key(report)["bias_grad"] is True


def test_a_bias_that_needs_no_gradient_gets_none():
    report = fused(
        lambda q, k, v, b: softmax_v(q @ k.transpose(-1, -2) + b, v),
        [*qkv(), torch.randn(B, 1, 1, LK)],
    )
    assert bias_grads_key(report)["bias_grad"] is False


def test_bias_added_before_a_scale_is_scaled_with_the_scores():
    bias = torch.randn(B, 1, LQ, LK).requires_grad_()
    fused(lambda q, k, v, b: softmax_v((q @ k.transpose(-1, -2) + b) * 0.3, v), [*qkv(), bias])


@pytest.mark.parametrize(
    "apply_mask",
    [
        lambda s, keep: s.masked_fill(~keep, float("-inf")),
        lambda s, keep: s.masked_fill(keep.logical_not(), MIN),
        lambda s, keep: torch.where(keep, s, MIN),
        lambda s, keep: torch.where(keep, s, torch.tensor(MIN)),
        lambda s, keep: torch.where(~keep, MIN, s),
        lambda s, keep: torch.where(keep, s, torch.zeros(())),
    ],
    ids=[
        "masked_fill_inf",
        "masked_fill_min",
        "where_min",
        "where_tensor_min",
        "where_swapped",
        "where_zeros_tensor",
    ],  # fmt: skip
)
def test_boolean_masks(apply_mask):
    def fn(q, k, v, keep):
        return softmax_v(apply_mask(q @ k.transpose(-1, -2) / math.sqrt(D), keep), v)

    full = torch.rand(B, 1, LQ, LK, generator=torch.Generator().manual_seed(3)) > 0.3
    full[..., 0] = True
    fused(fn, [*qkv(), full])


@pytest.mark.parametrize(
    "apply_causal",
    [
        lambda s, n: torch.where(torch.tril(torch.ones(n, n, dtype=torch.bool)), s, MIN),
        lambda s, n: s.masked_fill(torch.triu(torch.ones(n, n), diagonal=1).bool(), -math.inf),
        lambda s, n: s.masked_fill(torch.tril(torch.ones(n, n)).view(1, 1, n, n) == 0, -1e9),
    ],
    ids=["where_tril", "masked_fill_triu", "tril_eq_zero"],
)
def test_lower_triangle_is_read_as_causal(apply_causal):
    def fn(q, k, v):
        return softmax_v(apply_causal(q @ k.transpose(-1, -2) * 0.3, q.shape[-2]), v)

    report = fused(fn, qkv(lq=6, lk=6))
    (forward,) = [k for k in report.kernels if k.template == "attention_fwd"]
    assert attention_flags(forward) == kernel_flags(causal=True)


def test_causal_with_a_padding_mask():
    def fn(q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.3
        s = s.masked_fill(torch.triu(torch.ones(6, 6, dtype=torch.bool), 1), -math.inf)
        return softmax_v(s.masked_fill(~keep, -math.inf), v)

    fused(fn, [*qkv(lq=6, lk=6), padding(lk=6)])


def test_cross_attention_with_different_lengths():
    q, _, _ = qkv(lq=3)
    _, k, v = qkv(lk=9, seed=1)
    fused(lambda q, k, v: softmax_v(q @ k.transpose(-1, -2) * 0.3, v), [q, k, v])


# ---------------------------------------------------------------------------------------------
# written out: masks from index comparisons, as Hugging Face builds them


def positions(n):
    """Query and key positions broadcast along the scores' last two dims."""
    return torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]


@pytest.mark.parametrize(
    "keep",
    [
        lambda q_idx, kv_idx: kv_idx <= q_idx,
        lambda q_idx, kv_idx: q_idx >= kv_idx,
        lambda q_idx, kv_idx: kv_idx < q_idx + 1,
        lambda q_idx, kv_idx: ~(kv_idx > q_idx),
        lambda q_idx, kv_idx: q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx),
        lambda q_idx, kv_idx: (
            torch.arange(q_idx.shape[-2]).view(-1, 1) >= torch.arange(kv_idx.shape[-1])
        ),
    ],
    ids=["kv_le_q", "q_ge_kv", "kv_lt_q_plus_1", "not_kv_gt_q", "and_masks", "two_dims"],
)
def test_a_causal_mask_from_positions_is_read_as_causal(keep):
    assert key_where_positions_keep(keep) == kernel_flags(causal=True)


def key_where_positions_keep(keep):
    """The forward kernel's key for attention over 10 positions whose scores are kept where
    `keep(q_idx, kv_idx)` holds (`finfo.min` elsewhere), checked against eager."""

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return softmax_v(torch.where(keep(q_idx, kv_idx), scores(q, k), MIN), v)

    return forward_kernel_key(fused(fn, qkv(lq=10, lk=10)))


def test_a_mask_from_positions_that_masks_where_true_is_read_as_causal():
    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return softmax_v(scores(q, k).masked_fill(kv_idx > q_idx, -math.inf), v)

    report = fused(fn, qkv(lq=10, lk=10))
    assert forward_kernel_key(report) == kernel_flags(causal=True)


def test_sdpa_with_a_hugging_face_causal_and_padding_mask_reads_only_the_padding():
    """`kv_idx <= q_idx` & `padding[batch_idx, kv_idx]`, expanded to (B, 1, L, L): the triangle
    goes to the kernel as causal, and the padding is read as the (B, 1, 1, L) gather it is."""

    def fn(q, k, v, padding):
        q_idx, kv_idx = positions(q.shape[-2])
        batch_idx = torch.arange(q.shape[0])[:, None, None, None]
        mask = q_idx.new_ones((), dtype=torch.bool) & (kv_idx <= q_idx)
        mask = (mask & padding[batch_idx, kv_idx]).expand(q.shape[0], -1, -1, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    report = fused(fn, [*qkv(lq=10, lk=10), padding(lk=10).view(B, 10)])
    assert forward_kernel_key(report) == kernel_flags(mask=True, blocks=True, causal=True)


@pytest.mark.parametrize(
    "keep, causal",
    [
        (lambda q_idx, kv_idx: (kv_idx <= q_idx) & (kv_idx > q_idx - 4), True),
        (
            lambda q_idx, kv_idx: (q_idx - 4 < kv_idx) & (kv_idx <= q_idx) & (kv_idx > q_idx - 6),
            True,
        ),
        (lambda q_idx, kv_idx: (q_idx - kv_idx < 3) & (kv_idx - q_idx <= 0), True),
        (lambda q_idx, kv_idx: q_idx - kv_idx < 3, False),
        (lambda q_idx, kv_idx: kv_idx >= q_idx, False),  # a window of 1 without causal
    ],
    ids=["mistral", "two_windows", "differences", "window_only", "upper_triangle"],
)
def test_a_sliding_window_from_positions_is_computed_in_the_kernel(keep, causal):
    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return softmax_v(scores(q, k).masked_fill(~keep(q_idx, kv_idx), -math.inf), v)

    report = fused(fn, qkv(lq=10, lk=10))
    assert forward_kernel_key(report) == kernel_flags(causal=causal, window=True)


@pytest.mark.parametrize(
    "cap",
    [
        lambda s: 50.0 * torch.tanh(s / 50.0),
        lambda s: torch.tanh(s * 0.5) * 2.0,
        lambda s: torch.tanh(s),
    ],
    ids=["gemma2", "scale_inside", "bare_tanh"],
)
def test_soft_capped_scores_are_capped_in_the_kernel(cap):
    def fn(q, k, v, keep):
        s = cap(q @ k.transpose(-1, -2) * 0.3)
        return softmax_v(s.masked_fill(~keep, -math.inf), v)

    report = fused(fn, [*qkv(), padding()])
    assert forward_kernel_key(report) == kernel_flags(mask=True, blocks=True, score_mod=True)


@pytest.mark.parametrize(
    "modify",
    [
        lambda s: s.clamp(-1.5, 1.5),
        lambda s: torch.sigmoid(s) * 4.0,
        lambda s: 3.0 * torch.tanh(s + 0.5),
        lambda s: torch.tanh(torch.tanh(s) * 2.0),
    ],
    ids=["clamp", "sigmoid", "shift_inside", "nested"],
)
def test_element_wise_modifications_of_the_scores_are_computed_in_the_kernel(modify):
    """Any pointwise chain with constants between the product and the mask: generated into the
    kernels with its derivative (clamp's is 0 where it clips)."""

    def fn(q, k, v, keep):
        return softmax_v(modify(scores(q, k)).masked_fill(~keep, -math.inf), v)

    report = fused(fn, [*qkv(), padding()])
    assert forward_kernel_key(report) == kernel_flags(mask=True, blocks=True, score_mod=True)
    (line,) = report.sites
    assert "scores modified as " in line, line


@pytest.mark.parametrize(
    "before_cap, what",
    [
        (lambda s, bias, keep: s + bias, "a bias before aten.tanh.default"),
        (lambda s, bias, keep: s.masked_fill(~keep, -math.inf), "a mask before aten.tanh"),
    ],
    ids=["bias", "mask"],
)
def test_a_tanh_over_more_than_scaled_scores_is_refused(before_cap, what):
    bias = torch.randn(B, 1, LQ, LK)

    def fn(q, k, v, keep):
        return softmax_v(20.0 * torch.tanh(before_cap(scores(q, k), bias, keep) / 20.0), v)

    check_fusion(fn, [*qkv(), padding()], counts={"attention": 0}, missed=[what])


class LearnedFactor(torch.nn.Module):
    """Scores times a learned tensor: `multiply(product, factor)` of this module's `factor`."""

    def __init__(self, shape, multiply):
        super().__init__()
        self.factor = torch.nn.Parameter(torch.rand(shape, generator=torch.Generator()) + 0.5)
        self.multiply = multiply

    def forward(self, q, k, v, keep):
        s = self.multiply(q @ k.transpose(-1, -2), self.factor)
        return softmax_v(s.masked_fill(~keep, -math.inf), v)


@pytest.mark.parametrize(
    "shape, multiply, capped",
    [
        ((H, 1, 1), lambda s, t: s * t.clamp(max=2.0).exp(), False),  # Swin V2's logit scale
        ((), lambda s, t: t * (s * D**-0.5), False),
        ((LQ, 1), lambda s, t: s * t, False),  # per query
        ((LK,), lambda s, t: s / math.sqrt(D) * t, False),  # per key
        ((H, 1, 1), lambda s, t: 5.0 * torch.tanh(s * t / 5.0), True),
        ((), lambda s, t: s / t, False),  # GPT-J's scale_attn as a buffer
        ((H, 1, 1), lambda s, t: 5.0 * torch.tanh(s / t / 5.0), True),
        ((H, 1, 1), lambda s, t: s * t / t.sum(), False),  # two factors
        ((LQ, 1), lambda s, t: torch.sigmoid(t @ torch.ones(1, 1)) * s, False),  # a gate first
    ],
    ids=[
        "per_head",
        "scalar_first",
        "per_query",
        "per_key",
        "inside_a_cap",
        "divided",
        "cap_of_a_quotient",
        "two_factors",
        "gate_from_a_matmul",
    ],
)
@pytest.mark.rotating(2)  # a sweep of spellings: half per run, in turn
def test_a_learned_factor_of_the_product_scales_q_or_k(shape, multiply, capped):
    """A tensor constant along the keys multiplies q, one constant along the queries k: the
    kernel reads them scaled, and autograd takes the factor's gradient from theirs."""
    report = fused(LearnedFactor(shape, multiply), [*qkv(), padding()])
    assert forward_kernel_key(report) == kernel_flags(mask=True, blocks=True, score_mod=capped)


@pytest.mark.parametrize(
    "multiply, what",
    [
        (lambda s, t, bias: s * t, "varies along both queries and keys"),
        (lambda s, t, bias: (s + bias) * t[..., :1], "after an added tensor"),
        (lambda s, t, bias: s * t[..., :1].expand(3, B, 1, LQ, 1), "does not broadcast"),
    ],
    ids=["per_score", "after_a_bias", "more_batch_dims"],
)
def test_a_factor_the_kernel_cannot_move_to_q_or_k_is_refused(multiply, what):
    factor, bias = torch.rand(B, 1, LQ, LK) + 0.5, torch.randn(B, 1, LQ, LK)

    def fn(q, k, v, factor):
        return softmax_v(multiply(scores(q, k), factor, bias), v)

    check_fusion(fn, [*qkv(), factor], counts={"attention": 0}, missed=[what])


def test_a_factor_of_float16_scores_stays_on_the_scores():
    """q / t in float16 can overflow where (q @ k^T) / t does not (q of 300, t of 0.01)."""

    def fn(q, k, v, t):
        return (q @ k.transpose(-1, -2) / t).float().softmax(-1).half() @ v

    q, k, v = qkv(dtype=torch.float16)
    with torch.no_grad():
        q.mul_(300)
    check_fusion(
        fn,
        [q, k, v, torch.full((H, 1, 1), 0.01)],
        counts={"attention": 0},
        missed=["could overflow float16"],
        dtype=torch.float16,
    )


def alibi(heads=H, length=10):
    """ALiBi as MPT builds it: per-head slopes times the key positions, (1, H, 1, L)."""
    slopes = 1.0 / 2 ** torch.arange(1, heads + 1).float()
    return (torch.arange(1 - length, 1).view(1, 1, 1, -1) * slopes.view(1, -1, 1, 1)).float()


def float_causal(length=10, batch=B):
    """Hugging Face's eager mask: 0 where a query may attend (causal), finfo.min elsewhere."""
    q_idx, kv_idx = positions(length)
    return torch.where(kv_idx <= q_idx, 0.0, MIN).expand(batch, 1, length, length)


@pytest.mark.parametrize(
    "add_bias",
    [
        lambda s, keep: s + (alibi() + torch.where(keep, 0.0, MIN) + float_causal()),
        lambda s, keep: s + alibi().masked_fill(float_causal() < -1, MIN),  # Falcon
        lambda s, keep: (s + alibi()).masked_fill(float_causal().bool(), MIN),  # MPT
    ],
    ids=["sum_of_terms", "filled_bias", "float_mask_as_bool"],
)
def test_a_bias_summing_masks_and_alibi_reads_each_at_its_own_size(add_bias):
    """The causal part goes to the kernel, the padding is read as (B, 1, 1, L) and ALiBi as
    (1, H, 1, L): nothing of the scores' size."""

    def fn(q, k, v, keep):
        return softmax_v(add_bias(scores(q, k), keep), v)

    report = fused(fn, [*qkv(lq=10, lk=10), padding(lk=10)])
    (line,) = report.sites
    assert line.split(": ", 2)[2].startswith("causal, "), line
    assert "(1, 2, 1, 10)" in line and ", 10, 10)" not in line, line


# ---------------------------------------------------------------------------------------------
# biases by key - query position


def t5_buckets(relative, bidirectional, buckets=8, max_distance=16):
    """T5's relative-position buckets of key - query, as Hugging Face writes them."""
    bucket = 0
    if bidirectional:
        buckets //= 2
        bucket += (relative > 0).to(torch.long) * buckets
        relative = torch.abs(relative)
    else:
        relative = -torch.min(relative, torch.zeros_like(relative))
    exact = buckets // 2
    large = exact + (
        torch.log(relative.float() / exact) / math.log(max_distance / exact) * (buckets - exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, buckets - 1))
    return bucket + torch.where(relative < exact, relative, large)


class T5Attention(torch.nn.Module):
    """Scores plus a learned table's value at the bucket of key - query (T5 adds it unscaled)."""

    def __init__(self, bidirectional, sdpa=False):
        super().__init__()
        self.table = torch.nn.Embedding(8, H)
        self.bidirectional, self.sdpa = bidirectional, sdpa

    def forward(self, q, k, v, keep):
        lq, lk = q.shape[-2], k.shape[-2]
        relative = torch.arange(lk)[None, :] - torch.arange(lq)[:, None]
        bias = self.table(t5_buckets(relative, self.bidirectional)).permute(2, 0, 1).unsqueeze(0)
        if not self.bidirectional:
            keep = keep & (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None])
        if self.sdpa:  # as transformers' SDPA path passes it: one float mask
            mask = torch.where(keep, bias, MIN).contiguous()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return softmax_v((q @ k.transpose(-1, -2) + bias).masked_fill(~keep, MIN), v)


@pytest.mark.parametrize(
    "bidirectional, sdpa, lq, lk",
    [(True, False, 20, 23), (False, False, 21, 21), (True, True, 20, 23), (False, True, 21, 21)],
    ids=["encoder", "decoder", "encoder-sdpa", "decoder-sdpa"],
)
def test_t5_relative_position_buckets_are_read_per_diagonal(bidirectional, sdpa, lq, lk):
    """The kernel reads the table's value per diagonal, (1, H, 1, Lq + Lk - 1), and sums its
    gradient there; the table's gradient matches eager (checked by `fused`)."""
    report = fused(T5Attention(bidirectional, sdpa), [*qkv(lq=lq, lk=lk), padding(lk=lk)])
    assert forward_kernel_key(report) == kernel_flags(
        mask=True, blocks=True, causal=not bidirectional, relative=True
    )
    assert bias_grads_key(report)["rel_grad"] is True
    (line,) = report.sites
    assert f"bias by key - query position (1, {H}, 1, {lq + lk - 1})" in line, line
    assert f"reads a mask ({B}, 1, 1, {lk})" in line, line


class DistanceAlibi(torch.nn.Module):
    """ALiBi by distance: learned per-head slopes times -|query - key|."""

    def __init__(self):
        super().__init__()
        self.slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25]))

    def forward(self, q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        bias = -(q_idx - kv_idx).abs() * self.slopes.view(1, H, 1, 1)
        return softmax_v(scores(q, k) + bias, v)


class SinkAttention(torch.nn.Module):
    """GPT-OSS's eager attention: a learned logit per head joins each row's softmax (the row's max
    subtracted first, against bfloat16 overflow), its column dropped after it."""

    def __init__(self, shift=True):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
        self.shift = shift

    def forward(self, q, k, v, mask):
        weights = scores(q, k) + mask
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([weights, sinks], dim=-1)
        if self.shift:
            combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=combined.dtype)
        return F.dropout(probs[..., :-1], p=0.0) @ v


@pytest.mark.parametrize("shift", [True, False], ids=["max-shifted", "plain"])
@KERNELS_IN_SLOW_TIER
@pytest.mark.kernels("attention_fwd", "attention_bwd_delta", "attention_bwd_dkdv:with_dq")
def test_attention_sinks_fuse_with_the_sinks_gradient(impl, shift):
    """The sink's column is read as the op's `sink` (the additive mask given, Hugging Face's, as a
    bias), and its gradient matches eager's (checked by `fused`)."""
    causal = torch.full((LQ, LQ), MIN).triu(1).expand(B, 1, LQ, LQ)
    report = fused(SinkAttention(shift), [*qkv(lk=LQ), causal])
    assert forward_kernel_key(report) == kernel_flags(sink=True, bias=True, blocks=True)
    (line,) = report.sites
    assert "a sink logit per query" in line, line


def test_a_sink_column_kept_through_the_matmul_is_refused():
    """Probabilities with the sink's column reaching `@ v` (v given a zero row): not fused, and
    the report says why."""

    def fn(q, k, v, sink):
        combined = torch.cat([scores(q, k), sink.expand(B, H, LQ, 1)], -1)
        return combined.softmax(-1) @ torch.cat([v, torch.zeros(B, H, 1, D)], -2)

    check_fusion(
        fn, [*qkv(), torch.zeros(1, H, 1, 1)], counts={"attention": 0},
        missed=["with the sink's column"],
    )  # fmt: skip


def test_alibi_by_distance_is_read_per_diagonal_with_the_slopes_gradient():
    report = fused(DistanceAlibi(), qkv(lq=18, lk=18))
    assert forward_kernel_key(report) == kernel_flags(relative=True)


def test_alibi_slopes_made_in_the_graph_from_the_head_numbers_are_read_per_diagonal():
    """Slopes computed from an `arange` over the heads (as MPT and BLOOM make theirs) are
    constant along the positions: the causal ALiBi given to SDPA is read per diagonal."""

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        slopes = 2.0 ** -torch.arange(1, H + 1).float()
        bias = (slopes.view(1, H, 1, 1) * (kv_idx - q_idx)).masked_fill(kv_idx > q_idx, -math.inf)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    report = fused(fn, qkv(lq=18, lk=18))
    assert forward_kernel_key(report) == kernel_flags(causal=True, relative=True)


@pytest.mark.parametrize(
    "build", [lambda: T5Attention(False, sdpa=True), DistanceAlibi], ids=["t5-decoder", "alibi"]
)
def test_relative_biases_and_causal_masks_are_read_at_symbolic_sizes(build):
    """With symbolic lengths (`arange(n)[:, None]` is then a slice of the whole arange, and the
    diagonals' count a graph value) the causal mask is still computed and the bias read per
    diagonal; one compile serves two lengths, gradients equal eager's."""
    model = build()
    compiled = torch.compile(model, backend="seqfast")
    for length in (12, 20):
        q, k, v = qkv(lq=length, lk=length, seed=length)
        extra = [padding(lk=length)] if isinstance(model, T5Attention) else []
        for t in (q, k, v, *extra):
            torch._dynamo.mark_dynamic(t, t.dim() - 2 if t.dtype.is_floating_point else 3)
        with collecting() as report:
            out = compiled(q, k, v, *extra)
        expected = model(q, k, v, *extra)
        torch.testing.assert_close(out, expected)
        grads = torch.autograd.grad(out.sum(), [q, *model.parameters()])
        torch.testing.assert_close(
            grads, torch.autograd.grad(expected.sum(), [q, *model.parameters()])
        )
        if length == 12:
            (line,) = report.sites
            assert "bias by key - query position (1, 2, 1, 23)" in line, line
            assert ("causal" in line) == isinstance(model, T5Attention), line
        else:
            assert not report.sites, "a second compile"


@pytest.mark.parametrize(
    "bias",
    [
        lambda q_idx, kv_idx: (q_idx * kv_idx).float() / 50,
        lambda q_idx, kv_idx: ((kv_idx - q_idx) + q_idx).float() / 5,
        lambda q_idx, kv_idx: (kv_idx - q_idx).float().cumsum(-1) / 50,
        lambda q_idx, kv_idx: (kv_idx - q_idx).float() * torch.linspace(0, 1, 10).view(10, 1),
    ],
    ids=["product", "key_only", "cumsum", "scaled_per_query"],
)
def test_a_bias_from_positions_that_is_not_per_diagonal_is_read_as_a_bias(bias):
    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return softmax_v(scores(q, k) + bias(q_idx, kv_idx), v)

    report = fused(fn, qkv(lq=10, lk=10))
    assert forward_kernel_key(report) == kernel_flags(bias=True, blocks=True)


def test_integer_differences_added_to_the_scores_are_read_per_diagonal():
    """An integer bias adds as float32 (type promotion), per diagonal or not."""

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        return softmax_v(scores(q, k) + (kv_idx - q_idx), v)

    assert forward_kernel_key(fused(fn, qkv(lq=10, lk=10))) == kernel_flags(relative=True)


def test_an_offset_cast_to_a_narrow_integer_is_read_at_its_cast_value():
    """300 as uint8 is 44: the diagonals' offsets take the value eager adds."""

    def fn(q, k, v):
        q_idx, kv_idx = positions(q.shape[-2])
        offset = torch.tensor(300.0).to(torch.uint8)
        return softmax_v(scores(q, k) + ((kv_idx - q_idx + offset).float() * 0.05).sin(), v)

    assert forward_kernel_key(fused(fn, qkv(lq=10, lk=10))) == kernel_flags(relative=True)


def test_a_relative_table_whose_gradient_scales_by_frequency_is_read_whole():
    """`scale_grad_by_freq` divides each row's gradient by its count among the scores' indices,
    which the diagonals do not have: the bias is read at the scores' size."""

    class Frequencies(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(8, H, scale_grad_by_freq=True)

        def forward(self, q, k, v):
            relative = torch.arange(k.shape[-2])[None, :] - torch.arange(q.shape[-2])[:, None]
            bias = self.table(relative.clamp(-4, 3) + 4).permute(2, 0, 1)
            return softmax_v(scores(q, k) + bias, v)

    report = fused(Frequencies(), qkv(lq=10, lk=10))
    assert forward_kernel_key(report) == kernel_flags(bias=True, blocks=True)


def test_a_bias_filled_less_than_absorbingly_is_read_whole():
    """where(causal, padding bias, -1e4) with left padding: rows whose every causal key is
    padded see the filled keys at -1e4 beside the padded ones at -1e4, so the bias is read whole
    (split into mask and bias, the kernel would fill exactly -1e4 there)."""

    def fn(q, k, v, padding_bias):
        q_idx, kv_idx = positions(q.shape[-2])
        return softmax_v(scores(q, k) + torch.where(kv_idx <= q_idx, padding_bias, -1e4), v)

    padding_bias = torch.zeros(B, 1, 1, 6)
    padding_bias[0, ..., :2] = -1e4
    report = fused(fn, [*qkv(lq=6, lk=6), padding_bias])
    assert forward_kernel_key(report) == kernel_flags(bias=True, blocks=True)


def test_a_bias_of_zeros_and_a_comparison_that_keeps_every_query_are_dropped():
    """T5's cross-attention adds a zero position bias; Hugging Face's bidirectional mask tests
    `q_idx >= 0`: neither is read, the padding stays (B, 1, 1, Lk)."""

    def fn(q, k, v, keep):
        q_idx = torch.arange(q.shape[-2])[None, None, :, None]
        bias = torch.zeros(1, H, q.shape[-2], k.shape[-2])
        mask = torch.where((q_idx >= 0) & keep, bias, MIN)
        return softmax_v(scores(q, k) + mask, v)

    report = fused(fn, [*qkv(), padding()])
    assert forward_kernel_key(report) == kernel_flags(mask=True, blocks=True)
    (line,) = report.sites
    assert f"reads a mask ({B}, 1, 1, {LK})" in line, line


# ---------------------------------------------------------------------------------------------
# prefix LM masks


def prefix_lengths():
    """Per-row prefix lengths of a batch of 20 tokens: one inside the first 16-key block, one
    across it."""
    return torch.tensor([5, 18])


@pytest.mark.parametrize(
    "keep",
    [
        lambda q_idx, kv_idx, n: (kv_idx <= q_idx) | (kv_idx < 7),
        lambda q_idx, kv_idx, n: (q_idx >= kv_idx) | (kv_idx <= 6),
        lambda q_idx, kv_idx, n: (kv_idx <= q_idx) | (kv_idx < n[:, None, None, None]),
        lambda q_idx, kv_idx, n: ~((kv_idx > q_idx) & (n.view(-1, 1, 1, 1) <= kv_idx)),
    ],
    ids=["constant", "constant_flipped", "per_row", "per_row_negated"],
)
def test_a_prefix_lm_mask_widens_causal_in_the_kernel(keep):
    """Every query sees the prefix's keys and the rest causally: the kernel computes both, with
    the padding read as (B, 1, 1, Lk)."""

    def fn(q, k, v, lengths, pad):
        q_idx, kv_idx = positions(q.shape[-2])
        mask = keep(q_idx, kv_idx, lengths) & pad
        return softmax_v(scores(q, k) + torch.where(mask, 0.0, MIN), v)

    report = fused(fn, [*qkv(lq=20, lk=20), prefix_lengths(), padding(lk=20)])
    assert forward_kernel_key(report) == kernel_flags(causal=True, prefix=True, mask=True)
    (line,) = report.sites
    assert "causal after a prefix" in line and f"reads a mask ({B}, 1, 1, 20)" in line, line


def either(q_idx, kv_idx, length):
    return (kv_idx <= q_idx) | (kv_idx < length)


@pytest.mark.parametrize(
    "keep, computed",
    [
        (lambda q_idx, kv_idx, n: either(q_idx, kv_idx, 7) & (q_idx - kv_idx < 4), ["window"]),
        (
            lambda q_idx, kv_idx, n: (
                either(q_idx, kv_idx, 7) & either(q_idx, kv_idx, n[:, None, None, None])
            ),
            ["causal", "prefix"],
        ),
        (lambda q_idx, kv_idx, n: either(q_idx, kv_idx, 7) & (kv_idx <= q_idx), ["causal"]),
    ],
    ids=["beside_a_window", "two_prefixes", "beside_causal"],
)
def test_prefixes_the_kernel_cannot_combine_are_read_as_masks(keep, computed):
    """Beside a window or another prefix, a prefix's factor is read as a mask (the window, the
    other prefix computed); beside plain causal it adds nothing."""

    def fn(q, k, v, lengths):
        q_idx, kv_idx = positions(q.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep(q_idx, kv_idx, lengths))

    key = forward_kernel_key(fused(fn, [*qkv(lq=20, lk=20), prefix_lengths()]))
    read = computed != ["causal"]
    lists = read and "prefix" not in computed  # (a prefix keeps its own loops)
    assert key == kernel_flags(mask=read, blocks=lists, **dict.fromkeys(computed, True)), key


def prefix_lm(q, k, v, lengths, pad):
    q_idx, kv_idx = positions(q.shape[-2])
    mask = ((kv_idx <= q_idx) | (kv_idx < lengths[:, None, None, None])) & pad
    return softmax_v(scores(q, k) + torch.where(mask, 0.0, MIN), v)


def clamped_causal(q, k, v, lengths, pad):
    q_idx, kv_idx = positions(q.shape[-2])
    return softmax_v(scores(q, k).clamp(-2, 2).masked_fill(kv_idx > q_idx, -math.inf), v)


def capped_window(q, k, v, lengths, pad):
    """Mistral's window and Gemma 2's cap, with the padding read per key."""
    q_idx, kv_idx = positions(q.shape[-2])
    keep = (kv_idx <= q_idx) & (kv_idx > q_idx - 6) & pad
    return softmax_v(torch.where(keep, 30.0 * torch.tanh(scores(q, k) / 30.0), MIN), v)


def packed_documents(q, k, v, lengths, pad):
    q_idx, kv_idx = positions(q.shape[-2])
    doc = three_documents()
    same = doc[:, None, :, None] == doc[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=same & (kv_idx <= q_idx))


@pytest.mark.parametrize(
    "build",
    [
        lambda: prefix_lm,
        lambda: clamped_causal,
        lambda: capped_window,
        lambda: packed_documents,
        lambda: DistanceAlibi(),
        lambda: T5Attention(bidirectional=False),
    ],
    ids=["prefix_lm", "clamp", "capped_window", "documents", "alibi_by_distance", "t5_buckets"],
)
def test_nothing_of_the_scores_size_is_kept_for_the_backward(build):
    """What the kernel computes from positions, ids or a diagonal's values is never built at
    (Lq, Lk), so nothing that size is saved for the backward (20 positions, heads of 8): neither
    in the memory model's plan nor in what autograd is handed."""
    fn = build()
    q, k, v = qkv(lq=20, lk=20)
    extra = [] if isinstance(fn, DistanceAlibi) else [padding(lk=20)]
    if not isinstance(fn, T5Attention | DistanceAlibi):
        extra = [prefix_lengths(), padding(lk=20)]
    compiled = torch.compile(fn, backend="seqfast")
    lasting = [q, k, v, *extra] + (list(fn.parameters()) if isinstance(fn, torch.nn.Module) else [])
    with collecting() as report:
        saved = saved_tensors(lambda: compiled(q, k, v, *extra).sum(), lasting)
    assert report.counts["attention"] == 1, report
    assert not [t.shape for t in saved.values() if t.dim() >= 2 and t.shape[-2:] == (20, 20)]
    (plan,) = report.memory
    assert plan.step.kept_shapes and not [s for s in plan.step.kept_shapes if s[-2:] == (20, 20)]


def three_documents():
    """Document ids of a packed batch of 2 rows of 20 tokens: three documents, then two."""
    return torch.tensor([[0] * 6 + [1] * 9 + [2] * 5, [0] * 13 + [1] * 7])


@pytest.mark.parametrize(
    "keep",
    [
        lambda doc, q_idx, kv_idx, b_idx: doc[:, None, :, None] == doc[:, None, None, :],
        lambda doc, q_idx, kv_idx, b_idx: doc[b_idx, q_idx] == doc[b_idx, kv_idx],
        lambda doc, q_idx, kv_idx, b_idx: ~(doc[b_idx, kv_idx] != doc[b_idx, q_idx]),
    ],
    ids=["views", "gathers", "not_different"],
)
def test_packed_documents_are_compared_in_the_kernel(keep):
    """With causal, as a packed batch is trained: the kernel gets the ids, reads no mask, and
    skips the blocks where no query shares a key's document."""

    def fn(q, k, v, doc):
        q_idx, kv_idx = positions(q.shape[-2])
        b_idx = torch.arange(q.shape[0])[:, None, None, None]
        mask = (kv_idx <= q_idx) & keep(doc, q_idx, kv_idx, b_idx)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    report = fused(fn, [*qkv(lq=20, lk=20), three_documents()])
    assert forward_kernel_key(report) == kernel_flags(causal=True, documents=True)


def runs_of(position_ids):
    """Document ids of packed rows as Hugging Face derives them: a new document wherever the
    position ids do not go up by one."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


@pytest.mark.parametrize("derived", [True, False], ids=["runs_of_the_positions", "other_ids"])
def test_position_ids_compared_within_their_runs_are_causal(derived):
    """`pos[b, kv] <= pos[b, q]` beside `doc[b, q] == doc[b, kv]`: where the documents are the
    runs of the position ids, the comparison is the causal triangle; with other ids it is data."""

    def fn(q, k, v, pos, other):
        b_idx = torch.arange(q.shape[0])[:, None, None, None]
        q_idx, kv_idx = positions(q.shape[-2])
        doc = runs_of(pos) if derived else other
        mask = (doc[b_idx, q_idx] == doc[b_idx, kv_idx]) & (pos[b_idx, kv_idx] <= pos[b_idx, q_idx])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    pos = torch.tensor([list(range(6)) + list(range(9)) + list(range(5)), list(range(20))])
    report = fused(fn, [*qkv(lq=20, lk=20), pos, three_documents()])
    expected = (
        kernel_flags(causal=True, documents=True)
        if derived
        else kernel_flags(mask=True, documents=True)
    )
    assert forward_kernel_key(report) == expected


def test_a_comparison_of_ids_along_one_axis_is_read_as_a_mask():
    """Ids that vary along the keys on both sides are no query-to-key document test."""

    def fn(q, k, v, doc):
        return softmax_v(scores(q, k).masked_fill(doc[:, None, None, :] != 0, -math.inf), v)

    doc = torch.zeros(B, LK, dtype=torch.int64)
    doc[:, -2:] = 1
    report = fused(fn, [*qkv(), doc])
    assert forward_kernel_key(report) == kernel_flags(mask=True, blocks=True)


def test_the_report_says_what_each_site_computes_and_how_many_blocks_it_visits():
    """40 positions in 16x16 tiles (CPU), causal with a window of 5: the first query block
    visits 1 key block, the others 2 each, of 9."""

    def fn(q, k, v, keep):
        q_idx, kv_idx = positions(q.shape[-2])
        window = (kv_idx <= q_idx) & (q_idx - kv_idx < 5)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window & keep)

    report = fused(fn, [*qkv(lq=40, lk=40), padding(lk=40)])
    (line,) = report.sites
    assert line.endswith(
        "causal, sliding window 5, reads a mask (2, 1, 1, 40) by block lists made on each call"
        " (the kernels skip the blocks it hides whole, compute the lower triangle where it"
        " holds one and read it where it hides some);"
        " the forward visits 5 of 9 16x16 blocks per head, less those the mask hides whole"
    ), line


@pytest.mark.parametrize("fill", [-math.inf, torch.finfo(torch.float32).min], ids=["-inf", "min"])
def test_the_report_says_a_mask_tensor_is_read_by_its_block_lists(fill):
    """A mask that is the only thing hiding scores is read by block lists made on each call:
    with -inf the kernels skip the blocks it hides whole, with a finite fill they visit them."""

    def fn(q, k, v, keep):
        scores = (q @ k.transpose(-2, -1)).masked_fill(~keep, fill)
        return scores.softmax(-1) @ v

    report = fused(fn, [*qkv(lq=40, lk=40), padding(lk=40)])
    (line,) = report.sites
    skipped = "skip the blocks it hides whole, " if fill == -math.inf else ""
    assert (
        f"reads a mask (2, 1, 1, 40) by block lists made on each call (the kernels {skipped}"
        "compute the lower triangle where it holds one and read it where it hides some); the"
        " forward visits 9 of 9 16x16 blocks per head"
    ) in line, line
    assert line.endswith(", less those the mask hides whole") == (fill == -math.inf), line


@pytest.mark.parametrize(
    "lq, lk, causal, window",
    [(40, 40, True, 5), (40, 40, False, 17), (33, 70, True, 0)],
)
def test_the_counted_blocks_and_pairs_are_those_causal_and_window_leave(lq, lk, causal, window):
    keep = diagonal_keep(lq, lk, causal, window, torch.device("cpu"))
    assert visible_pairs(lq, lk, causal, window) == int(keep.sum())
    blocks = F.pad(keep, (0, -lk % 16, 0, -lq % 16)).view(-(-lq // 16), 16, -(-lk // 16), 16)
    visible = int(blocks.any(3).any(1).sum())
    assert key_blocks(lq, lk, causal, window, BLOCK_M=16, BLOCK_N=16) == (
        visible,
        blocks.shape[0] * blocks.shape[2],
    )


@pytest.mark.parametrize(
    "keep",
    [
        lambda q_idx, kv_idx: kv_idx <= q_idx + 1,
        lambda q_idx, kv_idx: kv_idx - 2 * q_idx <= 0,
        lambda q_idx, kv_idx: (kv_idx <= q_idx + 1) | (kv_idx < 3),
        lambda q_idx, kv_idx: kv_idx > q_idx,
        # uint8 differences wrap around: a future key is 255 or less, which the test keeps
        lambda q_idx, kv_idx: q_idx.to(torch.uint8) - kv_idx.to(torch.uint8) < 3,
    ],
    ids=["shifted_diagonal", "scaled_difference", "shifted_or_prefix", "future_only", "uint8"],
)
def test_a_mask_from_positions_that_is_not_causal_is_read_as_a_mask(keep):
    assert key_where_positions_keep(keep) == kernel_flags(mask=True, blocks=True)


# ---------------------------------------------------------------------------------------------
# nn.MultiheadAttention


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_with_key_padding(need_weights):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def fn(x, pad):
        return mha(x, x, x, key_padding_mask=pad, need_weights=need_weights)[0]

    fused(fn, [x, pad])


def test_multihead_attention_with_a_causal_float_mask():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    fused(lambda x: mha(x, x, x, attn_mask=causal, need_weights=False)[0], [x])


# ---------------------------------------------------------------------------------------------
# dropout


def written_out_dropout(q, k, v, p):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return F.dropout(torch.softmax(s, -1), p, training=True) @ v


def sdpa_dropout(q, k, v, p):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("spelling", [written_out_dropout, sdpa_dropout], ids=["written", "sdpa"])
def test_dropout_keeps_one_minus_p_scales_kept_and_backward_agrees(spelling):
    # q = k = 0 makes every probability 1/lk; with v = I each output row shows its probabilities
    # after dropout, and dv[b, j] is nonzero exactly where the backward kept (b, 0, j).
    p, lk, batch = 0.25, 256, 4
    q = torch.zeros(batch, 1, 1, lk, requires_grad=True)
    k = torch.zeros(batch, 1, lk, lk)
    v = torch.eye(lk).repeat(batch, 1, 1, 1).requires_grad_()
    compiled = torch.compile(lambda q, k, v: spelling(q, k, v, p), backend="seqfast")
    with collecting() as report:
        torch.manual_seed(0)
        out = compiled(q, k, v)
    assert report.counts["attention"] == 1
    rows = out.detach().view(batch, lk)
    kept = rows != 0
    assert torch.allclose(rows[kept], torch.full_like(rows[kept], 1 / (lk * (1 - p))))
    ratio = kept.float().mean().item()
    assert abs(ratio - (1 - p)) < 4 * math.sqrt(p * (1 - p) / kept.numel())
    out.sum().backward()
    assert torch.equal(v.grad.view(batch, lk, lk).abs().sum(-1) != 0, kept)


def test_dropout_repeats_under_the_same_seed_and_changes_with_another():
    q, k, v = qkv(lq=16, lk=16)
    compiled = torch.compile(lambda q, k, v: written_out_dropout(q, k, v, 0.5), backend="seqfast")
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(compiled(q, k, v).detach())
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


# ---------------------------------------------------------------------------------------------
# refusals


def test_returned_attention_weights_stay_unfused():
    def fn(q, k, v):
        probs = torch.softmax(q @ k.transpose(-1, -2) * 0.3, dim=-1)
        return probs @ v, probs

    check_fusion(fn, qkv(), counts={"attention": 0}, missed=["read outside the attention"])


def test_softmax_over_another_dimension_stays_unfused():
    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-2) @ v

    check_fusion(fn, qkv(lq=6, lk=6), counts={"attention": 0}, missed=["softmax over dim -2"])


def test_head_dim_over_256_stays_unfused():
    check_fusion(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        qkv(batch=1, heads=1, lq=3, lk=3, d=320),
        counts={"attention": 0},
        missed=["head dim 320 > 256"],
    )


def test_masked_fill_with_a_tensor_value_stays_unfused():
    def fn(q, k, v, keep, value):
        return softmax_v((q @ k.transpose(-1, -2)).masked_fill(~keep, value), v)

    check_fusion(
        fn,
        [*qkv(), padding(), torch.tensor(-1e4)],
        counts={"attention": 0},
        missed=["masked_fill with a tensor value"],
    )


# ---------------------------------------------------------------------------------------------
# the generated kernels through the compiled path


@pytest.mark.kernels("attention_fwd", "attention_bwd_delta", "attention_bwd_dkdv:with_dq")
def test_compiled_attention_runs_the_kernels_under_the_interpreter(interpret):
    def fn(q, k, v, keep, bias):
        s = q @ k.transpose(-1, -2) / math.sqrt(D) + bias
        return softmax_v(s.masked_fill(~keep, -math.inf), v)

    bias = torch.randn(1, H, LQ, LK).requires_grad_()
    report = fused(fn, [*qkv(), padding(), bias])
    assert {k.spec.name for k in report.kernels} >= {
        "attention_fwd", "attention_bwd_delta", "attention_bwd_dkdv:with_dq"
    }  # fmt: skip


class BufferMasked(torch.nn.Module):
    """Attention whose mask is a module buffer, as nanoGPT keeps its causal triangle."""

    def __init__(self, length):
        super().__init__()
        self.register_buffer("keep", torch.ones(length, length, dtype=torch.bool).tril())

    def forward(self, q, k, v):
        n = q.shape[-2]
        return softmax_v(scores(q, k).masked_fill(~self.keep[:n, :n], -math.inf), v)


class BufferBiased(torch.nn.Module):
    """Attention whose mask is a module buffer of 0 and -inf added to the scores."""

    def __init__(self, keep):
        super().__init__()
        self.register_buffer("hidden", torch.zeros(keep.shape).masked_fill(~keep, -math.inf))

    def forward(self, q, k, v):
        n = q.shape[-2]
        return softmax_v(scores(q, k) + self.hidden[:n, :n], v)


@pytest.mark.parametrize("kind", ["mask", "bias", "window", "input", "meta"])
def test_the_report_counts_the_blocks_of_a_buffer_at_compile_time(kind):
    """A mask or additive bias computed from the model's buffers alone is counted at its
    compile-time value, as the forward's block lists will hold it: nanoGPT's triangle at 40
    tokens (3 x 3 blocks of the CPU's 16 x 16 tiles) is 1 block visited whole and 5 computing the
    triangle (the diagonal's, and those below it crossing the last row), none reading it; a window
    is read where it hides some; a mask given as an input, or a buffer on the meta device, is not
    counted."""
    length = 40
    q_idx, kv_idx = torch.arange(length)[:, None], torch.arange(length)[None, :]
    triangle = kv_idx <= q_idx
    inputs = qkv(lq=length, lk=length)
    if kind == "meta":  # (as the memory planner's dry runs compile: no values to count)
        model = BufferMasked(length).to("meta")
        with collecting() as report:
            torch.compile(model, backend="seqfast")(*(t.to("meta") for t in inputs))
        (line,) = report.sites
        assert "at compile time" not in line, line
        return
    if kind == "input":
        masked = lambda q, k, v, keep: softmax_v(scores(q, k).masked_fill(~keep, -math.inf), v)  # noqa: E731
        (line,) = fused(masked, [*inputs, triangle]).sites
        assert "at compile time" not in line, line
        return
    model = {
        "mask": BufferMasked(length),
        "bias": BufferBiased(triangle),
        "window": BufferBiased(triangle & (q_idx - kv_idx < 5)),
    }[kind]
    (line,) = seqcompile.explain(model, *inputs).sites
    counted = {
        "mask": " it is the causal triangle, and the forward visits 6 blocks per head: 1 whole,"
        " 5 computing the triangle, 0 reading it",
        "bias": " it is the causal triangle, and the forward visits 6 blocks per head: 1 whole,"
        " 5 computing the triangle, 0 reading it",
        "window": " the forward visits 5 blocks per head: 0 whole, 0 computing the"
        " triangle, 5 reading it",
    }
    assert line.endswith(counted[kind]), line


@pytest.mark.slow  # three compiled steps under the interpreter
@pytest.mark.kernels(
    "attention_blocks", "attention_fwd", "attention_bwd_delta", "attention_bwd_dkdv:with_dq"
)  # fmt: skip
def test_a_mask_buffer_edited_in_place_is_read_as_it_is_on_each_call(interpret):
    """The triangle a buffer holds is read by block lists made on each call: edited in place
    into a window, then into padding, the compiled model gives eager's answer each time."""
    length = 40
    model = BufferMasked(length)
    compiled = torch.compile(model, backend="seqfast")
    q_idx, kv_idx = torch.arange(length)[:, None], torch.arange(length)[None, :]
    edits = {
        "causal": model.keep.clone(),
        "window": (kv_idx <= q_idx) & (q_idx - kv_idx < 5),
        "padding": (kv_idx < 21).expand(length, length),
    }
    for name, keep in edits.items():
        model.keep.copy_(keep)
        q, k, v = (t.requires_grad_() for t in qkv(lq=length, lk=length, seed=len(name)))
        with collecting() as report:
            out = compiled(q, k, v)
        expected = model(q, k, v)
        torch.testing.assert_close(out, expected, msg=name)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        want = torch.autograd.grad(expected.sum(), (q, k, v))
        torch.testing.assert_close(grads, want, msg=name)
        if name == "causal":
            (line,) = report.sites
            assert "reads a mask (40, 40) by block lists" in line, line


# ---------------------------------------------------------------------------------------------
# masks that only look causal, and orders the kernel cannot follow


def forward_kernel_key(report):
    (forward,) = [k for k in report.kernels if k.template == "attention_fwd"]
    return attention_flags(forward)


def scores(q, k):
    return q @ k.transpose(-1, -2) * D**-0.5


@pytest.mark.parametrize(
    "apply",
    [
        lambda s, n: s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), 0.0),
        lambda s, n: torch.where(torch.tril(torch.ones(n, n, dtype=torch.bool)), s, 5.0),
        # ~ of an integer is not logical not: ~1 = -2 and ~0 = -1, so every key is masked
        lambda s, n: s.masked_fill((~torch.tril(torch.ones(n, n, dtype=torch.long))).bool(), MIN),
        # one row of the triangle broadcast over every query keeps key 0 only
        lambda s, n: s.masked_fill(torch.tril(torch.ones(n, n, dtype=torch.bool))[:1] == 0, -1e9),
        # ones a cast or a product makes 0 (or NaN): 0.5 as an integer, int16 wrapping, 0 * inf
        lambda s, n: s.masked_fill(torch.full((n, n), 0.5).tril().long() == 0, -1e9),
        lambda s, n: s.masked_fill(torch.ones(n, n, dtype=torch.int16).tril() * 65536 == 0, -1e9),
        lambda s, n: s.masked_fill(torch.ones(n, n).tril() * math.inf == 0, -1e9),
    ],
    ids=[
        "zero_fill",
        "positive_fill",
        "integer_bitwise_not",
        "one_row_broadcast",
        "cast_to_zero",
        "integer_wrap",
        "times_inf",
    ],
)
@pytest.mark.rotating(2)  # a sweep of spellings: half per run, in turn
def test_a_triangle_that_is_not_causal_is_read_as_a_mask(apply):
    report = fused(lambda q, k, v: softmax_v(apply(scores(q, k), q.shape[-2]), v), qkv(6, 6))
    assert forward_kernel_key(report) == kernel_flags(mask=True, blocks=True)


def ones(n, rows=None):
    return torch.ones(rows or n, n, dtype=torch.bool)


@pytest.mark.parametrize(
    "apply, computed",
    [
        (lambda s, n: s.masked_fill(~ones(n).tril().triu(-3), -math.inf), ["causal", "window"]),
        (lambda s, n: torch.where(ones(n).triu(-3).tril(), s, MIN), ["causal", "window"]),
        (lambda s, n: s.masked_fill(ones(n).tril(-4), -math.inf), ["window"]),
        (
            lambda s, n: s.masked_fill(ones(n).triu(1) | ~ones(n).triu(-3), MIN),
            ["causal", "window"],
        ),
    ],
    ids=["band", "band_other_order", "masked_below_the_window", "masked_outside_the_band"],
)
def test_a_band_of_ones_is_computed_as_causal_and_a_window(apply, computed):
    """`ones.tril().triu(1 - w)` keeps causal keys within a window of w (Mistral's reference
    code): the kernel computes both and reads no mask."""
    report = fused(lambda q, k, v: softmax_v(apply(scores(q, k), q.shape[-2]), v), qkv(18, 18))
    assert forward_kernel_key(report) == kernel_flags(**dict.fromkeys(computed, True))
    (line,) = report.sites
    assert "sliding window 4" in line, line


def neg_inf(n):
    return torch.full((n, n), -math.inf)


@pytest.mark.parametrize(
    "triangle, computed",
    [
        (lambda n: torch.nn.Transformer.generate_square_subsequent_mask(n), ["causal"]),
        (lambda n: torch.full((n, n), MIN).triu(1)[None, None], ["causal"]),
        (lambda n: torch.triu(torch.ones(n, n), 1) * -1e9, ["causal"]),
        (lambda n: neg_inf(n).triu(1) + neg_inf(n).tril(-4), ["causal", "window"]),
    ],
    ids=["nn_transformer", "finfo_min", "ones_times_fill", "band"],
)
def test_a_float_triangle_of_a_masking_fill_is_computed(triangle, computed):
    """nn.Transformer's causal mask, `triu(full(-inf), 1)`, added to the scores: the kernel
    computes the triangle and reads no bias."""
    report = fused(lambda q, k, v: softmax_v(scores(q, k) + triangle(q.shape[-2]), v), qkv(18, 18))
    assert forward_kernel_key(report) == kernel_flags(**dict.fromkeys(computed, True))


@pytest.mark.parametrize("fill", [-3.0, 5.0])
def test_a_triangle_of_a_fill_that_does_not_mask_is_read_as_a_bias(fill):
    report = fused(
        lambda q, k, v: softmax_v(scores(q, k) + torch.full((6, 6), fill).triu(1), v), qkv(6, 6)
    )
    assert forward_kernel_key(report) == kernel_flags(bias=True, blocks=True)


def test_a_mask_compared_with_zero_is_split_into_its_factors():
    """The Annotated Transformer's `masked_fill(mask == 0, -1e9)` of padding & a subsequent
    mask (`triu(ones, 1).type(uint8) == 0`): causal computed, the padding read per key."""

    def fn(q, k, v, keep):
        subsequent = torch.triu(torch.ones(1, LQ, LQ), diagonal=1).type(torch.uint8) == 0
        return softmax_v(scores(q, k).masked_fill((keep & subsequent) == 0, -1e9), v)

    report = fused(fn, [*qkv(LQ, LQ), padding(lk=LQ)])
    assert forward_kernel_key(report) == kernel_flags(causal=True, mask=True, blocks=True)
    (line,) = report.sites
    assert f"reads a mask ({B}, 1, 1, {LQ})" in line, line


@pytest.mark.parametrize(
    "apply",
    [
        lambda s, n: s.masked_fill(~ones(16).tril()[:n, :n], -math.inf),
        lambda s, n: s.masked_fill(~ones(16, rows=n).tril()[..., :n], -math.inf),
        lambda s, n: s.masked_fill(torch.ones(n, n).tril() * 3.0 == 0, -1e9),
    ],
    ids=["top_left_block", "top_left_columns", "times_a_constant"],
)
def test_a_top_left_block_of_a_triangle_is_causal(apply):
    report = fused(lambda q, k, v: softmax_v(apply(scores(q, k), q.shape[-2]), v), qkv(6, 6))
    assert forward_kernel_key(report) == kernel_flags(causal=True)


@pytest.mark.parametrize(
    "apply",
    [
        lambda s: s.masked_fill(~torch.ones(8, 5, dtype=torch.bool).tril().triu(-2), -1e9),
        lambda s: s + torch.full((8, 5), -1e9).tril(-3),
    ],
    ids=["band", "float_triangle"],
)
def test_a_window_that_leaves_a_query_no_key_under_a_finite_fill_is_read_as_a_mask(apply):
    """8 queries, 5 keys and a window of 3: the last queries see no key, so eager averages
    them over every key at the fill, which a kernel skipping the window's keys cannot."""
    report = fused(lambda q, k, v: softmax_v(apply(scores(q, k)), v), qkv(8, 5))
    assert not forward_kernel_key(report)["window"]


@pytest.mark.parametrize(
    "apply",
    [
        lambda s, n: torch.where(ones(n, rows=1).tril(), s, -math.inf),  # keeps key 0 only
        lambda s, n: s.masked_fill(~ones(n).tril(1), -math.inf),
        lambda s, n: s.masked_fill(~ones(n).tril(1).triu(-2), -math.inf),
    ],
    ids=["one_row", "shifted_diagonal", "band_past_the_diagonal"],
)
def test_triangles_the_kernel_cannot_compute_are_read_as_masks(apply):
    report = fused(lambda q, k, v: softmax_v(apply(scores(q, k), q.shape[-2]), v), qkv(6, 6))
    assert forward_kernel_key(report)["mask"], report.sites


def written_after_causal(q, k, v):
    """UniLM's prefix LM: a causal triangle, the first keys then opened in place."""
    mask = ones(q.shape[-2]).tril()
    mask[:, :5] = True
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def window_with_a_sink(q, k, v):
    """StreamingLLM: a causal window whose first key every query keeps, set in place."""
    q_idx, kv_idx = positions(q.shape[-2])
    keep = (kv_idx <= q_idx) & (kv_idx > q_idx - 4)
    keep[..., 0] = True
    return softmax_v(scores(q, k).masked_fill(~keep, -math.inf), v)


def alibi_with_a_free_first_key(q, k, v):
    q_idx, kv_idx = positions(q.shape[-2])
    bias = -(q_idx - kv_idx).abs().float() * torch.tensor([0.5, 0.25]).view(1, H, 1, 1)
    bias[..., 0] = 0.0
    return softmax_v(scores(q, k) + bias, v)


def positions_restarted_in_place(q, k, v):
    where = torch.arange(q.shape[-2])
    where[6:] -= 6
    return F.scaled_dot_product_attention(q, k, v, attn_mask=where[None, :] <= where[:, None])


def zeros_filled_in_place(q, k, v):
    bias = torch.zeros(1, H, q.shape[-2], k.shape[-2])
    bias[..., :3] = -2.0
    return softmax_v(scores(q, k) + bias, v)


@pytest.mark.parametrize(
    "fn",
    [
        written_after_causal,
        window_with_a_sink,
        alibi_with_a_free_first_key,
        positions_restarted_in_place,
        zeros_filled_in_place,
    ],
    ids=["prefix_opened", "window_sink", "alibi_edited", "positions_edited", "zeros_filled"],
)
def test_a_mask_or_bias_written_in_place_is_read_as_it_is(fn):
    """An in-place write into what a mask or bias is computed from changes it after the ops that
    made it: the kernel reads the tensor instead of computing it from those ops."""
    report = fused(fn, qkv(13, 13))
    assert not any(forward_kernel_key(report)[f] for f in ("causal", "window", "relative"))


def test_a_finite_fill_before_a_bias_stays_unfused():
    # eager's masked scores are -1e4 + bias; the kernel fills after adding the bias
    keep = torch.ones(B, 1, LQ, LK, dtype=torch.bool)
    keep[:, :, 0] = False
    bias = torch.randn(1, H, LQ, LK).requires_grad_()

    def fn(q, k, v, keep, bias):
        return softmax_v(scores(q, k).masked_fill(~keep, -1e4) + bias, v)

    check_fusion(
        fn, [*qkv(), keep, bias], counts={"attention": 0}, missed=["bias is added after a mask"]
    )


def test_a_constant_added_to_every_score_changes_nothing():
    fused(lambda q, k, v: softmax_v(scores(q, k) + 1.0, v), qkv())


def test_a_one_dimensional_key_operand_stays_unfused():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, LQ, D, generator=g).requires_grad_()
    w = torch.randn(D, generator=g).requires_grad_()
    v = torch.randn(LQ, D, generator=g).requires_grad_()
    check_fusion(
        lambda q, w, v: torch.softmax(q @ w, dim=-1) @ v,
        [q, w, v],
        counts={"attention": 0},
        missed=["key operand of q @ k^T is 1-D"],
    )


def test_float32_values_keep_a_float32_result():
    g = torch.Generator().manual_seed(0)
    # small integers: q @ k^T is exact in bf16, so eager and fused see the same scores
    q = torch.randint(-1, 2, (B, H, LQ, D), generator=g).bfloat16()
    k = torch.randint(-1, 2, (B, H, LK, D), generator=g).bfloat16()
    v = torch.randn(B, H, LK, D, generator=g).requires_grad_()
    fused(lambda q, k, v: softmax_v((q @ k.transpose(-1, -2)).float() * 0.25, v), [q, k, v])


def test_heads_merged_with_a_view_after_the_layout_sdpa_returns():
    """SDPA on heads-inner q (split from one projection) returns heads-inner strides, so
    `transpose(1, 2)` is already contiguous there and `.contiguous().view(B, L, C)` copies nothing:
    the fused output must come back in that layout for the view to hold (nanoGPT's spelling)."""
    g = torch.Generator().manual_seed(0)
    qkv_proj = torch.randn(B, LQ, 3 * H * D, generator=g, requires_grad=True)

    def attention(x):
        q, k, v = (t.view(B, LQ, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).contiguous().view(B, LQ, H * D)

    fused(attention, [qkv_proj])


def test_heads_split_out_of_the_batch_for_a_mask_and_merged_back_for_bmm():
    """BLOOM's spelling: baddbmm on flattened heads adds a per-head (B*H, 1, Lk) bias, the scores
    are viewed as (B, H, Lq, Lk) for a (B, 1, Lq, Lk) mask, and the probabilities viewed back for
    bmm with the flattened values."""
    alibi = torch.randn(B * H, 1, LK, requires_grad=True)
    mask = torch.where(padding(), 0.0, MIN).expand(B, 1, LQ, LK).contiguous()

    def fn(q, k, v, alibi, mask):
        qf, kf, vf = (t.reshape(B * H, -1, D) for t in (q, k, v))
        scores = alibi.baddbmm(qf, kf.transpose(-1, -2), beta=1.0, alpha=D**-0.5)
        weights = scores.view(B, H, LQ, -1) + mask
        probs = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs.view(B * H, LQ, -1), vf)
        return out.view(B, H, LQ, D).permute(0, 2, 1, 3).reshape(B, LQ, H * D)

    fused(fn, [*qkv(), alibi, mask])


def test_a_reshape_that_mixes_rows_into_the_batch_stays_unfused():
    def fn(q, k, v):
        scores = (q @ k.transpose(-1, -2)).reshape(B, H * LQ, 1, LK)
        return scores.softmax(-1).reshape(B, H, LQ, LK) @ v

    check_fusion(fn, qkv(), counts={"attention": 0}, missed=["pass through aten.reshape"])


def test_scores_scaled_in_place_after_a_bias():
    """Falcon's ALiBi path: `scores += bias; scores *= factor` on the product."""
    alibi = torch.randn(B, H, 1, LK)

    def fn(q, k, v, alibi):
        scores = q @ k.transpose(-1, -2)
        scores = scores + alibi
        scores *= D**-0.5
        return F.softmax(scores, dim=-1) @ v

    fused(fn, [*qkv(), alibi])


def test_a_boolean_mask_added_to_the_scores_adds_ones_and_zeros():
    """Type promotion makes `scores + bool_mask` add 1 where the mask is True (GPT-J's eager
    attention given the boolean mask of its SDPA setting); the fused op adds the same."""

    def fn(q, k, v, keep):
        return F.softmax(q @ k.transpose(-1, -2) * D**-0.5 + keep, dim=-1) @ v

    fused(fn, [*qkv(), padding()])


def test_a_mask_added_where_the_heads_are_split_out_between_two_flattened_views():
    """The products and the softmax both see flattened heads; only the mask sees (B, H)."""
    mask = torch.randn(B, 1, LQ, LK)

    def fn(q, k, v, mask):
        qf, kf, vf = (t.reshape(B * H, -1, D) for t in (q, k, v))
        scores = torch.bmm(qf, kf.transpose(1, 2)) * D**-0.5
        scores = (scores.view(B, H, LQ, LK) + mask).view(B * H, LQ, LK)
        return torch.bmm(F.softmax(scores, dim=-1), vf)

    fused(fn, [*qkv(), mask])


@pytest.mark.slow
def test_heads_split_for_the_mask_at_symbolic_sizes(recwarn):
    """With dynamic shapes the reshapes' sizes are graph values (no raw symbolic sizes passed as
    arguments), and one compile serves several batch and sequence sizes."""

    def fn(x, alibi, mask):
        b, length, _ = x.shape
        heads = x.view(b, length, H, 3, D).permute(0, 2, 3, 1, 4).reshape(b * H, 3, length, D)
        q, k, v = heads.unbind(1)
        scores = alibi.view(b * H, 1, length).baddbmm(q, k.transpose(1, 2), alpha=D**-0.5)
        scores = scores.view(b, H, length, length).masked_fill(mask, -1e9)
        probs = F.softmax(scores, dim=-1)
        return torch.bmm(probs.view(b * H, length, length), v).view(b, H, length, D)

    compiled = torch.compile(fn, backend="seqfast", dynamic=True)
    for batch, length in [(2, 5), (3, 7)]:
        g = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, length, 3 * H * D, generator=g, requires_grad=True)
        alibi, mask = torch.randn(batch, H, length), torch.rand(batch, 1, length, length) > 0.7
        with collecting() as report:
            out = compiled(x, alibi, mask)
        torch.testing.assert_close(out, fn(x, alibi, mask))
        if batch == 2:
            assert report.counts["attention"] == 1, str(report)
    assert not [w for w in recwarn if "SymInt" in str(w.message)]


def test_scores_scaled_and_masked_in_place_fuse_in_a_graph_compiled_under_no_grad():
    """With grad off throughout, no value has a history an in-place op must keep: the in-place
    scale and fill become plain math, as they do with grad on."""
    causal = torch.ones(LQ, LK, dtype=torch.bool).triu(1)

    def fn(q, k, v, masked):
        scores = q @ k.transpose(-1, -2)
        scores.mul_(D**-0.5)
        scores.masked_fill_(masked, float("-inf"))
        return scores.softmax(-1) @ v

    q, k, v = (t.detach() for t in qkv())
    with torch.no_grad(), collecting() as report:
        out = torch.compile(fn, backend="seqfast")(q, k, v, causal)
    assert report.counts["attention"] == 1, str(report)
    torch.testing.assert_close(out, fn(q.clone(), k, v, causal))
