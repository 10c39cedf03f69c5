"""The `verify` option: a compiled graph is compared with eager, forward and backward, when it is
compiled; a fused site that makes them differ is found, left unfused with a warning, written up as
a reproduction script, and shown in the report."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seqcompile.checks import verify
from seqcompile.ops.add_norm import reference as norm_reference
from seqcompile.ops.cross_entropy import reference as cross_entropy
from seqcompile.report import collecting


class Block(nn.Module):
    """Attention, then residual + LayerNorm, then a GELU MLP: one site per family."""

    def __init__(self, width=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        b, length, width = x.shape
        q, k, v = (
            t.view(b, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = self.norm(x + self.out(y.transpose(1, 2).reshape(b, length, width)))
        return self.down(F.gelu(self.up(h)))


def step(model, x, compiled=None):
    model.zero_grad()
    run = model if compiled is None else compiled
    loss = (run(x) * torch.linspace(-1, 1, x.shape[-1])).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def seqfast(model, **options):
    return torch.compile(model, backend="seqfast", options=options)


def test_a_correct_compile_is_reported_as_matching_eager():
    torch.manual_seed(0)
    model = Block()
    with collecting() as report:
        step(model, torch.randn(2, 5, 8), seqfast(model, verify=True))
    assert [f.left_unfused for f in report.verified] == [()]
    assert "matches eager (3 fused sites)" in str(report)


@pytest.mark.slow
def test_a_wrong_backward_is_found_left_unfused_reported_and_written_up(monkeypatch, tmp_path):
    """The fused norm's backward is made wrong: verify finds the norm, and the graph compiled
    without it (at symbolic sizes, as the compile was dynamic) gives eager's gradients at the
    first call's size and at another."""

    def wrong_backward(*args, **kwargs):
        return tuple(g * 2 for g in real_backward(*args, **kwargs))

    real_backward = norm_reference.backward
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(
        model, backend="seqfast", dynamic=True, options={"verify": True, "dump_dir": str(tmp_path)}
    )
    for length in (5, 7):
        x = torch.randn(2, length, 8)
        monkeypatch.setattr(norm_reference, "backward", real_backward)
        expected_loss, expected = step(model, x)
        monkeypatch.setattr(norm_reference, "backward", wrong_backward)
        with collecting() as report, warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            loss, grads = step(model, x, compiled)
        torch.testing.assert_close(loss, expected_loss)
        for got, want in zip(grads, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        if length == 5:
            assert any("left unfused: norm:" in str(w.message) for w in warned)
            first = report
    (finding,) = first.verified
    assert [site.split(" ")[0] for site in finding.left_unfused] == ["norm:layer_norm"]
    assert first.counts["norm"] == 0 and first.counts["attention"] == 1
    assert "the gradient of input" in finding.verdict
    assert "left unfused: norm:layer_norm" in str(first)
    # the kernels, memory plan and dump are those of the compile that runs, without the norm
    assert {k.op for k in first.kernels} == {"attention", "pointwise"}
    assert {k.graph for k in first.kernels} == {m.graph for m in first.memory}
    assert [m.graph.endswith("_without_some_sites") for m in first.memory] == [True]
    dumped = {p.name.split("_")[0] for p in (Path(finding.repro).parent / "kernels").iterdir()}
    assert dumped == {"attention", "pointwise"}

    monkeypatch.setattr(norm_reference, "backward", real_backward)
    script = subprocess.run(
        [sys.executable, finding.repro], capture_output=True, text=True, timeout=300
    )
    assert script.returncode == 0, script.stderr
    assert script.stdout.strip().splitlines()[-1] == "matches eager"  # the bug is gone there


def test_a_graph_with_dropout_is_reported_as_not_verified():
    with collecting() as report:
        torch.compile(lambda x: F.dropout(x, 0.5) * 2, backend="seqfast", options={"verify": True})(
            torch.randn(4, requires_grad=True)
        )
    assert "not verified: the graph draws random numbers" in str(report)


def test_difference_names_a_missing_gradient_and_a_wrong_value():
    w = torch.randn(3, requires_grad=True)
    assert verify.difference(lambda x, w: x * w, lambda x, w: x * w, [torch.randn(3), w]) is None
    missing = verify.difference(
        lambda x, w: x * w, lambda x, w: x * w.detach(), [torch.randn(3), w]
    )
    assert missing == "the gradient of input 1: eager has a gradient and the compiled graph none"
    assert "output 0: max difference" in verify.difference(
        lambda x: x, lambda x: x * 1.01, [torch.ones(3)]
    )


def test_an_inference_graph_is_compared_without_gradients():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 5, 8)
    with collecting() as report, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        seqfast(model, verify=True)(x)
    assert "matches eager (3 fused sites)" in str(report)


