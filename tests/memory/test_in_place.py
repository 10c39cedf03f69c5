"""The backward writes the cross-entropy gradient over the saved logits only when nothing else can
see them, computes what eager computes when it does, and a second backward through the same graph
works: with the graph retained, the backward writes over a copy."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion

from seqcompile.lower import retained_graph
from seqcompile.report import collecting

ROWS, VOCAB, WIDTH = 12, 50, 16
LOGIT_BYTES = 4 * ROWS * VOCAB


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, WIDTH, generator=g).requires_grad_()
    weight = torch.randn(VOCAB, WIDTH, generator=g).requires_grad_()
    return [hidden, weight, torch.randint(VOCAB, (ROWS,), generator=g)]


def loss_and_accuracy(hidden, weight, target):
    """The logits feed the loss and an accuracy, so the linear stays out of the loss."""
    logits = hidden @ weight.t()
    accuracy = (logits.argmax(-1) == target).float().mean()
    return F.cross_entropy(logits, target), accuracy


def reused(report):
    return sum(plan.written_over_bytes for plan in report.memory)


@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_logits_only_the_loss_reads_take_their_gradient(rest):
    report = check_fusion(
        loss_and_accuracy,
        inputs(),
        counts={"loss": 1},
        missed=["read elsewhere"],
        options={"rest": rest},
    )
    assert reused(report) == LOGIT_BYTES


def test_returned_logits_stay_as_the_forward_left_them():
    def loss_and_logits(hidden, weight, target):
        logits = hidden @ weight.t()
        return F.cross_entropy(logits, target), logits

    with collecting() as report:
        loss, logits = torch.compile(loss_and_logits, backend="seqfast")(*inputs())
    before = logits.detach().clone()
    loss.backward()
    assert reused(report) == 0
    torch.testing.assert_close(logits, before, rtol=0, atol=0)


def test_logits_passed_in_stay_as_the_caller_gave_them():
    logits = torch.randn(ROWS, VOCAB).requires_grad_()
    before = logits.detach().clone()
    with collecting() as report:
        torch.compile(F.cross_entropy, backend="seqfast")(logits, inputs()[2]).backward()
    assert reused(report) == 0
    torch.testing.assert_close(logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_a_second_backward_through_the_graph_works(rest, monkeypatch):
    """With the graph retained the backward gives the in-place twin a copy of the saved logits,
    so the next backward finds them intact; the backward that frees the graph writes over them."""
    copied = []
    copy = retained_graph._copy
    monkeypatch.setattr(retained_graph, "_copy", lambda t: copied.append(tuple(t.shape)) or copy(t))
    hidden, weight, target = inputs()
    with collecting() as report:
        loss, _ = torch.compile(loss_and_accuracy, backend="seqfast", options={"rest": rest})(
            hidden, weight, target
        )
    assert reused(report) == LOGIT_BYTES
    loss.backward(retain_graph=True)
    assert copied == [(ROWS, VOCAB)]
    once = hidden.grad.clone(), weight.grad.clone()
    (again,) = torch.autograd.grad(loss, hidden, retain_graph=True)
    loss.backward()
    assert copied == [(ROWS, VOCAB)] * 2  # the last backward frees the graph: no copy
    torch.testing.assert_close(again, once[0])
    torch.testing.assert_close(hidden.grad, 2 * once[0])
    torch.testing.assert_close(weight.grad, 2 * once[1])

    eager = inputs()
    loss_and_accuracy(*eager)[0].backward()
    torch.testing.assert_close(once[0], eager[0].grad)
    torch.testing.assert_close(once[1], eager[1].grad)


def test_a_second_backward_works_with_the_option_off():
    hidden, weight, target = inputs()
    kept = torch.compile(loss_and_accuracy, backend="seqfast", options={"reuse_saved": False})
    with collecting() as report:
        loss, _ = kept(hidden, weight, target)
    assert reused(report) == 0
    loss.backward(retain_graph=True)
    once = hidden.grad.clone()
    loss.backward()
    torch.testing.assert_close(hidden.grad, 2 * once)
