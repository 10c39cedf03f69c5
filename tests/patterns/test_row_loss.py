"""The chunked linear + row-wise loss through torch.compile: a head whose logits reach the loss
only through math on each row and sums over the rows joins the loss in
`seqfast::linear_row_loss`, whatever the loss (z-loss, soft cap, label smoothing, masked classes,
class weights, KL / JSD / cross-entropy against a teacher's logits), matches eager on both paths,
and keeps no logits-sized tensor; what cannot be chunked says why."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion, dumped_fuse_stage
from conftest import KERNELS_IN_SLOW_TIER
from torch import nn

from seqcompile.memory.live_bytes import measure_step
from seqcompile.memory.saved import saved_bytes
from seqcompile.ops.linear_row_loss import samples as losses
from seqcompile.patterns.loss.row_loss import program_of_function
from seqcompile.patterns.loss.row_ops import NotRowWise
from seqcompile.report import collecting

VOCAB, WIDTH, BATCH, LENGTH = 53, 16, 2, 5
IGNORE = -100


class Head(nn.Module):
    """A trunk layer, then a head whose logits go to `loss(logits, *others)`."""

    def __init__(self, loss, vocab=VOCAB, bias=False):
        super().__init__()
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, vocab, bias=bias)
        self.loss = loss

    def forward(self, x, *others):
        return self.loss(self.head(torch.tanh(self.trunk(x))), *others)


def targets(vocab=VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(vocab, (BATCH, LENGTH), generator=g)
    t[0, 1] = t[1, 3] = IGNORE
    return t


def teacher(vocab=VOCAB, seed=1):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(BATCH, LENGTH, vocab, generator=g)


def flat(fn):
    """`fn` over (rows, classes) logits and row-flattened others."""

    def loss(logits, *others):
        return fn(logits.flatten(0, 1), *(o.flatten(0, 1) if o.dim() > 1 else o for o in others))

    return loss


def z_loss_by_hand(logits, t):
    ce = F.cross_entropy(logits.transpose(1, 2), t, ignore_index=IGNORE)
    return ce + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()


def smoothed_with_z_loss(logits, t):
    ce = F.cross_entropy(logits.flatten(0, 1).float(), t.flatten(), label_smoothing=0.1)
    return ce + 1e-3 * torch.logsumexp(logits.float(), -1).square().mean()


def weighted(logits, t):
    weights = torch.linspace(0.5, 1.5, logits.shape[-1])
    return F.cross_entropy(logits.flatten(0, 1), t.flatten(), weight=weights, ignore_index=IGNORE)


def per_token_summed(logits, t):
    """A per-token loss summed afterwards and divided by a count, as chunked training code does."""
    rows = F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="none")
    return rows.sum() / (t != IGNORE).sum().clamp(min=1)


def masked(logits, t):
    allowed = torch.arange(logits.shape[-1]) % 3 != 1
    return losses.masked_classes(logits.flatten(0, 1), t.flatten().remainder(3) * 3, allowed)


def ce_to_teacher(logits, teacher_logits):
    return F.cross_entropy(logits.flatten(0, 1), F.softmax(teacher_logits.flatten(0, 1), -1))


ROW_LOSSES = {
    "z-loss": (flat(losses.ce_z_loss), targets),
    "z-loss-by-hand": (z_loss_by_hand, targets),
    "soft-cap": (flat(losses.soft_capped), targets),
    "smoothed-z-loss": (smoothed_with_z_loss, targets),
    "class-weights": (weighted, targets),
    "per-token-summed": (per_token_summed, targets),
    "masked-classes": (masked, targets),
    "kl-teacher": (flat(losses.kl_to_teacher), teacher),
    "jsd-teacher": (flat(losses.jsd_to_teacher), teacher),
    "ce-teacher": (ce_to_teacher, teacher),
}


def row_loss_sites(report):
    return [site for site in report.sites if "linear_row_loss" in site]


DEFAULT_TIER = {"z-loss-by-hand"}
"""The losses the default run takes (the others, and every kernel path, in the slow tier)."""


@pytest.mark.parametrize(
    "name",
    [
        n if n in DEFAULT_TIER else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(ROW_LOSSES)
    ],
)
@KERNELS_IN_SLOW_TIER
@pytest.mark.kernels("pointwise")  # the trunk's tanh; the loss's chunks launch none
def test_each_row_wise_loss_joins_its_linear(impl, name):
    loss, other = ROW_LOSSES[name]
    torch.manual_seed(0)
    x = torch.randn(BATCH, LENGTH, WIDTH, requires_grad=True)
    report = check_fusion(Head(loss, bias=True), [x, other()], counts={"loss": 1})
    assert len(row_loss_sites(report)) == 1, report.sites


@pytest.mark.parametrize("chunk", [pytest.param(c, marks=pytest.mark.slow) for c in (1, 3, 0)])
def test_chunks_of_any_size_give_the_same_loss(chunk):
    torch.manual_seed(0)
    x = torch.randn(BATCH, LENGTH, WIDTH, requires_grad=True)
    report = check_fusion(
        Head(flat(losses.ce_z_loss)), [x, targets()], counts={"loss": 1},
        options={"loss_chunk": chunk},
    )  # fmt: skip
    assert len(row_loss_sites(report)) == 1, report.sites


def test_an_empty_batch_gives_eagers_nan_and_zero_gradients():
    torch.manual_seed(0)
    model = Head(flat(losses.ce_z_loss))
    x = torch.randn(0, LENGTH, WIDTH)
    with collecting() as report:
        loss = torch.compile(model, backend="seqfast")(x, targets()[:0])
        loss.backward()
    assert row_loss_sites(report)
    assert loss.isnan() and model(x, targets()[:0]).isnan()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def squared(logits, t):
    """One sum over the rows times itself (normalize writes it as a square). (A cross-entropy
    alone, squared, joins its linear with the kernel: the square is of a scalar it returns.)"""
    loss = losses.ce_z_loss(logits.flatten(0, 1), t.flatten())
    return loss * loss


NOT_ROW_WISE = {
    "max over rows": (
        lambda z, t: F.cross_entropy(z.flatten(0, 1), t.flatten()) + z.amax(),
        "amax",
    ),
    "product of sums": (
        lambda z, t: F.cross_entropy(z.flatten(0, 1), t.flatten()) * z.logsumexp(-1).mean(),
        "mul.Tensor of a sum over the rows is not linear",
    ),
    "square of a sum": (squared, "pow.Tensor_Scalar of a sum over the rows is not linear"),
    "rows mixed": (
        lambda z, t: F.cross_entropy(z.flatten(0, 1), t.flatten()) + z.softmax(0).sum(),
        "_softmax",
    ),
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) for n in sorted(NOT_ROW_WISE)],
)  # fmt: skip
def test_a_loss_that_is_not_row_wise_is_built_whole_and_says_which_op(name):
    loss, reason = NOT_ROW_WISE[name]
    torch.manual_seed(0)
    x = torch.randn(BATCH, LENGTH, WIDTH, requires_grad=True)
    report = check_fusion(
        Head(loss), [x, targets(seed=2).clamp(min=0)], counts={"loss": 1},
        missed=[reason],
    )  # fmt: skip
    assert not row_loss_sites(report)
    assert any("is not chunked" in m.reason for m in report.missed)


def test_a_sum_times_itself_is_not_read_as_affine():
    """`ce * ce` reads one node twice: the reading counts operands, not nodes (read as affine, its
    gradient would be the one at no loss, zero)."""
    logits, t = torch.zeros(1, 5, VOCAB), torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(NotRowWise, match="mul.Tensor of a sum over the rows is not linear"):
        program_of_function(squared, logits, [t])


def chunked_logits_loss(h, w, t):
    """A loss summed over chunks of the logits, as memory-saving training code writes it."""
    logits = h @ w.T
    chunks = zip(logits.split(4), t.split(4), strict=True)
    return sum(F.cross_entropy(c, tc, reduction="sum") for c, tc in chunks) / t.numel()


@KERNELS_IN_SLOW_TIER
@pytest.mark.kernels(
    "cross_entropy:forward", "cross_entropy:backward", "pointwise:forward", "pointwise:backward"
)
def test_a_loss_over_chunks_of_the_logits_fuses_each_chunk_and_says_why_not_whole(impl):
    """`split` gives a list, which the row-wise reading refuses by name (it read the list's
    shape, and failed the compile); each chunk's cross-entropy fuses, and the sum after them."""
    torch.manual_seed(0)
    h, w = torch.randn(10, WIDTH, requires_grad=True), torch.randn(VOCAB, WIDTH, requires_grad=True)
    t = torch.randint(VOCAB, (10,))
    report = check_fusion(
        chunked_logits_loss, [h, w, t], counts={"loss": 3, "pointwise": 1},
        missed=["split_with_sizes.default gives 3 values, not one tensor"],
    )  # fmt: skip
    assert not row_loss_sites(report)
    assert all(m.site.startswith("matmul") and m.pattern == "loss" for m in report.missed)


