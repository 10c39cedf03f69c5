"""The GPU tier (`pytest -m gpu`) beyond every registry sample on CUDA (`ops/test_samples.py`):
compiled kernels against the reference at larger shapes and low-precision tolerances, and a short
training run whose loss curve must track eager."""

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES

import seqcompile
import seqcompile.lower
import seqcompile.ops.attention as attention_entry
from seqcompile.codegen import tuning
from seqcompile.demo import GPT, GPTConfig, train
from seqcompile.ops.add_norm import kernels as norm_kernels
from seqcompile.ops.add_norm import op as norm_op
from seqcompile.ops.add_norm import reference as norm_reference
from seqcompile.ops.attention import kernels as attention_kernels
from seqcompile.ops.attention import op as attention_op
from seqcompile.ops.attention import reference as attention_reference
from seqcompile.ops.attention import vendor as attention_vendor
from seqcompile.ops.fused_op import Call
from seqcompile.report import collecting

pytestmark = pytest.mark.gpu
cuda = torch.device("cuda")


# The whole-model tests come first: they take longest, and under pytest-xdist (the GPU session runs
# the tier on several workers) they then overlap the kernel tests instead of trailing them.


def test_training_loss_curve_tracks_eager_in_bf16():
    torch.manual_seed(0)
    config = GPTConfig(vocab=512, max_len=128, d_model=256, n_heads=4, n_layers=4, dropout=0.0)
    model = GPT(config).to(cuda)
    fast_model = copy.deepcopy(model)
    kwargs = dict(steps=20, batch=8, length=128, device=cuda)

    def bf16(step):
        def run(idx, targets):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return step(idx, targets)

        return run

    eager = train(model, bf16(model), config, **kwargs)
    with collecting() as report:
        fast = train(
            fast_model, bf16(torch.compile(fast_model, backend="seqfast")), config, **kwargs
        )
    assert report.counts["norm"] == 2 * config.n_layers + 1
    assert report.counts["attention"] == config.n_layers
    assert eager.losses[-1] < eager.losses[0] - 0.5
    torch.testing.assert_close(fast.losses, eager.losses, atol=5e-2, rtol=2e-2)


def _kernel_step(**options):
    """One training step of a seeded GPT with dropout on CUDA, every fused call running its
    kernels (`options`: more of the backend's options): the loss, the gradients, the report."""
    config = GPTConfig(vocab=512, max_len=128, d_model=256, n_heads=4, n_layers=2, dropout=0.1)
    families = ("attention", "norm", "loss", "pointwise")
    options = {**options, "implementations": {family: "kernel" for family in families}}
    torch.manual_seed(0)
    model = GPT(config).to(cuda)
    idx = torch.randint(0, config.vocab, (4, 128), device=cuda)
    with collecting() as report:
        loss = torch.compile(model, backend="seqfast", options=options)(idx, idx)
        loss.backward()
    torch._dynamo.reset()
    return loss.detach(), [p.grad for p in model.parameters()], report


def test_inductor_launches_the_kernels_and_they_compute_what_the_op_calls_do(monkeypatch):
    """Under Inductor a fused call's kernels are traced into the graph and launched by its own
    code; a step so compiled gives the loss and gradients of the same step calling the ops (the
    same kernels, configurations and dropout streams; Inductor may order its own sums
    otherwise)."""
    loss, grads, report = _kernel_step()
    kernels = [u for u in report.implementations if u.implementation == "kernel"]
    called = [(u.op, u.reason) for u in kernels if "launched by the executor" not in u.reason]
    assert kernels and all("writes over an argument" in reason for _, reason in called), called
    monkeypatch.setattr(seqcompile.lower, "launches_inlined", lambda device, executor: False)
    want_loss, want_grads, _ = _kernel_step()
    torch.testing.assert_close(loss, want_loss, **TOLERANCES[torch.float32])
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_the_eager_executor_runs_planned_launches_that_compute_what_the_op_calls_do(monkeypatch):
    """With the eager executor a fused call's traced launches run from its plan (each kernel
    launched directly, `lower/planned_launches.py`); a step so run gives the loss and gradients
    of the same step calling the ops, bit for bit (the same kernels, configurations and streams,
    the rest run by the same eager ops)."""
    loss, grads, report = _kernel_step(rest="eager")
    kernels = [u for u in report.implementations if u.implementation == "kernel"]
    called = [(u.op, u.reason) for u in kernels if "launched from its plan" not in u.reason]
    assert kernels and all("writes over an argument" in reason for _, reason in called), called
    monkeypatch.setattr(seqcompile.lower, "launches_planned", lambda device, executor: False)
    want_loss, want_grads, _ = _kernel_step(rest="eager")
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)


