"""Attention's vendor implementation in a compiled step: chosen where it measures fastest (timed
by an injected timer, run on CPU by ATen's flash kernels), forced by the option, refused with the
reason where it cannot express the call, and left out where it disagrees with the reference or
fails; the step's output and every gradient match eager whichever runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from seqcompile import report
from seqcompile.lower import choice
from seqcompile.lower.measure import Measurer
from seqcompile.ops import registry
from seqcompile.ops.attention import vendor as attention_vendor


class Timer:
    def __init__(self, **times: float):
        self.times = {"kernel": 2.0, "lowering": 1.0, "vendor": 0.5, **times}
        self.asked: list[str] = []

    def __call__(self, name, run):
        self.asked.append(name)
        return self.times[name]


def _attention(q, k, v, mask=None):
    causal = mask is None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3)


def _step(measurer=None, mask=None, **options) -> dict[tuple[str, str], tuple[str, str]]:
    """A compiled attention step (the eager executor unless `options` say), its output and the
    gradients of q, k and v checked against eager; what each call ran, and why."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, requires_grad=True) for _ in range(3))
    want = _attention(q, k, v, mask)
    cotangent = torch.randn(want.shape, generator=g)
    want_grads = torch.autograd.grad(want, (q, k, v), cotangent)
    compiled = torch.compile(_attention, backend="seqfast", options={"rest": "eager", **options})
    with report.collecting() as seen:
        if measurer is None:
            got = compiled(q, k, v, mask)
        else:
            with choice.measuring_with(measurer):
                got = compiled(q, k, v, mask)
        grads = torch.autograd.grad(got, (q, k, v), cotangent)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    for name, g_, w in zip("qkv", grads, want_grads, strict=True):
        torch.testing.assert_close(g_, w, **TOLERANCES[torch.float32], msg=f"d{name}")
    runs = {(u.direction, u.op): (u.implementation, u.reason) for u in seen.implementations}
    assert set(runs) == {("forward", "attention"), ("backward", "attention")}, runs
    return runs


@pytest.fixture(autouse=True)
def _fresh_results(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize(
    "rest", ["eager", pytest.param("inductor", marks=pytest.mark.slow)]
)  # (Inductor compiles)
def test_the_vendor_runs_where_it_measures_fastest(rest):
    timer = Timer()
    runs = _step(Measurer(timer), rest=rest)
    for implementation, reason in runs.values():
        assert implementation == "vendor"
        assert reason.startswith("measured: kernel 2 ms, vendor 0.5 ms;")
        assert "the lowering is not eligible" in reason, "attention's lowering holds the scores"
    assert timer.asked.count("vendor") == 2


def test_a_tie_with_the_vendor_goes_to_the_kernel():
    runs = _step(Measurer(Timer(vendor=1.95)))
    assert {implementation for implementation, _ in runs.values()} == {"kernel"}


def test_the_option_forces_the_vendor_and_refuses_it_where_it_cannot_express_the_call():
    runs = _step(implementations={"attention": "vendor"})
    assert set(runs.values()) == {("vendor", "forced by the implementations option")}
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True
    runs = _step(mask=mask, implementations={"attention": "vendor"})
    for implementation, reason in runs.values():
        assert implementation == "kernel"
        assert reason.startswith("the implementations option asks for vendor, but it reads a")


def test_a_vendor_that_disagrees_or_fails_is_never_chosen(monkeypatch, tmp_path):
    vendor_forward = attention_vendor.forward

    def wrong(**arguments):
        out, *stats = vendor_forward(**arguments)
        return (out * 2, *stats)

    monkeypatch.setattr(attention_vendor, "forward", wrong)
    timer = Timer()
    runs = _step(Measurer(timer))
    implementation, reason = runs["forward", "attention"]
    assert implementation == "kernel"
    assert "vendor left out: it differs from the reference: output 0 by" in reason
    assert runs["backward", "attention"][0] == "vendor"

    def fails(**arguments):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(attention_vendor, "backward", fails)
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(tmp_path / "again"))  # (nothing measured yet)
    runs = _step(Measurer(Timer()))
    implementation, reason = runs["backward", "attention"]
    assert implementation == "kernel"
    assert "vendor left out: it fails: RuntimeError: no kernel for this device" in reason


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_default_table_runs_the_vendor_on_cuda_where_the_call_allows(dtype):
    """With nothing measured, a CUDA attention call runs the vendor (the table's row); a float32
    call, which FlashAttention does not take, its kernel, and the report says why."""
    entry = registry.entry_named("attention")

    def call(q, k, v):
        return entry.forward(q, k, v, None, None, None, 0, 0.0, 0.125, True, float("-inf"))

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (torch.empty(2, 4, 32, 64, dtype=dtype, device="cuda") for _ in range(3))
        gm = make_fx(call)(q, k, v)
    (node,) = [n for n in gm.graph.nodes if n.target is entry.forward]
    made = choice._by_rule(node, entry, torch.device("cuda"), "inductor")
    assert made.reason.startswith("default table, nothing measured (SEQFAST_AUTOTUNE=0): ")
    if dtype == torch.bfloat16:
        assert made.implementation == "vendor" and "benchmarks/results/" in made.reason
    else:
        assert made.implementation == "kernel"
        assert "the vendor is not eligible: FlashAttention computes in float16" in made.reason
