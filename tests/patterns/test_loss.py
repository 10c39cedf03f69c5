"""The loss family through torch.compile: every spelling of cross-entropy becomes one fused loss,
a linear feeding it joins it when nothing else reads the logits (and says why not otherwise), and
the backward keeps no vocabulary-sized tensor."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion, kept_for_backward
from torch import nn

from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.options import OptionError
from seqcompile.report import collecting

VOCAB, ROWS, WIDTH = 97, 12, 16


def logits_and_targets(vocab=VOCAB, rows=ROWS, seed=0, pad=None):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, vocab, generator=g)).requires_grad_()
    target = torch.randint(vocab, (rows,), generator=g)
    if pad is not None:
        target[[1, rows - 1]] = pad
    return logits, target


def modes(report):
    """Which cross-entropy kernels a compile prepared."""
    return sorted(dict(k.key)["mode"] for k in report.kernels if k.template == "cross_entropy")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_options(reduction, smoothing):
    def loss(x, t):
        return F.cross_entropy(
            x, t, ignore_index=-100, label_smoothing=smoothing, reduction=reduction
        )

    report = check_fusion(loss, logits_and_targets(pad=-100), counts={"loss": 1})
    assert modes(report) == ["backward", "forward"]


def test_module_spelling_and_a_large_vocabulary():
    criterion = nn.CrossEntropyLoss(ignore_index=0)
    check_fusion(criterion, logits_and_targets(vocab=50257, rows=3, pad=0), counts={"loss": 1})


def test_log_softmax_then_nll_loss():
    def loss(x, t):
        return F.nll_loss(F.log_softmax(x.float(), dim=-1), t, ignore_index=3, reduction="sum")

    check_fusion(loss, logits_and_targets(pad=3), counts={"loss": 1})


def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index):
    """fairseq's (and LightSeq's) label-smoothed loss, as they write it."""
    target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    pad_mask = target.eq(ignore_index)
    nll_loss = nll_loss.masked_fill(pad_mask, 0.0)
    smooth_loss = smooth_loss.masked_fill(pad_mask, 0.0)
    nll_loss, smooth_loss = nll_loss.sum(), smooth_loss.sum()
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


def test_fairseq_label_smoothed_loss_and_its_logged_nll():
    def loss(x, t):
        return label_smoothed_nll_loss(F.log_softmax(x, dim=-1), t, 0.1, ignore_index=1)

    # the nll it also returns (for logging) becomes a second loss without smoothing
    check_fusion(loss, logits_and_targets(pad=1), counts={"loss": 2})


def test_class_weights_are_refused_with_the_reason():
    weights = torch.rand(VOCAB) + 0.5

    def loss(x, t):
        return F.cross_entropy(x, t, weight=weights)

    check_fusion(loss, logits_and_targets(), counts={"loss": 0}, missed=["class weights"])


class Head(nn.Module):
    """An LM head and its loss, optionally returning the logits too."""

    def __init__(self, bias=False, return_logits=False, transposed=False):
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB, bias=bias)
        self.return_logits, self.transposed = return_logits, transposed

    def forward(self, hidden, target):
        if self.transposed:
            logits = hidden @ self.proj.weight.t()
        else:
            logits = self.proj(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        return (loss, logits) if self.return_logits else loss


def head_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 6, WIDTH, generator=g).requires_grad_()
    target = torch.randint(VOCAB, (2, 6), generator=g)
    target[0, 0] = -100
    return [hidden, target]


@pytest.mark.parametrize(("bias", "transposed"), [(False, False), (True, False), (False, True)])
def test_a_linear_feeding_the_loss_joins_it(bias, transposed):
    torch.manual_seed(0)
    head = Head(bias=bias, transposed=transposed)
    report = check_fusion(head, head_inputs(), counts={"loss": 1}, options={"loss_chunk": 5})
    assert modes(report) == ["forward_grad"]


def test_an_upcast_before_the_reshape_is_absorbed_too():
    """Hugging Face's order on a bf16 model: `logits.float()`, then `view(-1, vocab)`."""
    torch.manual_seed(0)
    proj = nn.Linear(WIDTH, VOCAB).to(torch.bfloat16)

    def loss(hidden, target):
        return F.cross_entropy(proj(hidden).float().view(-1, VOCAB), target.view(-1))

    hidden, target = head_inputs()
    hidden = hidden.detach().to(torch.bfloat16).requires_grad_()
    with collecting() as report:
        got = torch.compile(loss, backend="seqfast")(hidden, target)
    assert modes(report) == ["forward_grad"], str(report)
    torch.testing.assert_close(got, loss(hidden, target))