def test_at_a_dynamic_length_inductor_launches_the_kernels_for_every_length():
    """The kernels' launches traced at a symbolic sequence length: Inductor launches every
    kernel call (but those writing over an argument) at two lengths from one compile, and each
    step matches eager's loss (no dropout: the streams are the kernels' own)."""
    config = GPTConfig(vocab=512, max_len=256, d_model=256, n_heads=4, n_layers=2, dropout=0.0)
    families = ("attention", "norm", "loss", "pointwise")
    options = {"implementations": {family: "kernel" for family in families}}
    torch.manual_seed(0)
    model = GPT(config).to(cuda)
    compiled = torch.compile(model, backend="seqfast", options=options)
    for length, compiles in ((128, 1), (200, 0)):
        idx = torch.randint(0, config.vocab, (4, length), device=cuda)
        torch._dynamo.mark_dynamic(idx, 1)
        with collecting() as report:
            loss = compiled(idx, idx)
            loss.backward()
        graphs = {u.graph for u in report.implementations}
        assert len(graphs) == compiles, graphs
        called = [
            (u.op, u.reason)
            for u in report.implementations
            if u.implementation == "kernel" and "launched by the executor" not in u.reason
        ]
        assert all("writes over an argument" in reason for _, reason in called), called
        torch.testing.assert_close(loss, model(idx, idx), **TOLERANCES[torch.float32])
        model.zero_grad()
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_sdpa_attention_runs_the_vendor_under_inductor_and_matches_eager(dynamic):
    """A causal SDPA attention with grouped heads, bf16, compiled under Inductor with the vendor
    forced: SDPA's flash ops inlined into the graphs Inductor compiles, the output and every
    gradient as eager's; at symbolic sizes too, a second length with no second compile."""

    def attention(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.float().square().mean()

    options = {"implementations": {"attention": "vendor"}}
    compiled = torch.compile(attention, backend="seqfast", options=options)
    for length, compiles in ((256, 1), (320, 0 if dynamic else 1)):
        g = torch.Generator(device=cuda).manual_seed(length)
        q, k, v = (
            torch.randn(2, heads, length, 64, device=cuda, generator=g)
            .to(torch.bfloat16)
            .requires_grad_()
            for heads in (8, 2, 2)
        )
        for t in (q, k, v) if dynamic else ():
            torch._dynamo.mark_dynamic(t, 2)  # (the length; the head dim stays fixed)
        with collecting() as report:
            loss = compiled(q, k, v)
            grads = torch.autograd.grad(loss, (q, k, v))
        uses = {(u.direction, u.implementation, u.reason) for u in report.implementations}
        assert len(uses) == 2 * compiles, uses
        assert all(implementation == "vendor" for _, implementation, _ in uses), uses
        want = attention(q, k, v)
        torch.testing.assert_close(loss, want, **TOLERANCES[torch.bfloat16])
        for got, want_grad in zip(grads, torch.autograd.grad(want, (q, k, v)), strict=True):
            scale = want_grad.abs().max().float().clamp_min(1.0)
            torch.testing.assert_close(
                got.float() / scale, want_grad.float() / scale, **TOLERANCES[torch.bfloat16]
            )
    torch._dynamo.reset()


@pytest.mark.parametrize("rest", ["inductor", "eager"])
def test_the_memory_models_peak_is_within_15_percent_of_cuda(rest):
    """The step's peak above what lives before it (parameters, the batch) against the model's
    peak, which counts activations and the gradients made so far."""
    torch.manual_seed(0)
    config = GPTConfig(vocab=8192, max_len=512, d_model=512, n_heads=8, n_layers=4, dropout=0.1)
    model = GPT(config).to(cuda)
    idx = torch.randint(config.vocab, (8, 512), device=cuda)
    targets = torch.randint(config.vocab, (8, 512), device=cuda)
    compiled = torch.compile(model, backend="seqfast", options={"rest": rest})
    with collecting() as report:
        compiled(idx, targets).backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    compiled(idx, targets).backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    (plan,) = report.memory
    predicted = plan.step.peak_bytes
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_plan_batchs_choice_trains_within_its_memory_limit():
    """The micro-batch, steps and options plan_batch chooses, run for real: the step's peak
    allocation (parameters, gradients and Adam's state included) stays within the limit, which
    is set where the whole batch does not fit at any memory budget."""
    torch.manual_seed(0)
    config = GPTConfig(vocab=8192, max_len=512, d_model=512, n_heads=8, n_layers=4, dropout=0.1)
    model = GPT(config).to(cuda)
    example = tuple(torch.randint(config.vocab, (2, 512), device=cuda) for _ in range(2))
    probe = seqcompile.plan_batch(model, example, 2**40, 32, quiet=True)
    limit = int(0.6 * min(c.total_bytes for c in probe.full_batch))
    plan = seqcompile.plan_batch(model, example, limit, 32)
    chosen = plan.chosen
    assert chosen is not None and chosen.steps > 1
    optimizer = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model, backend="seqfast", options=plan.options)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second optimizer step runs with Adam's state allocated
        for _ in range(chosen.steps):
            idx, targets = (
                torch.randint(config.vocab, (chosen.micro_batch, 512), device=cuda)
                for _ in range(2)
            )
            compiled(idx, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() <= limit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", [768, 1000, 4096, 5000])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_kernels_match_the_reference(dtype, width, rms, p):
    check_norm_kernels(dtype, width, rms, p)


def at_candidate(monkeypatch, index: int) -> None:
    """Every launch runs the `index`-th configuration of its space (the last where it has
    fewer), untimed."""

    def launch(spec, key, space, run, device, repeatable=True):
        config = space[min(index, len(space) - 1)]
        run(config)
        return config

    monkeypatch.setattr(tuning, "launch", launch)


@pytest.mark.parametrize("candidate", range(5))
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_every_norm_launch_configuration_matches_the_reference(monkeypatch, candidate, rms):
    """Tuning may pick any configuration of a space: each one computes what the default does."""
    at_candidate(monkeypatch, candidate)
    check_norm_kernels(torch.bfloat16, 1000, rms, 0.1)


@pytest.mark.parametrize("candidate", range(4))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_attention_launch_configuration_matches_the_reference(
    monkeypatch, candidate, head_dim, dtype
):
    at_candidate(monkeypatch, candidate)
    check_attention_kernels(dtype, head_dim, dict(causal=True, bias=False, mask=True, p=0.1))


def test_a_tuned_launch_is_recorded_for_the_device_and_still_matches(monkeypatch, tmp_path):
    monkeypatch.setenv("SEQFAST_AUTOTUNE", "1")
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(tmp_path))
    check_attention_kernels(torch.bfloat16, 64, dict(causal=True, bias=False, mask=False, p=0.0))
    (recorded,) = (tmp_path / "tuning").glob("*.json")
    assert torch.cuda.get_device_name(cuda).split()[0] in recorded.name
    assert len(json.loads(recorded.read_text())) == 3  # the forward, dkdv and dq


