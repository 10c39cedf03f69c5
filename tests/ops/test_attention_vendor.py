"""Attention's vendor implementation (`ops/attention/vendor.py`): what it refuses and why, that
its row statistics mix with the other implementations' in either direction, and that its CUDA
bodies trace at fake CUDA values to SDPA's flash ops with the layouts the op's fake
implementation promises (their numbers are checked in the GPU tier; on CPU the sample sweep runs
the CPU bodies)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TOLERANCES
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from seqcompile.ops import registry
from seqcompile.ops.attention import op as attention
from seqcompile.ops.attention import vendor as attention_vendor
from seqcompile.ops.fused_op import Call

ENTRY = registry.entry_named("attention")
FORWARD, BACKWARD = ENTRY.forward, ENTRY.backward[0]


def _arguments(b=2, h=4, kv_heads=2, lq=8, lk=8, d=16, dtype=torch.float32, device="cpu", **given):
    """The op's arguments; on CUDA (under a fake mode) without values."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(b, heads, length, d, generator=g).to(dtype)
        if device == "cpu"
        else torch.empty(b, heads, length, d, dtype=dtype, device=device)
        for heads, length in ((h, lq), (kv_heads, lk), (kv_heads, lk))
    )
    args = dict(
        q=q, k=k, v=v, bias=None, mask=None, seed=None, stream=0, p=0.0, scale=d**-0.5,
        causal=True, masked_value=-math.inf, window=0, score_mod="", doc_q=None, doc_kv=None,
        rel_bias=None, prefix=None,
    )  # fmt: skip
    args.update(given)
    return args


def _refusal(**given) -> str | None:
    return ENTRY.vendor_refusal(Call(FORWARD, (), _arguments(**given)))


def test_the_vendor_takes_plain_causal_and_grouped_attention():
    assert _refusal() is None
    assert _refusal(causal=False, lq=5, lk=7) is None
    assert _refusal(kv_heads=4, dtype=torch.bfloat16) is None


@pytest.mark.parametrize(
    "given, said",
    [
        (dict(mask=torch.ones(8, 8, dtype=torch.bool)), "reads a boolean mask"),
        (dict(bias=torch.zeros(8, 8)), "reads an additive bias"),
        (dict(rel_bias=torch.zeros(1, 15)), "a bias by key - query position"),
        (dict(doc_q=torch.zeros(8, 1), doc_kv=torch.zeros(1, 8)), "document ids"),
        (dict(prefix=torch.zeros(2, 1, 1, 1, dtype=torch.int64)), "a prefix"),
        (dict(score_mod="tanh_cap"), "modifies the scores"),
        (dict(window=4), "sliding window"),
        (dict(p=0.1, seed=torch.zeros(2, dtype=torch.int64)), "another random stream"),
        (dict(lq=5, lk=7), "causal with 5 queries and 7 keys"),
        (dict(lq=0), "it is empty"),
        (dict(dtype=torch.float64), "does not take torch.float64"),
    ],
)
def test_the_vendor_refuses_what_sdpa_cannot_express_and_says_why(given, said):
    refusal = _refusal(**given)
    assert refusal is not None and said in refusal, refusal


def test_the_vendor_refuses_mixed_dtypes_and_cuda_float32():
    args = _arguments()
    args["k"] = args["k"].double()
    assert "mix dtypes" in ENTRY.vendor_refusal(Call(FORWARD, (), args))
    with FakeTensorMode():
        fake = _arguments(device="cuda")
        assert "float16 or bfloat16" in ENTRY.vendor_refusal(Call(FORWARD, (), fake))
        fake = _arguments(device="cuda", dtype=torch.bfloat16, d=12)
        assert "multiples of 8" in ENTRY.vendor_refusal(Call(FORWARD, (), fake))


def _by_name(op, args: dict) -> dict:
    call = Call(op, (), args)
    return {name: call[name] for name in call}


@pytest.mark.parametrize("forward", ["kernel", "vendor"])
def test_a_backward_of_either_implementation_reads_a_forward_of_the_other(forward):
    """Only the sum of the row statistics is defined: the vendor's forward gives its log-sum-exp
    and zeros, the op's the row max and the log of the sum, and each backward reads the sum."""
    args = _arguments()
    make = attention.vendor_forward if forward == "vendor" else FORWARD
    out, row_max, log_sum = make(**args)
    want_out, want_max, want_sum = FORWARD(**args)
    torch.testing.assert_close(out, want_out, **TOLERANCES[torch.float32])
    torch.testing.assert_close(row_max + log_sum, want_max + want_sum, **TOLERANCES[torch.float32])
    grad_out = torch.randn_like(out)
    saved = dict(grad_out=grad_out, out=out, row_max=row_max, log_sum=log_sum, bias_grad=False)
    called = _by_name(BACKWARD, {**args, **saved})
    backward = attention.lower_backward if forward == "vendor" else attention.vendor_backward
    got = backward(**called)
    want = attention.lower_backward(**{**called, "row_max": want_max, "log_sum": want_sum})
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=False):
        torch.testing.assert_close(g, w, **TOLERANCES[torch.float32], msg=name)


def test_the_cuda_bodies_trace_to_sdpa_flash_with_the_fake_layouts():
    """At fake CUDA values (bf16, head dim 64, grouped heads, causal) the forward and backward
    bodies call SDPA's flash ops and return what the op's fake implementation gives."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = _arguments(2, 4, 2, 32, 32, 64, dtype=torch.bfloat16, device="cuda")
        q, k, v = args["q"], args["k"], args["v"]
        stats = torch.empty(2, 4, 32, device="cuda")
        saved = dict(grad_out=torch.empty_like(q), out=torch.empty_like(q), row_max=stats,
                     log_sum=stats, bias_grad=False)  # fmt: skip
        backward_args = _by_name(BACKWARD, {**args, **saved})
        for op, body, arguments in (
            (FORWARD, attention.vendor_forward, args),
            (BACKWARD, attention.vendor_backward, backward_args),
        ):
            tensors = {n: t for n, t in arguments.items() if isinstance(t, torch.Tensor)}

            def traced(*values, arguments=arguments, tensors=tensors, body=body):
                return body(**{**arguments, **dict(zip(tensors, values, strict=True))})

            gm = make_fx(traced)(*tensors.values())
            targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
            vendor_op = "aten._scaled_dot_product_flash_attention"
            assert any(t.startswith(vendor_op) for t in targets), targets
            want = op(**arguments)
            got = body(**arguments)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device), (op, i)
                if g.numel():
                    assert g.stride() == w.stride(), (op, i, g.stride(), w.stride())
    assert q.device.type == "cuda" and k.shape[1] == v.shape[1] == 2


def test_the_vendor_compares_outputs_by_the_row_log_sum_exp():
    out, row_max, log_sum = (torch.randn(2, 3) for _ in range(3))
    compared = attention_vendor.compared((out, row_max, log_sum))
    assert len(compared) == 2
    torch.testing.assert_close(compared[1], row_max + log_sum)
