"""The chunk of the linear + loss operators on a GPU (`memory/loss_chunks.py`), with the device's
multiprocessors given: as many even chunks as fill the device, within the step's planned peak."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import seqcompile.backend as backend
from seqcompile.ops import linear_head as head
from seqcompile.ops import registry
from seqcompile.ops.fused_op import Call
from seqcompile.report import collecting
from seqcompile.run import runtime

FORWARD = registry.entry_named("linear_cross_entropy").forward
ROWS, FEATURES, CLASSES = 2048, 256, 512
"""Logits of 2^20 elements: the default chunk is an eighth of the rows (256)."""


def _call(rows: int, features: int, classes: int, hidden_grad: bool = True) -> Call:
    arguments = dict(
        hidden=torch.empty(rows, features, device="meta"),
        weight=torch.empty(classes, features, device="meta"),
        bias=None, target=torch.empty(rows, dtype=torch.int64, device="meta"), ignore_index=-100,
        smoothing=0.0, mean=True, chunk=0, compute_dtype=torch.bfloat16,
        needs_grad=[hidden_grad, True, False],
    )  # fmt: skip
    return Call(FORWARD, (), arguments)


@pytest.mark.parametrize(
    "rows, features, classes, hidden_grad, chunk",
    [
        (8192, 4096, 128256, True, 1171),  # 9 row tiles x 32 columns fill 132 twice: 7 chunks
        (8192, 768, 50257, True, 8192),  # 44 row tiles x 6 columns: room for one chunk only
        (8192, 768, 50257, False, 128),  # the logits alone: 393 columns, one row tile fills
    ],
)
def test_the_chunk_that_fills_an_h200(rows, features, classes, hidden_grad, chunk):
    call = _call(rows, features, classes, hidden_grad)
    assert head.even_chunk(rows, head.filling_chunk(call, 132)) == chunk


class Head(nn.Module):
    """A linear head and its cross-entropy; with `room`, a temporary larger than any chunk of
    logits makes the step's peak elsewhere."""

    def __init__(self, room: bool):
        super().__init__()
        self.head = nn.Linear(FEATURES, CLASSES, bias=False)
        self.room = room

    def forward(self, hidden, target, other):
        loss = F.cross_entropy(self.head(hidden), target)
        return loss + (other @ other).sum() * 0 if self.room else loss


def _step(room: bool, processors: int | None, monkeypatch):
    """Loss, gradients, the chunk the planned forward gives its call, and the planned peak."""
    torch.manual_seed(0)
    model = Head(room)
    hidden = torch.randn(ROWS, FEATURES, requires_grad=True)
    target = torch.randint(CLASSES, (ROWS,))
    other = torch.randn(1500, 1500)  # its product: 9 MB; a chunk of every row's logits: 4 MB
    planned = {}
    original = backend.plan_memory

    def keep(*args, **kwargs):
        plan = original(*args, **kwargs)
        planned["forward"] = plan.forward
        return plan

    monkeypatch.setattr(runtime, "multiprocessors", lambda device: processors)
    monkeypatch.setattr(backend, "plan_memory", keep)
    with collecting() as report:
        compiled = torch.compile(model, backend="seqfast", options={"rest": "eager"})
        loss = compiled(hidden, target, other)
        loss.backward()
    torch._dynamo.reset()
    (node,) = (n for n in planned["forward"].graph.nodes if n.target == FORWARD)
    peak = report.memory[-1].step.peak_bytes
    return loss, hidden.grad, model.head.weight.grad, Call.of(node)["chunk"], peak


def test_a_chunk_that_fills_the_device_with_room_under_the_peak(monkeypatch):
    default = _step(room=True, processors=None, monkeypatch=monkeypatch)
    filled = _step(room=True, processors=10_000, monkeypatch=monkeypatch)
    assert default[3] == 0 and filled[3] == ROWS  # more tiles than rows: one chunk of all
    assert filled[4] <= default[4]
    for got, want in zip(filled[:3], default[:3], strict=True):
        torch.testing.assert_close(got, want)


def test_a_chunk_that_would_raise_the_peak_is_shortened(monkeypatch):
    default = _step(room=False, processors=None, monkeypatch=monkeypatch)
    limited = _step(room=False, processors=10_000, monkeypatch=monkeypatch)
    assert head.default_chunk(ROWS, CLASSES) <= limited[3] < ROWS
    assert limited[4] <= default[4]
    for got, want in zip(limited[:3], default[:3], strict=True):
        torch.testing.assert_close(got, want)


def test_fewer_rows_than_the_device_needs_take_shorter_chunks(monkeypatch):
    """One multiprocessor: a chunk of one row tile fills it twice over two columns of features,
    so the rows split in sixteen, less than the default chunk keeps live."""
    chunked = _step(room=False, processors=1, monkeypatch=monkeypatch)
    default = _step(room=False, processors=None, monkeypatch=monkeypatch)
    assert chunked[3] == 128 < head.default_chunk(ROWS, CLASSES)
    assert chunked[4] <= default[4]
    for got, want in zip(chunked[:3], default[:3], strict=True):
        torch.testing.assert_close(got, want)
