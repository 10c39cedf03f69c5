"""seqfast::add_norm and its backward, called directly: the generated kernels (under Triton's
interpreter) and the reference implementation, each against the same math composed from eager
PyTorch ops in float64, forward and every gradient, on small awkward shapes."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES

import seqcompile.ops.add_norm  # noqa: F401  (registers the op)
from seqcompile.ops.random import keep_mask_by_rows

add_norm = torch.ops.seqfast.add_norm
pytestmark = pytest.mark.kernels("add_norm_fwd", "add_norm_bwd")
WITH_PARAMETERS = pytest.mark.kernels("add_norm_fwd", "add_norm_bwd", "column_sum")
"""Parameter gradients sum the backward's per-program partials in a second kernel."""


def composed(x, residual, branch_bias, weight, bias, keep, p, eps, rms):
    """The op's math from eager ops in float64."""
    s = x.double()
    if branch_bias is not None:
        s = s + branch_bias.double()
    if keep is not None:
        s = torch.where(keep, s / (1 - p), 0.0)
    if residual is not None:
        s = s + residual.double()
    n = (s.shape[-1],)
    w = weight.double() if weight is not None else None
    if rms:
        return F.rms_norm(s, n, w, eps), s
    return F.layer_norm(s, n, w, bias.double() if bias is not None else None, eps), s


def make_inputs(rows, width, dtype, *, residual, branch_bias, weight, bias, seed=0):
    g = torch.Generator().manual_seed(seed)

    def t(*shape, dt=dtype):
        return (torch.randn(shape, generator=g) * 2 + 0.5).to(dt).requires_grad_()

    return dict(
        x=t(rows, width),
        residual=t(rows, width) if residual else None,
        branch_bias=t(width) if branch_bias else None,
        weight=t(width) if weight else None,
        bias=t(width) if bias else None,
    )


def run_and_compare(inputs, *, p, rms, dtype, eps=1e-5, stream=3, sum_grad=True):
    seed = torch.tensor(20240917, dtype=torch.int64)
    x = inputs["x"]
    args = [inputs[k] for k in ("x", "residual", "branch_bias", "weight", "bias")]
    out, total, mean, rstd = add_norm(*args, seed, stream, p, eps, rms, dtype, dtype)
    keep = keep_mask_by_rows(seed, x.shape, stream, p) if p > 0 else None
    expected_out, expected_sum = composed(*args, keep, p, eps, rms)
    tol = TOLERANCES[dtype]
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), expected_out, **tol)
    prologue = inputs["residual"] is not None or inputs["branch_bias"] is not None or p > 0
    if prologue:
        torch.testing.assert_close(total.double(), expected_sum, **tol)
    else:
        assert total.numel() == 0
    assert rstd.shape == x.shape[:-1] and not rstd.isnan().any()

    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grad_sum = torch.randn(out.shape, generator=g).to(dtype) if prologue and sum_grad else None
    tensors = [t for t in args if t is not None]
    outputs = [out] + ([total] if grad_sum is not None else [])
    cotangents = [grad_out] + ([grad_sum] if grad_sum is not None else [])
    actual = torch.autograd.grad(outputs, tensors, cotangents)
    expected_outputs = [expected_out] + ([expected_sum] if grad_sum is not None else [])
    expected = torch.autograd.grad(expected_outputs, tensors, [c.double() for c in cotangents])
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == dtype and not a.isnan().any()
        # parameter gradients sum over rows: scale the tolerance with the row count
        scale = max(1.0, x.shape[0] ** 0.5) if a.dim() == 1 else 1.0
        torch.testing.assert_close(
            a.double(), e.double(), atol=tol["atol"] * scale * 4, rtol=tol["rtol"] * 4
        )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("width", [1, 7, 768, 1000, 5000])  # 5000: weight read per row
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@WITH_PARAMETERS
def test_shapes_and_dtypes(impl, rms, width, rows, dtype):
    inputs = make_inputs(
        rows, width, dtype, residual=True, branch_bias=True, weight=True, bias=not rms
    )
    run_and_compare(inputs, p=0.0, rms=rms, dtype=dtype)


FEATURES = [
    (rms, *flags)
    for rms in (False, True)
    for flags in itertools.product([False, True], repeat=5)
    if not (rms and flags[3])  # RMSNorm has no bias
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "rms,residual,branch_bias,weight,bias,dropout",
    FEATURES,
    ids=[
        ("rms-" if f[0] else "layer-")
        + "".join("RBWbD"[i] if on else "-" for i, on in enumerate(f[1:]))
        for f in FEATURES
    ],
)
def test_every_feature_combination(impl, rms, residual, branch_bias, weight, bias, dropout):
    inputs = make_inputs(
        5, 33, torch.float32, residual=residual, branch_bias=branch_bias, weight=weight, bias=bias
    )
    run_and_compare(inputs, p=0.25 if dropout else 0.0, rms=rms, dtype=torch.float32)


@WITH_PARAMETERS
def test_sum_output_without_other_readers(impl):
    inputs = make_inputs(
        9, 24, torch.float32, residual=True, branch_bias=False, weight=True, bias=True
    )
    run_and_compare(inputs, p=0.0, rms=False, dtype=torch.float32, sum_grad=False)