def test_any_random_op_makes_a_graph_unverifiable_even_after_a_dropout_that_drops_nothing():
    def fn(x):
        return F.dropout(F.dropout(x, 0.0) * 2, 0.5) + torch.rand_like(x)

    with collecting() as report:
        seqfast(fn, verify=True)(torch.randn(4, requires_grad=True))
    assert "not verified: the graph draws random numbers" in str(report)


def test_a_wrong_user_replacement_is_the_site_left_unfused():
    import seqcompile

    seqcompile.register_pattern(
        "tanh_gelu",
        lambda x: F.gelu(x, approximate="tanh"),
        [torch.randn(4, 8)],
        replacement_fn=lambda x: F.gelu(x, approximate="tanh") * 1.1,  # a wrong replacement
    )
    try:
        x = torch.randn(3, 8) * 3
        with collecting() as report, warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            out = seqfast(lambda x: F.gelu(x, approximate="tanh") * 2, verify=True)(x)
    finally:
        seqcompile.unregister_pattern("tanh_gelu")
    torch.testing.assert_close(out, F.gelu(x, approximate="tanh") * 2)
    (finding,) = report.verified
    assert [site.split(":")[0] for site in finding.left_unfused] == ["tanh_gelu"]
    assert report.counts["tanh_gelu"] == 0


def test_a_difference_that_does_not_repeat_blames_no_site():
    """Bisection first checks that fusing every candidate differs; here nothing differs."""
    compiled = torch.compile(lambda x: x * 2, backend="seqfast")
    sites = {"pointwise:a": "", "pointwise:b": ""}
    culprit = verify._first_failing_site(
        lambda x: x * 2, lambda only: (compiled, sites), [torch.ones(3)], list(sites), []
    )
    assert culprit is None


def strided_views():
    """A column of a wider tensor, one row into its storage; the second column of pairs; an
    expanded row; and, for contrast, a contiguous tensor and a 0-d one."""
    return [
        torch.randn(5, 7)[1:, ::3],
        torch.randint(10, (6, 2))[:, 1],
        torch.randn(1, 4).expand(3, 4),
        torch.randn(2, 3),
        torch.randn(()),
        torch.randn(4, 0)[1:],
    ]


def test_both_runs_get_the_inputs_laid_out_as_given():
    """Sizes, strides and storage offsets as the user passed them, in storage of their own."""
    given = strided_views()
    seen = []

    def record(*inputs):
        seen.append([(t.shape, t.stride(), t.storage_offset(), t.data_ptr()) for t in inputs])
        return inputs[0] * 2

    assert verify.difference(record, record, given) is None
    for run in seen:
        for (shape, stride, offset, pointer), t in zip(run, given, strict=True):
            assert (shape, stride, offset) == (t.shape, t.stride(), t.storage_offset())
            assert pointer != t.data_ptr() or t.numel() == 0
    for t in given:
        copy = verify.copy_as_given(t.requires_grad_(t.is_floating_point()))
        assert torch.equal(copy, t) and copy.requires_grad == t.requires_grad and copy.is_leaf


def test_a_site_wrong_only_for_strided_targets_is_found(monkeypatch):
    """A loss that reads its targets as if they were contiguous (a mistake the cross-entropy
    kernels once made) is found when the targets passed in are a column of pairs."""
    real = cross_entropy.forward

    def contiguous_targets(logits, target, ignore_index, smoothing):
        return real(logits, target.as_strided(target.shape, (1,)), ignore_index, smoothing)

    monkeypatch.setattr(cross_entropy, "forward", contiguous_targets)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g).requires_grad_()
    targets = torch.randint(11, (6, 2), generator=g)[:, 1]
    with collecting() as report, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        loss = seqfast(lambda x, t: F.cross_entropy(x, t), verify=True)(logits, targets)
    (finding,) = report.verified
    assert [site.split(":")[0] for site in finding.left_unfused] == ["loss"]
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets))