def check_norm_kernels(dtype, width, rms, p):
    g = torch.Generator(device=cuda).manual_seed(0)
    rows = 4099
    x, residual = (torch.randn(rows, width, device=cuda, generator=g).to(dtype) for _ in range(2))
    branch_bias, weight, bias = (torch.randn(width, device=cuda, generator=g) for _ in range(3))
    bias = None if rms else bias
    seed = torch.tensor(1234, device=cuda)
    args = dict(
        Call(norm_op.FORWARD, (x, residual, branch_bias, weight, bias, seed, 5, p, 1e-5, rms, dtype,
                               torch.float32), {})
    )  # fmt: skip
    kernels = norm_kernels.forward(**args)
    reference = norm_reference.forward(**args)
    for k, r in zip(kernels, reference, strict=True):
        torch.testing.assert_close(k, r, **TOLERANCES[dtype if k.dtype == dtype else torch.float32])
    grad_out = torch.randn_like(kernels[0])
    grad_sum = torch.randn_like(kernels[1])
    saved = (grad_out, grad_sum, kernels[1], kernels[2], kernels[3], weight, seed, 5, p, rms)
    dtypes = (dtype, dtype, None if rms else torch.float32, torch.float32)
    bargs = dict(Call(norm_op.BACKWARD, (*saved, *dtypes), {}))
    for k, r in zip(norm_kernels.backward(**bargs), norm_reference.backward(**bargs), strict=True):
        tol = TOLERANCES[dtype] if k.dim() == 2 else dict(atol=1e-1, rtol=1e-2)
        torch.testing.assert_close(k, r, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize(
    "features",
    [
        dict(causal=False, bias=False, mask=False, p=0.0),
        dict(causal=True, bias=False, mask=True, p=0.1),
        dict(causal=False, bias=True, mask=True, p=0.0),
    ],
    ids=["plain", "causal_mask_dropout", "bias_mask"],
)
def test_attention_kernels_match_the_reference(dtype, head_dim, features):
    check_attention_kernels(dtype, head_dim, features)


def check_attention_kernels(dtype, head_dim, features):
    g = torch.Generator(device=cuda).manual_seed(0)
    b, h, kv_heads, lq, lk = 2, 4, 2, 333, 517
    q = torch.randn(b, h, lq, head_dim, device=cuda, generator=g).to(dtype)
    k, v = (
        torch.randn(b, kv_heads, lk, head_dim, device=cuda, generator=g).to(dtype) for _ in "kv"
    )
    bias = torch.randn(1, h, lq, lk, device=cuda, generator=g) if features["bias"] else None
    mask = torch.rand(b, 1, 1, lk, device=cuda, generator=g) > 0.2 if features["mask"] else None
    p, seed = features["p"], torch.tensor(77, device=cuda)
    args = dict(
        q=q, k=k, v=v, bias=bias, mask=mask, seed=seed, stream=3, p=p, scale=head_dim**-0.5,
        causal=features["causal"], masked_value=-math.inf,
    )  # fmt: skip
    args = dict(Call(attention_op.FORWARD, (), args))  # the defaults filled in
    kernels = attention_kernels.forward(**args)
    reference = attention_reference.forward(**args)
    for kernel, ref in zip(kernels, reference, strict=True):
        torch.testing.assert_close(kernel, ref, **TOLERANCES[kernel.dtype])
    grad_out = torch.randn_like(kernels[0])
    out, row_max, log_sum = reference
    bargs = dict(
        args, grad_out=grad_out, out=out, row_max=row_max, log_sum=log_sum,
        bias_grad=bias is not None, rel_grad=False,
    )  # fmt: skip
    for kernel, ref in zip(
        attention_kernels.backward(**bargs), attention_reference.backward(**bargs), strict=True
    ):
        assert kernel.shape == ref.shape
        if ref.numel():  # relative to the gradient's size: sums over up to 517 keys
            scale = ref.abs().max().clamp_min(1.0)
            torch.testing.assert_close(kernel / scale, ref / scale, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_attention_vendor_matches_the_reference_and_mixes_with_the_kernels(
    dtype, head_dim, causal
):
    """SDPA's flash kernels through the vendor bodies, grouped heads: the output and each row's
    log-sum-exp as the reference gives them, and the gradients from either forward's
    statistics."""
    g = torch.Generator(device=cuda).manual_seed(0)
    b, h, kv_heads, length = 2, 4, 2, 333
    q = torch.randn(b, h, length, head_dim, device=cuda, generator=g).to(dtype)
    k, v = (
        torch.randn(b, kv_heads, length, head_dim, device=cuda, generator=g).to(dtype) for _ in "kv"
    )
    forward = attention_entry.ENTRY.forward
    call = Call(forward, (), dict(q=q, k=k, v=v, bias=None, mask=None, seed=None, stream=0,
                                  p=0.0, scale=head_dim**-0.5, causal=causal,
                                  masked_value=-math.inf))  # fmt: skip
    args = {name: call[name] for name in call}
    assert attention_entry.ENTRY.vendor_refusal(call) is None
    vendor = attention_op.vendor_forward(**args)
    reference = attention_op.lower_forward(**args)
    for got, want in zip(attention_vendor.compared(vendor), attention_vendor.compared(reference),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, **TOLERANCES[got.dtype])
    grad_out = torch.randn_like(reference[0])
    backward = attention_entry.ENTRY.backward[0]
    for stats in (vendor, reference):
        saved = dict(grad_out=grad_out, out=stats[0], row_max=stats[1], log_sum=stats[2],
                     bias_grad=False)  # fmt: skip
        bcall = Call(backward, (), {**args, **saved})
        bargs = {name: bcall[name] for name in bcall}
        for got, want in zip(attention_op.vendor_backward(**bargs),
                             attention_op.lower_backward(**bargs), strict=True):  # fmt: skip
            assert got.shape == want.shape and got.dtype == want.dtype
            if want.numel():
                scale = want.abs().max().clamp_min(1.0)
                torch.testing.assert_close(got / scale, want / scale, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_pointwise_kernels_match_the_reference(dtype):
    """bias + GELU + dropout and SwiGLU on a broadcast bias and a strided operand: forward and
    every gradient of the compiled kernels against the same region on CPU (the reference)."""
    from seqcompile.ops.pointwise.op import pointwise
    from seqcompile.patterns.pointwise_cut import region_of_function

    def region(x, b, gate):
        return torch.nn.functional.dropout(
            torch.nn.functional.gelu(x + b), 0.1
        ) * torch.nn.functional.silu(gate)

    g = torch.Generator().manual_seed(0)
    cpu = [
        torch.randn(37, 1000, generator=g).to(dtype),
        torch.randn(1000, generator=g).to(dtype),
        torch.randn(1000, 37, generator=g).to(dtype).t(),
    ]
    key = region_of_function(region, [t.requires_grad_() for t in cpu]).key
    seed = torch.tensor(77, dtype=torch.int64)
    results = []
    for device in ("cpu", "cuda"):
        inputs = [t.detach().to(device).requires_grad_() for t in cpu]
        (out,) = pointwise(inputs, seed.to(device), 3, key)
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        results.append([t.float().cpu() for t in (out, *grads)])
    for fast, reference in zip(*reversed(results), strict=True):
        torch.testing.assert_close(fast, reference, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [1000, 50257])
def test_loss_kernels_match_eager(dtype, vocab):
    """Cross-entropy (every 5th target ignored, label smoothing) and linear + cross-entropy in
    chunks: loss and every gradient on CUDA against eager on the same inputs."""

    import seqcompile.ops.cross_entropy  # noqa: F401  (registers the ops)
    import seqcompile.ops.linear_cross_entropy  # noqa: F401

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(257, vocab, device="cuda", generator=g).to(dtype).requires_grad_()
    target = torch.randint(vocab, (257,), device="cuda", generator=g)
    target[::5] = -100
    rows, _ = torch.ops.seqfast.cross_entropy(logits, target, -100, 0.1)
    expected = F.cross_entropy(logits.float(), target, label_smoothing=0.1, reduction="none")
    torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4)
    cotangent = torch.rand(257, device="cuda", generator=g)
    (grad,) = torch.autograd.grad(rows, logits, cotangent)
    (eager,) = torch.autograd.grad(expected, logits, cotangent)
    torch.testing.assert_close(grad, eager, **TOLERANCES[dtype])

    hidden = torch.randn(257, 256, device="cuda", generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, 256, device="cuda", generator=g) / 16).to(dtype).requires_grad_()
    loss = torch.ops.seqfast.linear_cross_entropy(
        hidden, weight, None, target, -100, 0.0, True, 64, dtype, [True, True, False]
    )[0]
    expected = F.cross_entropy(F.linear(hidden, weight).float(), target)
    torch.testing.assert_close(loss, expected, atol=1e-3, rtol=1e-3)
    for got, want in zip(
        torch.autograd.grad(loss, [hidden, weight]),
        torch.autograd.grad(expected, [hidden, weight]),
        strict=True,
    ):
        torch.testing.assert_close(got, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_kernels_on_infinite_logits_and_strided_targets(smoothing):
    """The CUDA kernels on what the interpreter tests at small sizes: -inf logits (one, on the
    target, the first blocks of the vocabulary, a whole row), +inf and NaN, targets read
    through a stride, linear + cross-entropy over a bias that masks classes; eager's loss and
    gradients, NaN and inf in the same places."""

    import seqcompile.ops.cross_entropy  # noqa: F401  (registers the ops)
    import seqcompile.ops.linear_cross_entropy  # noqa: F401

    vocab, inf = 10000, float("inf")  # 3 blocks of 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(8, vocab, device="cuda", generator=g)
    pairs = torch.randint(vocab, (8, 2), device="cuda", generator=g)
    target = pairs[:, 1]
    target[2] = -100
    logits[0, (target[0] + 1) % vocab] = -inf
    logits[1, target[1]] = -inf
    logits[3] = -inf
    logits[4, :8192] = -inf
    target[4] = 9000
    logits[5, 3] = inf
    logits[6, 3] = float("nan")
    logits.requires_grad_()
    rows, _ = torch.ops.seqfast.cross_entropy(logits, target, -100, smoothing)
    expected = F.cross_entropy(logits, target, label_smoothing=smoothing, reduction="none")
    torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4, equal_nan=True)
    cotangent = torch.rand(8, device="cuda", generator=g)
    (grad,) = torch.autograd.grad(rows, logits, cotangent)
    (eager,) = torch.autograd.grad(expected, logits, cotangent)
    torch.testing.assert_close(grad, eager, atol=1e-5, rtol=1e-4, equal_nan=True)

    hidden = torch.randn(257, 64, device="cuda", generator=g).requires_grad_()
    weight = (torch.randn(vocab, 64, device="cuda", generator=g) / 8).requires_grad_()
    bias = torch.zeros(vocab, device="cuda")
    bias[1::3] = -inf
    bias.requires_grad_()
    target = torch.randint(vocab // 3, (257, 2), device="cuda", generator=g)[:, 1] * 3
    loss = torch.ops.seqfast.linear_cross_entropy(
        hidden, weight, bias, target, -100, smoothing, True, 64, torch.float32, [True] * 3
    )[0]
    expected = F.cross_entropy(F.linear(hidden, weight, bias), target, label_smoothing=smoothing)
    torch.testing.assert_close(loss, expected, atol=1e-3, rtol=1e-3)
    wrt = [hidden, weight, bias]
    for got, want in zip(
        torch.autograd.grad(loss, wrt), torch.autograd.grad(expected, wrt), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


def test_a_compiled_linear_loss_takes_the_chunk_that_fills_the_device():
    """The default chunk on a GPU (`memory/loss_chunks.py`): set from the device's
    multiprocessors in the planned forward, and loss and gradients as eager's."""
    import seqcompile.backend as backend
    from seqcompile.ops import registry

    forward = registry.entry_named("linear_cross_entropy").forward
    g = torch.Generator(device="cuda").manual_seed(0)
    head = torch.nn.Linear(768, 50257, bias=False, device="cuda")
    hidden = torch.randn(4096, 768, device="cuda", generator=g, requires_grad=True)
    target = torch.randint(50257, (4096,), device="cuda", generator=g)
    planned = {}
    original = backend.plan_memory

    def keep(*args, **kwargs):
        planned["plan"] = original(*args, **kwargs)
        return planned["plan"]

    def loss_of(hidden, target):
        return F.cross_entropy(head(hidden).float(), target)

    def step(fn):
        loss = fn(hidden, target)
        return (loss, *torch.autograd.grad(loss, [hidden, head.weight]))

    eager = step(loss_of)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "plan_memory", keep)
        compiled = step(torch.compile(loss_of, backend="seqfast"))
    nodes = [n for n in planned["plan"].forward.graph.nodes if n.target == forward]
    assert nodes and all(Call.of(n)["chunk"] > 0 for n in nodes)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
