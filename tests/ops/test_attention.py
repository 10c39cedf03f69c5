"""seqfast::attention and its backward, called directly: the generated kernels (under Triton's
interpreter) and the reference implementation, each against the same math composed from eager
PyTorch ops in float64, forward and every gradient, on small awkward shapes; masks and fully masked
rows, broadcast biases, causal, grouped-query heads and broadcast layouts, dropout, and the errors a
caller can act on."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES

import seqcompile.ops.attention  # noqa: F401  (registers the op)
from seqcompile.codegen.launches import counting_launches
from seqcompile.ops.attention import block_lists, cost, score_mods
from seqcompile.ops.attention import kernels as attention_kernels
from seqcompile.ops.attention.dropout import keep_mask
from seqcompile.ops.fused_op import Call

attention = torch.ops.seqfast.attention
FLOAT32_MIN = torch.finfo(torch.float32).min

ONE_LAUNCH = ("attention_fwd", "attention_bwd_delta", "attention_bwd_dkdv:with_dq")
TWO_LAUNCHES = ("attention_fwd", "attention_bwd_dq", "attention_bwd_dkdv")  # (dq makes the deltas)

# With finfo.min masked scores the kernels' `(s - row_max) * log2(e)` overflows to -inf in float32,
# whose exp2 is the 0 it stands for; the interpreter (numpy) warns about it.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
    pytest.mark.kernels(*ONE_LAUNCH),
]


BACKWARDS = ("one launch", "two launches")


@pytest.fixture(
    params=[
        pytest.param(BACKWARDS[0], marks=pytest.mark.kernels(*ONE_LAUNCH)),
        pytest.param(BACKWARDS[1], marks=pytest.mark.kernels(*TWO_LAUNCHES)),
    ]
)
def backward(request, monkeypatch):
    """Which way the backward's kernels run: dq added by the dk/dv kernel, or dq from its own
    kernel after dk and dv (each the default at some head dims and dtypes, and the device may
    measure either faster)."""
    one = request.param == BACKWARDS[0]
    variant = attention_kernels.ONE_LAUNCH if one else attention_kernels.TWO_LAUNCHES
    monkeypatch.setattr(attention_kernels, "backward_variants", lambda q: [variant])
    return request.param


def composed(q, k, v, bias=None, mask=None, *, scale, causal=False, masked_value=-math.inf,
             keep=None, p=0.0, window=0, modify=None, docs=None, rel_bias=None,
             prefix=None, sink=None):  # fmt: skip
    """The op's math from eager ops (call it with float64 tensors): the output and the scores after
    the modification `modify`, biases, mask, causal and window. A row whose every score is -inf
    gives 0, as SDPA defines it."""
    if q.dim() >= 3 and k.dim() >= 3 and q.shape[-3] > k.shape[-3] > 1:
        group = q.shape[-3] // k.shape[-3]  # grouped-query heads: query head h reads h // group
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = q @ k.transpose(-1, -2) * scale
    if modify is not None:
        s = modify(s)
    if bias is not None:
        s = s + bias
    if rel_bias is not None:  # score (i, j) adds the value of diagonal j - i
        rows, cols = s.shape[-2:]
        starts = range(rows - 1, -1, -1)  # row i's keys 0..cols-1 are diagonals rows-1-i onward
        s = s + torch.stack([rel_bias[..., 0, start : start + cols] for start in starts], -2)
    if mask is not None:
        s = torch.where(mask, s, masked_value)
    if causal:
        above = ~torch.ones(s.shape[-2:], dtype=torch.bool).tril()  # top-left: key j <= query i
        if prefix is not None:  # keys before the prefix's length: seen by every query
            above = above & (torch.arange(s.shape[-1]) >= prefix)
        s = s.masked_fill(above, -math.inf)
    if docs is not None:  # a key of another document than the query's
        s = s.masked_fill(docs[0] != docs[1], -math.inf)
    if window:
        rows, cols = s.shape[-2:]  # query i sees keys j with i - j < window
        far = torch.arange(rows)[:, None] - torch.arange(cols)[None, :] >= window
        s = s.masked_fill(far, -math.inf)
    if sink is not None:  # one more logit per row, its column dropped after the softmax
        s = torch.cat([s, sink.expand(*s.shape[:-1], 1)], -1)
    dead = (s == -math.inf).all(-1, keepdim=True)
    prob = s.masked_fill(dead, 0.0).softmax(-1).masked_fill(dead, 0.0)
    if sink is not None:
        prob = prob[..., :-1]
    if keep is not None:
        prob = torch.where(keep, prob / (1 - p), 0.0)
    return prob @ v, s


def randn(g, *shape, dtype=torch.float32, grad=True, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype).requires_grad_(grad)


def qkv(g, b, h, lq, lk, d, *, kv_heads=None, dtype=torch.float32):
    kv_heads = kv_heads or h
    return (
        randn(g, b, h, lq, d, dtype=dtype, scale=1.5),
        randn(g, b, kv_heads, lk, d, dtype=dtype),
        randn(g, b, kv_heads, lk, d, dtype=dtype),
    )


def run_and_compare(q, k, v, bias=None, mask=None, *, causal=False, masked_value=-math.inf,
                    p=0.0, seed=20240917, stream=3, scale=None, window=0,
                    modify=None, docs=None, rel_bias=None, prefix=None,
                    sink=None):  # fmt: skip
    """Run the op and its backward and compare the output, the row statistics and the gradient of
    every operand that requires one with `composed` in float64. Returns the output and those
    gradients (in the order q, k, v, bias, rel_bias, sink)."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seed_t = torch.tensor(seed, dtype=torch.int64) if p > 0 else None
    out, row_max, log_sum = attention(
        q, k, v, bias, mask, seed_t, stream, p, scale, causal, masked_value, window,
        score_mods.register(modify, "a test's") if modify is not None else "",
        *(docs or (None, None)), rel_bias, prefix, sink,
    )  # fmt: skip
    operands = [t for t in (q, k, v, bias, rel_bias, sink) if t is not None]
    doubles = [t.detach().double().requires_grad_(t.requires_grad) for t in operands]
    keep = None
    if p > 0:
        keep = keep_mask(seed_t, torch.Size((*row_max.shape, k.shape[-2])), stream, p)
    names = ["q", "k", "v"] + ["bias"] * (bias is not None) + ["rel_bias"] * (rel_bias is not None)
    names += ["sink"] * (sink is not None)
    by_name = dict(zip(names, doubles, strict=True))
    expected, s = composed(
        by_name["q"], by_name["k"], by_name["v"], by_name.get("bias"), mask, scale=scale,
        causal=causal, masked_value=masked_value, keep=keep, p=p, window=window, modify=modify,
        docs=docs, rel_bias=by_name.get("rel_bias"), prefix=prefix, sink=by_name.get("sink"),
    )  # fmt: skip
    tol = TOLERANCES[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    assert out.isfinite().all(), "output not finite (or an element was never written)"
    torch.testing.assert_close(out.double(), expected, **tol)

    # statistics the backward relies on: row_max + log_sum is the row's log-sum-exp; (0, inf) on
    # rows whose every score is -inf
    lse = s.detach().logsumexp(-1).reshape(row_max.shape)
    live = lse > -math.inf
    assert row_max.dtype == log_sum.dtype == torch.float32
    assert torch.equal(row_max[~live], torch.zeros_like(row_max[~live]))
    assert (log_sum[~live] == math.inf).all()
    torch.testing.assert_close(
        (row_max + log_sum)[live].double(), lse[live], **TOLERANCES[torch.float32]
    )

    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    wanted = [(t, d) for t, d in zip(operands, doubles, strict=True) if t.requires_grad]
    actual = torch.autograd.grad(out, [t for t, _ in wanted], grad_out)
    expected_grads = torch.autograd.grad(expected, [d for _, d in wanted], grad_out.double())
    names = [n for n, t in zip(by_name, operands, strict=True) if t.requires_grad]
    for name, a, e, (t, _) in zip(names, actual, expected_grads, wanted, strict=True):
        assert a.dtype == t.dtype and a.shape == t.shape, name
        assert a.isfinite().all(), f"d{name} not finite"
        torch.testing.assert_close(a.double(), e, **tol, msg=lambda m, n=name: f"d{n}: {m}")
    return out, actual


# --------------------------------------------------------------------------------------------
# shapes, dtypes and every feature


SHAPES = [  # (Lq, Lk, head_dim): every length, Lq < Lk and Lq > Lk, every head dim
    (1, 1, 16),
    (17, 17, 24),
    (64, 64, 64),
    (17, 33, 80),
    (33, 17, 16),
    (64, 17, 24),
    (5, 9, 8),  # a head dim below the smallest tile
    (9, 5, 256),  # the largest head dim
]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("lq,lk,d", SHAPES)
def test_shapes_and_dtypes(impl, backward, lq, lk, d, dtype):
    g = torch.Generator().manual_seed(lq * 1000 + lk * 10 + d)
    b, h = (1, 2) if lq * lk > 1000 else (2, 2)
    q, k, v = qkv(g, b, h, lq, lk, d, dtype=dtype)
    bias = randn(g, b, h, lq, lk, dtype=dtype)
    run_and_compare(q, k, v, bias)


FLAGS = [(bias, mask, causal, dropout) for bias in (0, 1) for mask in (0, 1)
         for causal in (0, 1) for dropout in (0, 1)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "bias,mask,causal,dropout",
    FLAGS,
    ids=["".join("BMCD"[i] if on else "-" for i, on in enumerate(f)) for f in FLAGS],
)
def test_every_feature_combination(impl, backward, bias, mask, causal, dropout):
    g = torch.Generator().manual_seed(11)
    b, h, lq, lk, d = 2, 1, 19, 23, 32
    q, k, v = qkv(g, b, h, lq, lk, d)
    bias_t = randn(g, 1, h, lq, lk) if bias else None
    mask_t = None
    if mask:
        mask_t = torch.rand(b, 1, lq, lk, generator=g) > 0.25
        mask_t[1, :, 4] = False  # a fully masked row
    run_and_compare(q, k, v, bias_t, mask_t, causal=bool(causal), p=0.25 if dropout else 0.0)


def test_composed_math_agrees_with_sdpa():
    """The oracle itself, in float64, against torch's SDPA: masks with fully masked rows, causal
    with Lq != Lk, grouped heads, and every gradient."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (t.detach().double().requires_grad_() for t in qkv(g, 2, 4, 9, 13, 8, kv_heads=2))
    mask = torch.rand(2, 1, 9, 13, generator=g) > 0.3
    mask[0, :, 2] = False  # a fully masked row
    for attn_mask, causal in ((mask, False), (None, True), (mask, True)):
        expected = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=causal, scale=0.3, enable_gqa=True
        )
        actual, _ = composed(q, k, v, None, attn_mask, scale=0.3, causal=causal)
        torch.testing.assert_close(actual, expected, **TOLERANCES[torch.float64])
        grad = torch.randn(expected.shape, generator=g, dtype=torch.float64)
        for a, e in zip(
            torch.autograd.grad(actual, (q, k, v), grad),
            torch.autograd.grad(expected, (q, k, v), grad),
            strict=True,
        ):
            torch.testing.assert_close(a, e, **TOLERANCES[torch.float64])
        if attn_mask is not None:
            assert torch.equal(actual[0, :, 2], torch.zeros_like(actual[0, :, 2]))


# --------------------------------------------------------------------------------------------
# masks


@pytest.mark.parametrize("masked_value", [-math.inf, FLOAT32_MIN], ids=["-inf", "finfo.min"])
@pytest.mark.parametrize("kind", ["padding", "full"])
def test_boolean_masks_and_fully_masked_rows(impl, kind, masked_value):
    g = torch.Generator().manual_seed(2)
    b, h, lq, lk, d = 2, 2, 17, 33, 24
    q, k, v = qkv(g, b, h, lq, lk, d)
    if kind == "padding":
        mask = torch.rand(b, 1, 1, lk, generator=g) > 0.3
        mask[1] = False  # a sequence without a single valid key: every row of it is fully masked
    else:
        mask = torch.rand(b, 1, lq, lk, generator=g) > 0.3
        mask[0, :, [0, 5]] = False
        mask[1, :, lq - 1] = False
    dead = ~mask.expand(b, h, lq, lk).any(-1)
    assert dead.any() and not dead.all()
    out, (dq, dk, dv) = run_and_compare(q, k, v, None, mask, masked_value=masked_value)
    zero_rows = torch.zeros_like(dq[dead])
    # a score replaced by a constant has no gradient: fully masked rows give dq == 0 either way
    assert torch.equal(dq[dead], zero_rows)
    if masked_value == -math.inf:
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))
        if kind == "padding":  # nothing reads batch 1's keys
            assert torch.equal(dk[1], torch.zeros_like(dk[1]))
            assert torch.equal(dv[1], torch.zeros_like(dv[1]))
    else:
        # equal finite scores: eager's softmax averages v over every key
        qd, kd, vd = (t.detach().double() for t in (q, k, v))
        s = qd @ kd.transpose(-1, -2) * d**-0.5
        eager = torch.where(mask, s, FLOAT32_MIN).softmax(-1) @ vd
        mean = vd.mean(-2, keepdim=True).expand(b, h, lq, d)
        torch.testing.assert_close(eager[dead], mean[dead], **TOLERANCES[torch.float64])
        torch.testing.assert_close(out[dead].double(), mean[dead], **TOLERANCES[torch.float32])


# --------------------------------------------------------------------------------------------
# additive bias


@pytest.mark.parametrize("kind", ["t5", "padding", "2d"])
def test_float_bias_gradient_sums_over_broadcast_dims(impl, backward, kind):
    g = torch.Generator().manual_seed(3)
    b, h, lq, lk, d = 2, 2, 17, 21, 16
    q, k, v = qkv(g, b, h, lq, lk, d)
    shape = {"t5": (1, h, lq, lk), "padding": (b, 1, 1, lk), "2d": (lq, lk)}[kind]
    bias = randn(g, *shape, scale=2.0)
    _, (*_, dbias) = run_and_compare(q, k, v, bias)
    assert dbias.shape == bias.shape
    # the same gradient spelled out: eager's gradient for a full (B, H, Lq, Lk) bias, summed
    full = bias.detach().double().expand(b, h, lq, lk).clone().requires_grad_()
    qd, kd, vd = (t.detach().double() for t in (q, k, v))
    expected, _ = composed(qd, kd, vd, full, scale=d**-0.5)
    grad_out = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7))
    (dfull,) = torch.autograd.grad(expected, full, grad_out.double())
    torch.testing.assert_close(
        dbias.double(), dfull.sum_to_size(shape), **TOLERANCES[torch.float32]
    )


def test_additive_minus_inf_bias_as_mask(impl):
    """A float padding mask of 0 and -inf (SDPA's float attn_mask), one sequence wholly padded."""
    g = torch.Generator().manual_seed(17)
    b, h, lq, lk, d = 2, 2, 17, 21, 16
    q, k, v = qkv(g, b, h, lq, lk, d)
    bias = torch.where(torch.rand(b, 1, 1, lk, generator=g) > 0.3, 0.0, -math.inf)
    bias[1] = -math.inf
    out, (dq, dk, dv) = run_and_compare(q, k, v, bias)
    for t in (out[1], dq[1], dk[1], dv[1]):
        assert torch.equal(t, torch.zeros_like(t))


# --------------------------------------------------------------------------------------------
# causal


@pytest.mark.parametrize("lq,lk", [(17, 17), (17, 33), (33, 17), (64, 64), (1, 17)])
def test_causal(impl, lq, lk):
    g = torch.Generator().manual_seed(4)
    q, k, v = qkv(g, 1, 2, lq, lk, 16)
    out, (dq, dk, dv) = run_and_compare(q, k, v, causal=True)
    # query 0 sees key 0 only
    torch.testing.assert_close(out[..., 0, :], v[..., 0, :].detach(), **TOLERANCES[torch.float32])
    if lk > lq:  # keys after the last query are never read
        assert torch.equal(dk[..., lq:, :], torch.zeros_like(dk[..., lq:, :]))
        assert torch.equal(dv[..., lq:, :], torch.zeros_like(dv[..., lq:, :]))


@pytest.mark.parametrize("masked_value", [-math.inf, FLOAT32_MIN], ids=["-inf", "finfo.min"])
def test_causal_with_padding_mask(impl, masked_value):
    g = torch.Generator().manual_seed(5)
    b, h, lq, lk, d = 2, 2, 20, 24, 16
    q, k, v = qkv(g, b, h, lq, lk, d)
    mask = torch.rand(b, 1, 1, lk, generator=g) > 0.2
    mask[1, ..., :3] = False  # left padding: queries 0..2 of sequence 1 see no valid key
    mask[1, ..., 3] = True
    out, (dq, _, _) = run_and_compare(q, k, v, None, mask, causal=True, masked_value=masked_value)
    assert torch.equal(dq[1, :, :3], torch.zeros_like(dq[1, :, :3]))
    if masked_value == -math.inf:
        assert torch.equal(out[1, :, :3], torch.zeros_like(out[1, :, :3]))
    else:  # the causal triangle stays -inf: query i averages the (masked) keys 0..i
        vd = v.detach()[1].double()
        means = torch.stack([vd[:, : i + 1].mean(-2) for i in range(3)], 1)
        torch.testing.assert_close(out[1, :, :3].double(), means, **TOLERANCES[torch.float32])


# --------------------------------------------------------------------------------------------
# sliding window


@pytest.mark.parametrize(
    "lq,lk,window,causal",
    [(40, 40, 5, True), (40, 40, 17, True), (33, 17, 40, True), (17, 33, 3, False),
     (40, 40, 1, True), (40, 40, 2**31 - 1, False)],
)  # fmt: skip
def test_sliding_window(impl, lq, lk, window, causal):
    """Query i sees keys j with i - j < window (and j <= i when causal); the key blocks before a
    row block's windows and the query blocks after a key block's are skipped."""
    g = torch.Generator().manual_seed(9)
    q, k, v = qkv(g, 1, 2, lq, lk, 16)
    out, (dq, dk, dv) = run_and_compare(q, k, v, causal=causal, window=window)
    if window == 1 and causal:  # each query sees its own key only
        torch.testing.assert_close(out, v.detach(), **TOLERANCES[torch.float32])


def test_sliding_window_with_padding_and_a_learned_bias(impl):
    """The bias gradient is 0 outside the window (blocks the kernels skip write nothing)."""
    g = torch.Generator().manual_seed(10)
    b, h, length, d = 2, 2, 37, 16
    q, k, v = qkv(g, b, h, length, length, d)
    bias = randn(g, 1, h, length, length)
    mask = torch.rand(b, 1, 1, length, generator=g) > 0.2
    mask[..., 0] = True
    _, (_, _, _, dbias) = run_and_compare(q, k, v, bias, mask, causal=True, window=6)
    far = torch.arange(length)[:, None] - torch.arange(length)[None, :] >= 6
    assert torch.equal(dbias[..., far], torch.zeros_like(dbias[..., far]))


# --------------------------------------------------------------------------------------------
# packed sequences: document ids


def packed(lengths_per_row, length):
    """(B, 1, L, 1) and (B, 1, 1, L) document ids of packed rows, documents of the given
    lengths one after another (the rest of a row is one more document)."""
    ids = torch.zeros(len(lengths_per_row), length, dtype=torch.int64)
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for doc, n in enumerate(lengths):
            ids[row, start : start + n] = doc
            start += n
        ids[row, start:] = len(lengths)
    return ids[:, None, :, None], ids[:, None, None, :]


@pytest.mark.parametrize(
    "causal, window, shuffled",
    [pytest.param(True, 0, False, marks=pytest.mark.slow),  # the window's case covers it
     pytest.param(False, 0, False, marks=pytest.mark.slow),  # the shuffled case covers it
     (True, 9, False), (False, 0, True)],
)  # fmt: skip
def test_packed_documents(impl, causal, window, shuffled):
    """Three documents in one row, two in the other, at lengths that do not divide the blocks;
    a query sees keys of its own document only. Shuffled ids (not one run per document) are
    still compared exactly."""
    g = torch.Generator().manual_seed(12)
    q, k, v = qkv(g, 2, 2, 45, 45, 16)
    doc_q, doc_kv = packed([(10, 17), (30,)], 45)
    if shuffled:
        order = torch.randperm(45, generator=g)
        doc_q, doc_kv = doc_q[:, :, order], doc_kv[..., order]
    run_and_compare(q, k, v, causal=causal, window=window, docs=(doc_q, doc_kv))


@pytest.mark.interpreter
def test_the_kernels_skip_the_blocks_of_other_documents(interpret, backward):
    """Two documents of one 16-row block each (the interpreter's tiles): NaN in the second's
    queries and values reaches nothing of the first's, which only a skipped block explains (a
    visited block would multiply a zero probability by NaN)."""
    g = torch.Generator().manual_seed(14)
    q, k, v = (t.detach() for t in qkv(g, 1, 2, 32, 32, 16))
    q[..., 16:, :] = v[..., 16:, :] = math.nan
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    doc_q, doc_kv = packed([(16,)], 32)
    out, _, _ = attention(q, k, v, None, None, None, 0, 0.0, 0.25, False, -math.inf, 0, "",
                          doc_q, doc_kv)  # fmt: skip
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for t in (out, dq, dk, dv):
        assert t[..., :16, :].isfinite().all()


@pytest.mark.parametrize(
    "masked_value, as_bias",
    [(-math.inf, False), (FLOAT32_MIN, False), (-math.inf, True)],
    ids=["-inf", "finfo.min", "bias"],
)
def test_the_kernels_skip_the_blocks_a_mask_hides(interpret, backward, masked_value, as_bias):
    """A causal triangle held in a tensor (boolean, or a bias of 0 and -inf), over two 16-row
    blocks (the interpreter's tiles), so the first query block never sees the second key block.
    NaN in the second block's queries and values reaches nothing of the first block's rows
    (output, dq); NaN in the first block's queries and incoming gradient reaches nothing of the
    second block's keys (dk, dv): with -inf masked scores, which only a skipped block explains (a
    visited one multiplies a zero probability by NaN). With the float32 minimum a hidden key keeps
    a weight (every key of a wholly masked row has one), so no block is skipped and NaN reaches
    them all, as in eager."""
    g = torch.Generator().manual_seed(15)
    triangle = torch.ones(32, 32, dtype=torch.bool).tril()
    bias = torch.zeros(32, 32).masked_fill(~triangle, -math.inf) if as_bias else None
    triangle = None if as_bias else triangle
    first, second = slice(None, 16), slice(16, None)
    finite = []
    for poisoned, seen in ((second, first), (first, second)):
        q, k, v = (t.detach() for t in qkv(g, 1, 2, 32, 32, 16))
        grad = torch.randn(q.shape, generator=g)
        q[..., poisoned, :] = math.nan
        (v if poisoned is second else grad)[..., poisoned, :] = math.nan
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with counting_launches() as launches:
            out, _, _ = attention(q, k, v, bias, triangle, None, 0, 0.0, 0.25, False, masked_value)
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        lists = 3 if backward == "two launches" else 2  # the forward's, dk and dv's, dq's
        assert launches.of("attention_blocks") == lists
        reached = (out, dq) if poisoned is second else (dk, dv)
        finite += [t[..., seen, :].isfinite().all().item() for t in reached]
    assert finite == [masked_value == -math.inf] * 4


@pytest.mark.parametrize(
    "masked_value, varies, causal, window",
    [
        (-math.inf, "batch", False, 0),
        (-math.inf, "head", True, 0),
        (FLOAT32_MIN, "batch", True, 20),
        (None, "head", False, 0),
        pytest.param(FLOAT32_MIN, "head", False, 0, marks=pytest.mark.slow),
        pytest.param(-math.inf, "batch", False, 9, marks=pytest.mark.slow),
        pytest.param(None, "batch", True, 9, marks=pytest.mark.slow),
    ],
    ids=[
        "-inf", "-inf-causal", "finfo.min-causal-window", "bias", "finfo.min", "-inf-window",
        "bias-causal-window",
    ],
)  # fmt: skip
def test_block_lists(interpret, backward, monkeypatch, masked_value, varies, causal, window):
    """The lists the kernels walk (by query for the forward and dq, by key for dk and dv), against
    the blocks counted in torch: per row block, the blocks where every score is allowed as it is
    by the mask (the bias is 0: `masked_value` None), causal and the window (crossing no edge),
    then those where some are (or with a finite masked value, those where causal and the window
    allow some), split into those where the mask (bias) is the causal triangle (shaped) and the
    others (partial); a mask varying by batch gives a list per batch, one varying by head a list
    per head. The bias is -inf where the mask hides, 0 where it allows, but for random values in
    a block the mask allows whole."""
    made = []
    real = block_lists.arguments

    def recorded(call, rows_block, cols_block, keys=False):
        made.append((rows_block, cols_block, keys, real(call, rows_block, cols_block, keys)))
        return made[-1][-1]

    monkeypatch.setattr(block_lists, "arguments", recorded)
    g = torch.Generator().manual_seed(16)
    b, h, lq, lk = 2, 3, 37, 40
    mask = torch.rand((b, 1, lq, lk) if varies == "batch" else (1, h, lq, lk), generator=g) > 0.4
    mask[..., :16, :32] = True  # full blocks, by query and by key (the interpreter's 16 x 16)
    mask[..., 16:32, :16] = False  # empty ones
    query, key = torch.arange(lq)[:, None], torch.arange(lk)
    mask[..., 16:32, 16:32] = (key <= query)[16:32, 16:32]  # a shaped one, each way
    mask[..., 32:, 32:] = (key <= query)[32:, 32:]  # (one crossing both edges)
    allowed, unchanged = mask, mask
    bias = None
    if masked_value is None:  # the same as a bias, with values in a block the mask allows
        bias = torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
        bias[..., :16, 16:32] = torch.randn(bias[..., :16, 16:32].shape, generator=g)
        allowed, unchanged = bias != -math.inf, bias == 0
    q, k, v = (t.requires_grad_() for t in qkv(g, b, h, lq, lk, 16))
    arguments = (
        q, k, v, bias, None if bias is not None else mask, None, 0, 0.0, 0.25, causal,
        -math.inf if masked_value is None else masked_value, window,
    )  # fmt: skip
    out, _, _ = attention(*arguments)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    # what the report counts of a compile-time value: the forward's lists, as the kernel made them
    listed = cost.listed_blocks(
        Call(attention.default, arguments, {}), mask if bias is None else bias
    )
    full, partial, shaped = made[0][-1][1][:-1].view(-1, 3).sum(0).tolist()
    assert (listed["full"], listed["partial"], listed["shaped"]) == (full, partial, shaped)
    dq_lists = [False] if backward == "two launches" else []  # dq's own kernel's, by query
    assert [keys for *_, keys, _ in made] == [False, *dq_lists, True]  # forward, (dq), dk and dv
    seen = ((key <= query) | (not causal)) & ((query - key < window) | (window == 0))
    triangle = key <= query
    grids = [
        t.expand(b, h, lq, lk)[:, :1] if varies == "batch" else t.expand(b, h, lq, lk)[:1]
        for t in (allowed, unchanged, seen, triangle)
    ]
    for rows_block, cols_block, keys, (lists, counts, stride_b, stride_h) in made:
        allowed, unchanged, visible, triangle = (t.transpose(-1, -2) if keys else t for t in grids)
        shaped_grid = (allowed == triangle) & (unchanged == triangle)
        row_blocks, col_blocks = (
            -(-allowed.shape[-2] // rows_block),
            -(-allowed.shape[-1] // cols_block),
        )
        assert (stride_b, stride_h) == ((row_blocks, 0) if varies == "batch" else (0, row_blocks))
        lists = lists[:-1].view(*allowed.shape[:2], row_blocks, 2 * col_blocks)  # (one over)
        counts = counts[:-1].view(*allowed.shape[:2], row_blocks, 3)
        for (i, j, r), (full, partial, shaped) in zip(
            itertools.product(*map(range, counts.shape[:3])),
            counts.view(-1, 3).tolist(),
            strict=True,
        ):
            rows = slice(r * rows_block, (r + 1) * rows_block)
            blocks = [t[i, j, rows].split(cols_block, -1) for t in (
                unchanged & visible, allowed & visible, visible, shaped_grid
            )]  # fmt: skip
            kept, seen_some, seen_any, is_triangle = blocks
            inside = (rows_block, cols_block)  # (the kernels bound a block crossing an edge)
            whole = [n for n, t in enumerate(kept) if t.all() and t.shape[-2:] == inside]
            read = seen_any if masked_value == FLOAT32_MIN else seen_some
            some = [n for n, t in enumerate(read) if n not in whole and t.any()]
            row = lists[i, j, r].tolist()
            assert row[:full] == whole
            assert row[col_blocks : col_blocks + shaped] == [
                n for n in some if is_triangle[n].all()
            ]
            assert sorted(row[col_blocks - partial : col_blocks]) == [
                n for n in some if not is_triangle[n].all()
            ]


@pytest.mark.parametrize("d", [16, 80], ids=["own loop", "read beside dropout"])
@pytest.mark.parametrize("as_bias", [False, True], ids=["mask", "bias"])
def test_a_triangle_in_a_tensor_with_dropout(impl, backward, d, as_bias):
    """The causal triangle held in a tensor (and a padded sequence beside it), with dropout: the
    kernels compute its diagonal blocks (shaped in the block lists) from positions, and at head
    dims over 64 the forward reads them beside dropout instead; either way eager's answer."""
    g = torch.Generator().manual_seed(21)
    b, h, lq, lk = 2, 2, 37, 37
    q, k, v = qkv(g, b, h, lq, lk, d)
    keep = torch.ones(lq, lk, dtype=torch.bool).tril() & (torch.arange(lk) < torch.tensor(
        [lk, 20]).view(b, 1, 1, 1))  # fmt: skip
    bias = torch.zeros(keep.shape).masked_fill(~keep, -math.inf) if as_bias else None
    run_and_compare(q, k, v, bias, None if as_bias else keep, p=0.25)


@pytest.mark.parametrize("masked_value", [-math.inf, FLOAT32_MIN], ids=["-inf", "finfo.min"])
def test_packed_documents_with_a_padding_mask_and_a_learned_bias(impl, masked_value):
    """The second document of the second row is all padding: with a finite fill its rows average
    its own (padded) keys, the other document's staying -inf, however the blocks fall."""
    g = torch.Generator().manual_seed(13)
    q, k, v = qkv(g, 2, 2, 37, 37, 16)
    bias = randn(g, 1, 2, 37, 37)
    mask = torch.rand(2, 1, 1, 37, generator=g) > 0.2
    mask[..., 0] = mask[0, ..., 20] = True
    mask[1, ..., 20:] = False
    doc_q, doc_kv = packed([(20,), (20,)], 37)
    _, (_, _, _, dbias) = run_and_compare(
        q, k, v, bias, mask, causal=True, docs=(doc_q, doc_kv), masked_value=masked_value
    )
    other = (doc_q != doc_kv).expand(2, 1, 37, 37).any(0)[0]
    assert torch.equal(dbias[..., other], torch.zeros_like(dbias[..., other]))


# --------------------------------------------------------------------------------------------
# element-wise modifications of the scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_soft_capped_scores_with_a_learned_bias_and_a_mask(impl, causal, dtype):
    """2 * tanh(scores / 2), then the bias and the mask: the bias gradient is the capped
    scores' gradient, q's and k's go through the cap's derivative. A cap of 2 bends every
    score."""
    g = torch.Generator().manual_seed(11)
    q, k, v = qkv(g, 2, 2, 21, 19, 16, dtype=dtype)
    bias = randn(g, 1, 2, 21, 19, dtype=dtype)
    mask = torch.rand(2, 1, 1, 19, generator=g) > 0.3
    mask[..., 0] = True
    run_and_compare(
        q, k, v, bias, mask, causal=causal, modify=lambda s: 2.0 * torch.tanh(s / 2.0),
        window=7 if causal else 0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "modify",
    [lambda s: s.clamp(-0.5, 0.8), lambda s: torch.sigmoid(s * 2.0) * 3.0 - s * 0.1],
    ids=["clamp", "sigmoid_minus_linear"],
)
def test_other_element_wise_modifications(impl, modify):
    """The kernels apply a generated g and scale the scores' gradient by g': clamp's is 0 where
    it clips, so q and k get nothing from the clipped scores."""
    g = torch.Generator().manual_seed(18)
    q, k, v = qkv(g, 2, 2, 21, 19, 16)
    mask = torch.rand(2, 1, 1, 19, generator=g) > 0.3
    mask[..., 0] = True
    run_and_compare(q, k, v, None, mask, causal=True, modify=modify)


# --------------------------------------------------------------------------------------------
# grouped-query heads and broadcast layouts


@pytest.mark.parametrize(
    "kv_heads,causal", [pytest.param(2, False, marks=pytest.mark.slow), (1, False), (2, True)]
)
def test_grouped_query_heads(impl, backward, kv_heads, causal):
    """Four query heads share 2 or 1 key/value heads: dk and dv sum over the sharing heads."""
    g = torch.Generator().manual_seed(6)
    q, k, v = qkv(g, 2, 4, 17, 23, 16, kv_heads=kv_heads)
    mask = torch.rand(2, 1, 1, 23, generator=g) > 0.2
    bias = randn(g, 1, 4, 17, 23)
    _, (dq, dk, dv, _) = run_and_compare(q, k, v, bias, mask, causal=causal)
    assert dk.shape == dv.shape == (2, kv_heads, 23, 16)


LAYOUTS = {
    # name: shapes of q, k, v
    "2d": ((17, 24), (23, 24), (23, 24)),
    "3d": ((3, 17, 24), (3, 23, 24), (3, 23, 24)),
    "3d_shared_kv": ((3, 17, 24), (1, 23, 24), (23, 24)),
    "q_single_head": ((2, 1, 17, 24), (2, 2, 23, 24), (2, 2, 23, 24)),
    "kv_batch_broadcast": ((2, 2, 17, 24), (1, 2, 23, 24), (1, 2, 23, 24)),
    "q_batch_broadcast": ((1, 2, 17, 24), (2, 2, 23, 24), (2, 2, 23, 24)),
    "5d_both_broadcast": ((2, 1, 2, 9, 24), (1, 3, 2, 11, 24), (1, 3, 2, 11, 24)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_broadcast_layouts(impl, layout):
    """Batch dimensions broadcast as matmul's do; gradients sum back to each operand's shape."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (randn(g, *shape) for shape in LAYOUTS[layout])
    mask = torch.rand(q.shape[-2], k.shape[-2], generator=g) > 0.2
    out, _ = run_and_compare(q, k, v, None, mask)
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    assert out.shape == (*batch, q.shape[-2], v.shape[-1])


def test_strided_operands(impl):
    """(B, L, H, D) projections viewed as (B, H, L, D) without a copy, and a transposed mask."""
    g = torch.Generator().manual_seed(16)
    b, h, lq, lk, d = 2, 2, 17, 23, 24
    q, k, v = (randn(g, b, n, h, d).transpose(1, 2) for n in (lq, lk, lk))
    assert not q.is_contiguous()
    mask = (torch.rand(b, 1, lk, lq, generator=g) > 0.2).transpose(-1, -2)
    run_and_compare(q, k, v, None, mask)


# --------------------------------------------------------------------------------------------
# dropout


def eye_values(b, h, lk):
    """v = identity (Lk == head_dim): out[..., i, j] is query i's probability of key j after
    dropout, so the output shows exactly what was dropped."""
    return torch.eye(lk).expand(b, h, lk, lk).contiguous()


@pytest.mark.parametrize("p", [0.1, 0.5, 13109 / 131072 - 1e-10], ids=["0.1", "0.5", "half-step"])
@pytest.mark.kernels("attention_fwd")
def test_dropout_keep_ratio_and_scaling(impl, p):
    """The kernels keep exactly the reference's scores, on sizes that cut tiles and Philox blocks
    (odd, not multiples of 8 or 16), at a p whose threshold float32 rounds up (`half-step`)."""
    # the reference is cheap on a big tensor; the interpreter runs the kernels on a moderate one
    b, h, lq, lk = (1, 4, 128, 128) if impl == "reference" else (2, 2, 37, 45)
    g = torch.Generator().manual_seed(9)
    q, k = randn(g, b, h, lq, lk, grad=False), randn(g, b, h, lk, lk, grad=False)
    v = eye_values(b, h, lk)
    seed, stream, scale = torch.tensor(1234567, dtype=torch.int64), 5, lk**-0.5
    out, _, _ = attention(q, k, v, None, None, seed, stream, p, scale, False, -math.inf)
    prob = (q.double() @ k.double().transpose(-1, -2) * scale).softmax(-1)
    assert prob.min() > 0  # so a zero in the output means a dropped element
    kept = out != 0
    n = kept.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * sigma
    assert torch.equal(kept, keep_mask(seed, torch.Size((b, h, lq, lk)), stream, p))
    torch.testing.assert_close(
        out[kept].double(), prob[kept] / (1 - p), **TOLERANCES[torch.float32]
    )


@pytest.mark.kernels("attention_fwd")
def test_dropout_keeps_a_number_equal_to_the_threshold_only(interpret):
    """p put half a step either side of a number some score draws: rounded to nearest, the
    threshold is that number (the score kept) or the one above it (dropped); a kernel that
    truncates p or compares strictly keeps another set."""
    b, h, lq, lk = 1, 2, 21, 19
    seed, stream = torch.tensor(4242, dtype=torch.int64), 6
    shape = torch.Size((b, h, lq, lk))
    # a number some score draws: where the masks of two neighbouring thresholds differ
    masks = [keep_mask(seed, shape, stream, t / 65536) for t in range(20000, 20400)]
    step = 20000 + next(t for t in range(399) if not torch.equal(masks[t], masks[t + 1]))
    g = torch.Generator().manual_seed(12)
    q, k = randn(g, b, h, lq, lk, grad=False), randn(g, b, h, lk, lk, grad=False)
    for p in ((step - 0.4) / 65536, (step + 0.6) / 65536):
        out, _, _ = attention(
            q, k, eye_values(b, h, lk), None, None, seed, stream, p, 1.0, False, -math.inf
        )
        assert torch.equal(out != 0, keep_mask(seed, shape, stream, p)), p


def test_dropout_whose_p_rounds_to_1_drops_everything(impl, backward):
    """p within 2^-17 of 1 takes the threshold 2^16, which no number reaches: every output and
    gradient is zero (the kernels' threshold, shifted into a word's high half, wraps there)."""
    g = torch.Generator().manual_seed(13)
    q, k, v = (randn(g, 1, 2, 20, 16) for _ in range(3))
    seed = torch.tensor(5, dtype=torch.int64)
    out, _, _ = attention(q, k, v, None, None, seed, 1, 1 - 1e-7, 0.25, True, -math.inf)
    assert not out.any()
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert all(not g.any() for g in grads)


@pytest.mark.kernels(*TWO_LAUNCHES)
def test_deterministic_algorithms_take_the_backward_without_atomics(interpret):
    """Float atomics add in any order, so under deterministic algorithms dq comes from its own
    kernel; otherwise the dk/dv kernel adds it (one launch)."""
    g = torch.Generator().manual_seed(21)
    q, k, v = qkv(g, 1, 2, 20, 24, 16)
    assert attention_kernels.backward_variants(q)[0] == attention_kernels.ONE_LAUNCH
    torch.use_deterministic_algorithms(True)
    try:
        with counting_launches() as launches:
            run_and_compare(q, k, v, causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert launches.of("attention_bwd_dkdv:with_dq") == 0


def test_dropout_backward_drops_what_the_forward_dropped(impl, backward):
    """One query row per (batch, head): dv[j] is that row's kept probability of key j times the
    gradient, so it is zero exactly where the forward dropped (0, j)."""
    g = torch.Generator().manual_seed(10)
    b, h, lk = 1, 3, 40
    q, k = randn(g, b, h, 1, lk), randn(g, b, h, lk, lk)
    v = eye_values(b, h, lk).requires_grad_()
    seed = torch.tensor(77, dtype=torch.int64)
    out, _, _ = attention(q, k, v, None, None, seed, 2, 0.4, lk**-0.5, False, -math.inf)
    dropped = out[..., 0, :] == 0
    assert 0 < dropped.sum() < dropped.numel()
    grad_out = torch.rand(out.shape, generator=g) + 0.5  # no zero entries
    (dv,) = torch.autograd.grad(out, v, grad_out)
    assert torch.equal((dv == 0).all(-1), dropped)


@pytest.mark.parametrize(
    "lk,causal",
    [pytest.param(32, False, marks=pytest.mark.slow), (23, True), (1, False)],
    ids=["lk32", "lk23-causal", "lk1"],
)
def test_kernels_drop_exactly_what_the_reference_drops(interpret, monkeypatch, lk, causal):
    """Rows of keys not a multiple of 4 long (each row's numbers start a Philox block) and one
    key, on edge and whole blocks."""
    monkeypatch.setenv("SEQFAST_POISON", "1")
    g = torch.Generator().manual_seed(12)
    b, h, kv_heads, lq = 1, 4, 2, 20
    q, k = randn(g, b, h, lq, lk), randn(g, b, kv_heads, lk, lk)
    v = eye_values(b, kv_heads, lk).requires_grad_()
    mask = torch.rand(b, 1, lq, lk, generator=g) > 0.1
    seed = torch.tensor(987654321012, dtype=torch.int64)
    args = (None, mask, seed, 11, 0.3, lk**-0.5, causal, -math.inf)
    grad_out = torch.randn(b, h, lq, lk, generator=g)
    results = []
    for kernels in ("0", "1"):
        monkeypatch.setenv("SEQFAST_INTERPRET", kernels)
        out = attention(q, k, v, *args)[0]
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    (reference, *ref_grads), (kernels, *kernel_grads) = results
    assert torch.equal(reference == 0, kernels == 0)
    torch.testing.assert_close(kernels, reference)
    for a, e in zip(kernel_grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, **TOLERANCES[torch.float32])


@pytest.mark.kernels("attention_fwd")
def test_dropout_repeats_for_a_seed_and_stream_only(impl):
    g = torch.Generator().manual_seed(13)
    q, k, v = qkv(g, 1, 1, 17, 24, 16)

    def run(seed, stream):
        seed_t = torch.tensor(seed, dtype=torch.int64)
        return attention(q, k, v, None, None, seed_t, stream, 0.3, 0.25, False, -math.inf)[0]

    first = run(42, 1)
    assert torch.equal(run(42, 1), first)
    assert not torch.equal(run(43, 1), first)
    assert not torch.equal(run(42, 2), first)


# --------------------------------------------------------------------------------------------
# registration


def test_schema_fake_and_autograd_registration():
    """torch.library.opcheck on the reference: schema, fake implementations (shapes, dtypes and
    strides as the real ones), autograd registration, and tracing forward and backward."""
    g = torch.Generator().manual_seed(18)
    padding = torch.rand(2, 1, 1, 7, generator=g) > 0.3
    cases = [
        (*qkv(g, 2, 4, 5, 7, 16, kv_heads=2), randn(g, 1, 4, 5, 7), padding, None, 0, 0.0),
        (
            randn(g, 3, 5, 16),
            randn(g, 3, 7, 16),
            randn(g, 3, 7, 16),
            None,
            None,
            torch.tensor(5, dtype=torch.int64),
            3,
            0.2,
        ),  # fmt: skip
        (
            randn(g, 2, 1, 5, 16),
            randn(g, 1, 2, 7, 16),
            randn(g, 1, 2, 7, 16),
            randn(g, 5, 7),
            None,
            None,
            0,
            0.0,
        ),  # fmt: skip
    ]
    for case in cases:
        torch.library.opcheck(attention, (*case, 0.25, True, FLOAT32_MIN))


# --------------------------------------------------------------------------------------------
# errors


def _error_cases():
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    seed = torch.tensor(1, dtype=torch.int64)
    base = dict(q=q, k=k, v=v, bias=None, mask=None, seed=None, p=0.0)
    return {
        "head dims differ": (dict(base, k=torch.randn(2, 2, 7, 24)), "same head dim"),
        "heads not a multiple": (
            dict(base, q=torch.randn(2, 3, 5, 16)),
            r"query heads \(3\) must be a multiple of key/value heads \(2\)",
        ),
        "non-bool mask": (dict(base, mask=torch.ones(5, 7)), "mask must be bool"),
        "non-float bias": (
            dict(base, bias=torch.ones(5, 7, dtype=torch.int64)),
            "bias must be floating point",
        ),
        "bias larger than the scores": (
            dict(base, bias=torch.randn(3, 2, 4, 5, 7)),
            "bias of shape .* does not broadcast",
        ),
        "bias does not broadcast": (
            dict(base, bias=torch.randn(5, 8)),
            "bias of shape .* does not broadcast",
        ),
        "mask does not broadcast": (
            dict(base, mask=torch.ones(6, 7, dtype=torch.bool)),
            "mask of shape .* does not broadcast",
        ),
        "dropout without a seed": (dict(base, p=0.1), "p > 0 needs a seed"),
        "dropout above 1": (dict(base, p=1.5, seed=seed), r"p must be in \[0, 1\], got 1.5"),
        "dropout below 0": (dict(base, p=-0.1, seed=seed), r"p must be in \[0, 1\], got -0.1"),
        "head dim over 256": (
            dict(base, **{n: torch.randn(1, 1, 3, 264) for n in ("q", "k", "v")}),
            "head dim 264 > 256",
        ),
        "dropout with a seed is fine": (dict(base, p=0.1, seed=seed), None),
    }


@pytest.mark.parametrize("case", list(_error_cases()))
def test_errors_name_the_problem(case):
    args, match = _error_cases()[case]
    call = (args["q"], args["k"], args["v"], args["bias"], args["mask"], args["seed"], 0, args["p"])
    if match is None:
        attention(*call, 0.25, False, -math.inf)
        return
    with pytest.raises(ValueError, match=match):
        attention(*call, 0.25, False, -math.inf)


@pytest.mark.kernels()  # refused before any launch
def test_a_mask_of_2_to_the_31_scores_per_head_is_refused_by_the_kernels(interpret):
    """The kernels index a plane of a mask or bias (and its gradient) in 32 bits: a plane of 2**31
    scores is an error naming the sizes, before any kernel runs (q, k and v of one row each
    stride-0 along the length, the mask one element). The kernels' launcher is called itself: the
    reference, where it runs instead, would make the 2**31 scores."""
    length = 46341  # (its square is just over 2**31)
    q, k, v = (torch.randn(1, 1, 1, 16).expand(1, 1, length, 16) for _ in range(3))
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool).expand(1, 1, length, length)
    call = Call(attention.default, (q, k, v, None, mask, None, 0, 0.0, 0.25, False, -math.inf), {})
    with pytest.raises(ValueError, match="46341 x 46341 scores per head with a mask or bias"):
        attention_kernels.forward(**call)


# --------------------------------------------------------------------------------------------
# edges


@pytest.mark.parametrize("lq,lk", [(1, 1), (1, 17), (17, 1)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_single_query_or_single_key(impl, lq, lk, causal):
    g = torch.Generator().manual_seed(14)
    q, k, v = qkv(g, 2, 2, lq, lk, 24)
    bias = randn(g, 2, 2, lq, lk)
    out, _ = run_and_compare(q, k, v, bias, causal=causal)
    if lk == 1:  # one key: every query returns its value
        torch.testing.assert_close(out, v.detach().expand_as(out), **TOLERANCES[torch.float32])


@pytest.mark.parametrize(
    "h,lq,lk", [(2, 5, 0), (2, 0, 7), (2, 0, 0), (0, 5, 7)],
    ids=["no-keys", "no-queries", "neither", "no-heads"],
)  # fmt: skip
@pytest.mark.kernels()  # the kernel path answers empty lengths without a launch
def test_empty_lengths(impl, h, lq, lk):
    """Lk == 0: every row is empty, so as SDPA's fully masked rows the output and gradients are 0;
    Lq == 0: empty output, and nothing reaches k and v. With neither, the backward had allocated a
    relative bias's gradient of Lq + Lk - 1 = -1 diagonals; with no heads, the op had refused to
    group 0 query heads over 0 key/value heads."""
    g = torch.Generator().manual_seed(15)
    q, k, v = qkv(g, 1, h, lq, lk, 16)
    bias = randn(g, 1, h, lq, lk)
    out, row_max, log_sum = attention(q, k, v, bias, None, None, 0, 0.0, 0.25, False, -math.inf)
    assert torch.equal(out, torch.zeros(1, h, lq, 16))
    assert torch.equal(row_max, torch.zeros(1, h, lq)) and (log_sum == math.inf).all()
    grads = torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))
    for grad, operand in zip(grads, (q, k, v, bias), strict=True):
        assert torch.equal(grad, torch.zeros_like(operand))


# --------------------------------------------------------------------------------------------
# a bias by key - query position


# --------------------------------------------------------------------------------------------
# attention sinks


@pytest.mark.parametrize(
    "shape, causal, masked",
    [((1, 2, 1, 1), True, False), ((2, 1, 20, 1), False, True), ((20, 1), True, True)],
    ids=["per-head", "per-batch-and-query", "per-query"],
)
def test_attention_sinks(impl, backward, shape, causal, masked):
    """A sink logit per row joins the softmax's denominator with no value: the output, the row
    statistics and every gradient, the sink's included, against the concatenated column dropped
    after the softmax; with a padding mask whose last row hides every key, that row's weight all
    goes to the sink (output 0)."""
    g = torch.Generator().manual_seed(23)
    q, k, v = qkv(g, 2, 2, 20, 37, 16)
    sink = randn(g, *shape, scale=2.0)
    mask = torch.rand(2, 1, 20, 37, generator=g) > 0.3 if masked else None
    if masked:
        mask[..., -1, :] = False
    out, _ = run_and_compare(q, k, v, None, mask, causal=causal, sink=sink)
    if masked:
        assert not out[..., -1, :].any()


@pytest.mark.kernels("attention_fwd")
def test_a_sink_of_minus_infinity_is_no_sink(impl):
    g = torch.Generator().manual_seed(24)
    q, k, v = qkv(g, 1, 2, 9, 21, 16)
    sink = torch.full((1, 2, 1, 1), -math.inf)
    out, _, _ = attention(q, k, v, None, None, None, 0, 0.0, 0.25, True, -math.inf, sink=sink)
    plain, _, _ = attention(q, k, v, None, None, None, 0, 0.0, 0.25, True, -math.inf)
    torch.testing.assert_close(out, plain)


def test_a_sink_of_the_wrong_shape_is_refused():
    q = k = v = torch.randn(1, 2, 5, 8)
    for sink in (torch.zeros(1, 2, 1, 5), torch.zeros(2, 5, 1, dtype=torch.int64)):
        with pytest.raises(ValueError, match="sink must be floating point and broadcast to"):
            attention(q, k, v, None, None, None, 0, 0.0, 0.25, False, -math.inf, sink=sink)


@pytest.mark.parametrize(
    "shape, causal, window",
    [((1, 2, 1, 45), False, 0), ((2, 1, 1, 45), True, 0), ((1, 2, 1, 45), True, 9)],
    ids=["per-head", "per-batch-causal", "per-head-window"],
)
def test_relative_bias_and_its_gradient(impl, backward, shape, causal, window):
    """A learned value per key - query diagonal (T5's buckets, ALiBi by distance), beside a bias
    and a padding mask, at lengths that do not divide the blocks: its gradient sums the scores'
    along each diagonal and over the dims it broadcasts, as autograd does for the (Lq, Lk) bias
    it stands for."""
    g = torch.Generator().manual_seed(15)
    lq, lk = 21, 25
    q, k, v = qkv(g, 2, 2, lq, lk, 16)
    rel = randn(g, *shape[:-1], lq + lk - 1)
    bias = randn(g, 1, 2, lq, lk)
    mask = torch.rand(2, 1, 1, lk, generator=g) > 0.2
    mask[..., 0] = True
    run_and_compare(q, k, v, bias, mask, causal=causal, window=window, rel_bias=rel)


def test_fixed_relative_bias(impl):
    """Fixed slopes times the distance (ALiBi), needing no gradient of its own."""
    g = torch.Generator().manual_seed(16)
    q, k, v = qkv(g, 1, 2, 17, 17, 16)
    slopes = torch.tensor([0.5, 0.25])[:, None, None]
    rel = slopes * -torch.arange(-16, 17).abs().float()[None, None, :]
    run_and_compare(q, k, v, causal=True, rel_bias=rel)


def test_relative_bias_of_the_wrong_length_is_refused():
    q = k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="one value per key - query diagonal"):
        attention(q, k, v, None, None, None, 0, 0.0, 1.0, False, -math.inf, 0, "", None, None,
                  torch.randn(2, 1, 5))  # fmt: skip


# --------------------------------------------------------------------------------------------
# a prefix LM: causal, and every query sees the prefix


@pytest.mark.parametrize(
    "prefix",
    [[[0]], pytest.param([[9]], marks=pytest.mark.slow), [[45]], [[20], [3]]],
    ids=["empty", "short", "all", "per-batch"],
)
def test_prefix_lm(impl, prefix):
    """Keys before the prefix's length are seen by every query, the rest causally; lengths
    across block boundaries (and a prefix as long as the keys); with a padding mask and a bias."""
    g = torch.Generator().manual_seed(17)
    q, k, v = qkv(g, 2, 2, 45, 45, 16)
    bias = randn(g, 1, 2, 45, 45)
    mask = torch.rand(2, 1, 1, 45, generator=g) > 0.2
    mask[..., 0] = True
    lengths = torch.tensor(prefix).view(-1, 1, 1, 1)
    run_and_compare(q, k, v, bias, mask, causal=True, prefix=lengths)


def test_a_prefix_without_causal_is_refused():
    q = k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="a prefix widens causal"):
        attention(q, k, v, None, None, None, 0, 0.0, 1.0, False, -math.inf, 0, "", None, None,
                  None, torch.tensor([[2]]))  # fmt: skip