@pytest.mark.kernels("add_norm_fwd")
def test_mixed_dtypes_round_sum_like_eager(impl):
    """A float16 branch added to a float32 residual: the sum is float32, the output float16."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=g).half()
    residual = torch.randn(6, 40, generator=g)
    weight = torch.randn(40, generator=g)
    out, total, _, _ = add_norm(
        x, residual, None, weight, None, None, 0, 0.0, 1e-5, False, torch.float16, torch.float32
    )
    expected = F.layer_norm(x + residual, (40,), weight, None, 1e-5).half()
    assert out.dtype == torch.float16 and total.dtype == torch.float32
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float16])
    torch.testing.assert_close(total, x + residual, **TOLERANCES[torch.float32])


@pytest.mark.kernels("add_norm_fwd")
def test_kernels_drop_exactly_what_the_reference_drops(interpret, monkeypatch):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 100, generator=g)
    residual = torch.zeros(37, 100)
    seed = torch.tensor(987654321012, dtype=torch.int64)
    args = (x, residual, None, None, None, seed, 11, 0.4, 1e-5, False, torch.float32, torch.float32)
    monkeypatch.setenv("SEQFAST_INTERPRET", "0")
    reference = add_norm(*args)[1]
    monkeypatch.setenv("SEQFAST_INTERPRET", "1")
    kernels = add_norm(*args)[1]
    assert torch.equal(reference == 0, kernels == 0)
    torch.testing.assert_close(kernels, reference)


@pytest.mark.slow
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_ratio_scaling_and_backward_mask(impl, p):
    rows, width = 64, 257
    x = torch.ones(rows, width, requires_grad=True)
    residual = torch.zeros(rows, width, requires_grad=True)
    seed = torch.tensor(42, dtype=torch.int64)
    out, total, _, _ = add_norm(
        x, residual, None, None, None, seed, 1, p, 1e-5, False, torch.float32, torch.float32
    )
    dropped = total == 0
    kept_fraction = 1 - dropped.float().mean().item()
    # binomial standard deviation over 16448 elements is below 0.004
    assert abs(kept_fraction - (1 - p)) < 0.02
    torch.testing.assert_close(total[~dropped], torch.full_like(total[~dropped], 1 / (1 - p)))
    (grad_x,) = torch.autograd.grad(total, x, torch.randn_like(total) + 3)
    assert torch.equal(grad_x == 0, dropped), "backward dropped different elements"
    streams = [
        add_norm(
            x, residual, None, None, None, seed, s, p, 1e-5, False, torch.float32, torch.float32
        )[1]
        for s in (1, 2)
    ]
    assert torch.equal(streams[0], total) and not torch.equal(streams[1], total)


@WITH_PARAMETERS
def test_empty_rows_and_noncontiguous_inputs(impl):
    x = torch.randn(0, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    out = add_norm(
        x, None, None, weight, None, None, 0, 0.0, 1e-5, True, torch.float32, torch.float32
    )
    assert out[0].shape == (0, 16)
    (grad_w,) = torch.autograd.grad(out[0].sum(), weight, allow_unused=True)
    assert grad_w is None or torch.equal(grad_w, torch.zeros(16))

    base = torch.randn(16, 10, requires_grad=True)
    inputs = dict(x=base.t(), residual=None, branch_bias=None, weight=weight, bias=None)
    run_and_compare(inputs, p=0.0, rms=True, dtype=torch.float32)


@pytest.mark.kernels()  # rows of no elements: nothing to compute
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_rows_of_width_zero(impl, rms):
    """Rows of no elements give eager's empty output and gradients (the rows had been counted
    by reshape(-1, 0), which is ambiguous, and failed)."""
    x, residual = (torch.randn(3, 5, 0, requires_grad=True) for _ in range(2))
    weight, bias = (torch.randn(0, requires_grad=True) for _ in range(2))
    out, total, _, _ = add_norm(
        x, residual, None, weight, None if rms else bias, None, 0, 0.0, 1e-5, rms,
        torch.float32, torch.float32,
    )  # fmt: skip
    assert out.shape == total.shape == (3, 5, 0)
    wanted = (x, residual, weight) if rms else (x, residual, weight, bias)
    grads = torch.autograd.grad((out.sum() + total.sum(),), wanted)
    assert [g.shape for g in grads] == [t.shape for t in wanted]


def test_reference_outputs_are_contiguous_like_the_fake_ones():
    x = torch.randn(16, 8).t()
    residual = torch.randn(16, 8).t()
    outputs = add_norm(
        x, residual, None, None, None, None, 0, 0.0, 1e-5, False, torch.float32, torch.float32
    )
    assert all(t.is_contiguous() for t in outputs)
    grads = torch.ops.seqfast.add_norm_backward(
        torch.ones(1, 1).expand(8, 16), None, outputs[1], outputs[2], outputs[3], None, None,
        0, 0.0, False, torch.float32, torch.float32, None, None,
    )  # fmt: skip
    assert all(t.is_contiguous() for t in grads)


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_a_dropout_p_outside_0_1_is_refused(p):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\]"):
        add_norm(x, None, None, None, None, torch.tensor(1), 0, p, 1e-5, False, x.dtype, x.dtype)