@pytest.mark.slow
def test_a_teacher_that_learns_through_the_loss_is_not_chunked_and_says_why():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.student, self.teacher = nn.Linear(WIDTH, VOCAB), nn.Linear(WIDTH, VOCAB)

        def forward(self, x):
            return losses.kl_to_teacher(self.student(x), self.teacher(x))

    report = check_fusion(
        TwoHeads(), [torch.randn(7, WIDTH)], counts={"loss": 0},
        missed=["which needs a gradient", "which needs a gradient"],
    )  # fmt: skip
    assert not row_loss_sites(report)


@pytest.mark.slow
def test_int32_targets_stay_with_eager_which_refuses_them():
    torch.manual_seed(0)
    model = Head(flat(losses.ce_z_loss))
    x = torch.randn(BATCH, LENGTH, WIDTH)
    with collecting() as report, pytest.raises(RuntimeError, match="Long or Byte"):
        torch.compile(model, backend="seqfast")(x, targets().clamp(min=0).int())
    assert not row_loss_sites(report)
    assert any("torch.int32" in m.reason for m in report.missed)


BIG_VOCAB, ROWS, CHUNK = 32_000, 256, 16
BIG = {
    "z-loss": (flat(losses.ce_z_loss), lambda: torch.randint(BIG_VOCAB, (1, ROWS))),
    "soft-cap": (flat(losses.soft_capped), lambda: torch.randint(BIG_VOCAB, (1, ROWS))),
    "kl-teacher": (flat(losses.kl_to_teacher), lambda: torch.randn(1, ROWS, BIG_VOCAB)),
}


