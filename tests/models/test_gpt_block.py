"""The pointwise region fuser on a GPT-style block (bias + GELU + dropout in the MLP, dropout +
residual after each projection): what the compiled training step launches for element-wise work,
and what its backward keeps."""

import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from checks import kept_for_backward
from torch import nn

from seqcompile.report import collecting

WIDTH, BATCH, LENGTH, LAYERS = 16, 2, 8, 2


class Block(nn.Module):
    def __init__(self, p=0.1):
        super().__init__()
        self.attn = nn.Linear(WIDTH, WIDTH)  # the attention's output projection stands in for it
        self.fc, self.proj, self.p = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH), p

    def forward(self, x):
        h = x + F.dropout(self.attn(x), self.p, self.training)
        hidden = F.dropout(F.gelu(self.fc(h)), self.p, self.training)
        return h + F.dropout(self.proj(hidden), self.p, self.training)


class Stack(nn.Module):
    """Token embeddings in; GPT's input region (position embedding added, dropout) before the
    blocks."""

    def __init__(self, p=0.1):
        super().__init__()
        self.position = nn.Parameter(torch.randn(LENGTH, WIDTH))
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.p = p

    def forward(self, tokens):
        return self.blocks(F.dropout(tokens + self.position, self.p, self.training)).sum()


def launched(graph_file):
    """Ops a lowered graph calls, by name; and which of them are element-wise ATen ops."""
    names = Counter(re.findall(r"torch\.ops\.(\w+\.\w+\.\w+)\(", graph_file.read_text()))
    elementwise = Counter()
    for name, n in names.items():
        namespace, op, overload = name.split(".")
        if namespace == "aten":
            target = getattr(getattr(torch.ops.aten, op), overload)
            if torch.Tag.pointwise in target.tags:
                elementwise[name] = n
    return names, elementwise


def test_one_forward_and_one_backward_kernel_per_region(tmp_path):
    torch.manual_seed(0)
    model = Stack().train()
    x = torch.randn(BATCH, LENGTH, WIDTH, requires_grad=True)
    with collecting() as report:
        torch.compile(model, backend="seqfast", options={"dump_dir": str(tmp_path)})(x).backward()
    regions = 3 * LAYERS + 1
    assert report.counts["pointwise"] == regions, str(report)
    forward, forward_elementwise = launched(next(tmp_path.glob("*/*_lower_forward.py")))
    backward, backward_elementwise = launched(next(tmp_path.glob("*/*_lower_backward.py")))
    assert forward["seqfast.pointwise.default"] == regions
    assert not forward_elementwise, forward_elementwise
    assert backward["seqfast.pointwise_backward.default"] == regions
    # the two gradients of each value read twice (a block's input and h feed both the residual
    # and a projection) are added inside the backward of the region that produced the value
    assert not backward_elementwise, backward_elementwise


def test_the_backward_keeps_matmul_inputs_and_recomputes_the_regions():
    torch.manual_seed(0)
    model = Stack().train()
    x = torch.randn(BATCH, LENGTH, WIDTH, requires_grad=True)
    compiled = torch.compile(model, backend="seqfast")
    compiled(x).backward()  # compile outside the hooks: tracing saves too
    row = BATCH * LENGTH * 4  # bytes of one float32 per token
    per_block = row * (
        WIDTH  # h: the MLP's input, for fc's weight gradient
        + 4 * WIDTH  # fc's output before its bias: GELU's backward reads it, and proj's input
        # (the dropped-out GELU output, 4 * WIDTH) is recomputed from it and the seed
    )
    # the blocks after the first keep their input (the previous block's output) for the attn
    # projection's weight gradient; the first block's input is recomputed from the batch
    expected = LAYERS * per_block + (LAYERS - 1) * row * WIDTH + 8  # + one int64 seed
    assert kept_for_backward(compiled, x) == expected
    without_recompute = torch.compile(model, backend="seqfast", options={"checkpoint": "none"})
    without_recompute(x).backward()
    # without recompute the GELU outputs and the first block's input are kept besides
    recomputed = LAYERS * row * 4 * WIDTH + row * WIDTH
    assert kept_for_backward(without_recompute, x) == expected + recomputed
    # eager keeps the dropout masks and the GELU's input besides
    assert kept_for_backward(model, x) > expected + recomputed + LAYERS * BATCH * LENGTH * 6 * WIDTH


def _compiled_step(monkeypatch, fold: bool):
    """Loss and every gradient of one compiled step from a fixed seed, with or without the folding
    of gradient sums into region backwards."""
    if not fold:
        monkeypatch.setattr("seqcompile.memory.passes.fold_gradient_sums", lambda gm: [])
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Stack().train()
    x = torch.randn(BATCH, LENGTH, WIDTH, requires_grad=True)
    loss = torch.compile(model, backend="seqfast")(x)
    loss.backward()
    return [loss, x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.slow
@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
def test_folded_gradient_sums_give_autograds_gradients(monkeypatch, impl):
    folded = _compiled_step(monkeypatch, fold=True)
    unfolded = _compiled_step(monkeypatch, fold=False)
    assert folded[1].abs().sum() > 0
    for got, expected in zip(folded, unfolded, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
