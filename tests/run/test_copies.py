"""Copies a launcher makes of an argument its kernel reads contiguous are counted and reported,
and an argument already laid out as the kernel reads it is not copied."""

import pytest
import torch
import torch.nn.functional as F

import seqcompile
from seqcompile.run.copies import counting_copies


def layer_norm(x, w, b):
    return F.layer_norm(x + 1.0, (x.shape[-1],), w, b)


@pytest.mark.kernels("add_norm_fwd")
def test_a_transposed_input_is_copied_once_and_the_copy_is_reported(interpret):
    w, b = torch.randn(6), torch.randn(6)
    x = torch.randn(6, 4).t()  # rows 1 apart: the kernel reads rows contiguous
    with counting_copies() as copies:
        torch.ops.seqfast.add_norm(
            x, None, None, w, b, None, 0, 0.0, 1e-5, False, torch.float32, torch.float32
        )
    assert copies == {"add_norm: x (4, 6) strides (1, 4)": 1}, copies
    with counting_copies() as copies:
        torch.ops.seqfast.add_norm(
            x.contiguous(), None, None, w, b, None, 0, 0.0, 1e-5, False, torch.float32,
            torch.float32,
        )  # fmt: skip
    assert not copies


@pytest.mark.kernels("cross_entropy:forward")
def test_explain_reports_the_copies_of_its_run(interpret):
    def loss(logits, target):
        return F.cross_entropy(logits.t(), target)  # the classes 4 apart in memory

    report = seqcompile.explain(loss, torch.randn(7, 4), torch.randint(7, (4,)))
    assert report.counts["loss"] == 1
    assert report.copies == {"cross_entropy: logits (4, 7) strides (1, 4)": 1}, report.copies
    assert "cross_entropy: logits (4, 7) strides (1, 4): 1x" in str(report)


@pytest.mark.slow  # an Inductor compile with its backward
def test_explain_with_inductor_traces_lowerings_without_counting_copies(monkeypatch):
    """With rest="inductor" on CPU each fused call is traced at fake values into its lowering;
    a copy there has no storage to compare (explain crashed reading its pointer) and counts as
    none: the run itself took the reference, which copies nothing."""

    def attention(q, k, v):
        scores = q @ k.transpose(-1, -2) * 0.25
        return (torch.softmax(scores, -1) @ v).sum()

    q, k, v = (torch.randn(2, 2, 8, 16, requires_grad=True) for _ in "qkv")
    monkeypatch.setenv("SEQFAST_REST", "inductor")
    report = seqcompile.explain(attention, q, k, v)
    assert report.counts["attention"] == 1
    assert report.copies == {}