@pytest.mark.parametrize(
    "name", [n if n == "z-loss" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(BIG)]
)
def test_a_32k_vocabulary_keeps_and_holds_no_logits(name):
    """At vocabulary 32k the compiled step saves nothing of the logits' size (saved-tensor hooks),
    and the memory model holds at most a few chunks of them at once, where eager holds them
    all (live bytes measured op by op). A teacher's logits are an input: what the loss computes
    from them is computed a chunk at a time too."""
    torch.manual_seed(0)
    loss, other = BIG[name]
    model = Head(loss, vocab=BIG_VOCAB)
    x = torch.randn(1, ROWS, WIDTH, requires_grad=True)
    t = other()
    with collecting() as report:
        compiled = torch.compile(model, backend="seqfast", options={"loss_chunk": CHUNK})
        compiled(x, t).backward()  # compile outside the hooks: tracing saves too
    assert len(row_loss_sites(report)) == 1
    logits_bytes, chunk_bytes = ROWS * BIG_VOCAB * 4, CHUNK * BIG_VOCAB * 4
    weight_bytes = BIG_VOCAB * WIDTH * 4
    lasting = [*model.parameters(), x, t]
    saved = saved_bytes(lambda: compiled(x, t), lasting)
    assert saved <= weight_bytes + 4 * ROWS * WIDTH * 4  # the finished gradients, no logits
    (plan,) = report.memory
    assert all(torch.Size(s).numel() < ROWS * BIG_VOCAB for s in plan.step.kept_shapes)
    # a weight gradient, its float32 sum and a few chunks of logits: never all of them
    assert plan.step.peak_bytes < 3 * weight_bytes + 8 * chunk_bytes < logits_bytes
    assert measure_step(lambda: model(x, t), lasting).peak > logits_bytes


class Distillation(nn.Module):
    """A student learning from a frozen teacher's head, the teacher run under no_grad or with
    parameters that need no gradient."""

    def __init__(self, loss, vocab=VOCAB, no_grad=True):
        super().__init__()
        self.student, self.teacher = Head(loss, vocab), nn.Linear(WIDTH, vocab)
        self.teacher.requires_grad_(no_grad)
        self.no_grad = no_grad

    def forward(self, x):
        if self.no_grad:
            with torch.no_grad():
                teacher_logits = self.teacher(x)
        else:
            teacher_logits = self.teacher(x.detach()).detach()
        return self.student(x, teacher_logits)


@pytest.mark.slow
@pytest.mark.parametrize("no_grad", [True, False])
@pytest.mark.parametrize(
    "name",
    [
        "kl-teacher",
        *(pytest.param(n, marks=pytest.mark.slow) for n in ("jsd-teacher", "ce-teacher")),
    ],
)
def test_a_teachers_head_is_chunked_with_the_students(name, no_grad, tmp_path):
    torch.manual_seed(0)
    model = Distillation(ROW_LOSSES[name][0], no_grad=no_grad)
    x = torch.randn(BATCH, LENGTH, WIDTH, requires_grad=True)
    report = check_fusion(model, [x], counts={"loss": 1}, options={"dump_dir": str(tmp_path)})
    assert len(row_loss_sites(report)) == 1, report.sites
    # the student's trunk is the one linear left: both heads are inside the fused loss
    assert dumped_fuse_stage(tmp_path).count("aten.linear.default(") == 1


@pytest.mark.slow
def test_a_teachers_head_at_32k_is_never_built_whole():
    torch.manual_seed(0)
    model = Distillation(flat(losses.kl_to_teacher), vocab=BIG_VOCAB)
    x = torch.randn(1, ROWS, WIDTH, requires_grad=True)
    with collecting() as report:
        torch.compile(model, backend="seqfast", options={"loss_chunk": CHUNK})(x).backward()
    assert len(row_loss_sites(report)) == 1
    (plan,) = report.memory
    chunk_bytes, weight_bytes = CHUNK * BIG_VOCAB * 4, BIG_VOCAB * WIDTH * 4
    assert plan.step.peak_bytes < 3 * weight_bytes + 8 * chunk_bytes < ROWS * BIG_VOCAB * 4
