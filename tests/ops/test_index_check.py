"""An out-of-range class index is eager's IndexError on every path, never a crash: the reference,
the kernels, and Inductor's compiled code on CPU, whose own index check inside its loop ends the
process. Each loss the family fuses is checked: the cross-entropy, the linear joined to it, and a
row-wise loss (a z-loss) whose program gathers by the targets."""

import pytest
import torch
import torch.nn.functional as F

from seqcompile.ops.index_check import checked_index

VOCAB = 40


def cross_entropy(h, w, t):
    return F.cross_entropy((h @ w.T) * 2.0, t, reduction="sum")


def linear_cross_entropy(h, w, t):
    return F.cross_entropy(h @ w.T, t)


def z_loss(h, w, t):
    logits = h @ w.T
    return F.cross_entropy(logits, t) + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()


LOSSES = {"cross_entropy": cross_entropy, "linear": linear_cross_entropy, "z_loss": z_loss}


def inputs(bad: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.randn(VOCAB, 8, generator=g, requires_grad=True)
    t = torch.randint(VOCAB, (6,), generator=g)
    t[4] = bad
    return h, w, t


@pytest.mark.parametrize(
    "rest",
    ["eager", pytest.param("inductor", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("loss", LOSSES.values(), ids=LOSSES.keys())
@pytest.mark.parametrize("bad", [VOCAB, -5])
@pytest.mark.kernels()  # refused before any launch
def test_an_out_of_range_target_is_eagers_index_error(impl, rest, loss, bad):
    with pytest.raises(IndexError):
        loss(*inputs(bad))
    compiled = torch.compile(loss, backend="seqfast", options={"rest": rest})
    with pytest.raises(IndexError, match=rf"outside \[0, {VOCAB}\)"):
        compiled(*inputs(bad))


@pytest.mark.kernels()
def test_inductor_checks_on_the_host_before_its_loop(impl):
    """The default run's Inductor case: without the check this ends the process."""
    test_an_out_of_range_target_is_eagers_index_error(impl, "inductor", cross_entropy, VOCAB)


def test_the_check_passes_the_ignored_index_and_the_range_and_copies():
    index = torch.tensor([0, 39, -100, 5])
    checked = checked_index(index, 0, 40, -100, "targets")
    assert torch.equal(checked, index) and checked.data_ptr() != index.data_ptr()
    with pytest.raises(IndexError, match=r"targets: a value is outside \[0, 40\)$"):
        checked_index(index, 0, 40, None, "targets")