def test_logits_read_elsewhere_are_built_and_the_report_says_why():
    torch.manual_seed(0)
    report = check_fusion(
        Head(return_logits=True), head_inputs(), counts={"loss": 1}, missed=["read elsewhere"]
    )
    assert modes(report) == ["backward", "forward"]


class AutocastHead(Head):
    """The head computed in an autocast region inside the compiled code, the loss outside it."""

    def __init__(self, dtype, return_logits=False):
        super().__init__(bias=True, return_logits=return_logits)
        self.dtype = dtype

    def forward(self, hidden, target):
        with torch.autocast("cpu", dtype=self.dtype):
            logits = self.proj(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100)
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_linear_joins_under_autocast_in_its_dtype(dtype, tmp_path):
    torch.manual_seed(0)
    report = check_fusion(
        AutocastHead(dtype),
        head_inputs(),
        counts={"loss": 1},
        options={"dump_dir": str(tmp_path)},
        dtype=dtype,
    )
    assert modes(report) == ["forward_grad"]
    forward = next(tmp_path.glob("*/*_lower_forward.py")).read_text()
    (call,) = [line for line in forward.splitlines() if "seqfast.linear_cross_entropy" in line]
    assert str(dtype) in call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_logits_from_autocast_that_are_returned_fuse_the_loss_alone(dtype):
    report = check_fusion(
        AutocastHead(dtype, return_logits=True),
        head_inputs(),
        counts={"loss": 1},
        missed=["read elsewhere"],
        dtype=dtype,
    )
    assert modes(report) == ["backward", "forward"]


def test_a_grad_mode_switch_between_the_linear_and_the_loss_keeps_them_apart():
    head = Head()

    def loss(hidden, target):
        logits = head.proj(hidden)
        with torch.no_grad():
            weight = hidden.detach().norm()
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100) * weight

    report = check_fusion(loss, head_inputs(), counts={"loss": 1}, missed=["grad mode"])
    assert modes(report) == ["backward", "forward"]


def test_a_bad_chunk_option_is_a_clear_error():
    with pytest.raises(OptionError, match="loss_chunk"):
        torch.compile(Head(), backend="seqfast", options={"loss_chunk": -1})(*head_inputs())


CONFIG = GPTConfig(vocab=256, max_len=16, d_model=32, n_heads=2, n_layers=1, dropout=0.0)


class Trunk(GPT):
    """The same model with a loss that keeps nothing: what the rest of the model keeps."""

    def forward(self, idx, targets):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return (self.ln_f(x) * self.fixed).sum()


def test_gpt_with_a_tied_head_fuses_its_loss_and_keeps_no_logits():
    torch.manual_seed(0)
    batch = toy_batch(CONFIG, 2, 16, "cpu", torch.Generator().manual_seed(0))
    model = GPT(CONFIG).train()
    check_fusion(model, batch, counts={"loss": 1}, grad=True)

    tokens, width = batch[0].numel(), CONFIG.d_model
    trunk = Trunk(CONFIG).train()
    trunk.register_buffer("fixed", torch.randn(width))
    compiled, compiled_trunk = (
        torch.compile(model, backend="seqfast"),
        torch.compile(trunk, backend="seqfast"),
    )
    compiled(*batch).backward()  # compile outside the hooks: tracing saves too
    compiled_trunk(*batch).backward()
    by_loss = kept_for_backward(compiled, *batch) - kept_for_backward(compiled_trunk, *batch)
    # the loss keeps its finished gradients: the head input's (in place of the head input itself,
    # which an unfused head keeps for its weight gradient) and the tied weight's
    assert by_loss == 4 * (tokens * width + CONFIG.vocab * width)
    eager = kept_for_backward(model, *batch) - kept_for_backward(trunk, *batch)
    assert eager >= 4 * tokens * (CONFIG.vocab + width)  # the log-probabilities and the head input
