"""Sample inputs of `seqfast::linear_row_loss`: programs read from losses written as plain
functions of the logits (cross-entropy with a z-loss, soft-capped logits, masked classes, KL and
JSD against a teacher's logits); rows 0, 1 and odd, classes 0 and 1, chunks that do not divide
the rows, every target ignored, and a NaN in the hidden states. The answer is the program's row
math over all the logits at once, differentiated by autograd: what the chunks, the traced
gradient and the loss's weights must reproduce. (That the program is the function it was read
from is the loss pattern's tests' to show, against the functions run eagerly.)"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from seqcompile.ops.linear_row_loss import program as row_loss
from seqcompile.ops.samples import Sample, generator, randn

Tensor = torch.Tensor
IGNORE = -100
ROWS, CLASSES, FEATURES = 7, 37, 9


def ce_z_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy plus a z-loss on the log-partition, as PaLM trains."""
    lse = torch.logsumexp(logits.float(), -1)
    z_loss = 1e-4 * (lse**2 * (target != IGNORE)).sum() / (target != IGNORE).sum()
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE) + z_loss


def soft_capped(logits: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of tanh-capped logits, summed, as Gemma 2 caps its head."""
    capped = 30.0 * torch.tanh(logits / 30.0)
    return F.cross_entropy(capped, target, ignore_index=IGNORE, reduction="sum")


def masked_classes(logits: Tensor, target: Tensor, allowed: Tensor) -> Tensor:
    """Cross-entropy over the allowed classes only."""
    kept = logits.masked_fill(~allowed, -math.inf)
    return F.cross_entropy(kept, target, ignore_index=IGNORE)


def kl_to_teacher(logits: Tensor, teacher: Tensor) -> Tensor:
    """KL(teacher || student) at temperature 2, per row, scaled back by T^2."""
    t = 2.0
    student, target = F.log_softmax(logits / t, -1), F.log_softmax(teacher / t, -1)
    return F.kl_div(student, target, log_target=True, reduction="batchmean") * t * t


def jsd_to_teacher(logits: Tensor, teacher: Tensor) -> Tensor:
    """Jensen-Shannon divergence between the student's and the teacher's distributions."""
    p, q = F.softmax(logits, -1), F.softmax(teacher, -1)
    m = (0.5 * (p + q)).log()
    kl_p = F.kl_div(m, p, reduction="sum")
    kl_q = F.kl_div(m, q, reduction="sum")
    return 0.5 * (kl_p + kl_q) / logits.shape[0]


def _targets(g, rows: int, classes: int) -> Tensor:
    target = torch.randint(0, max(classes, 1), (rows,), generator=g)
    target[1:4:2] = IGNORE
    return target


def _others(name: str, g, rows: int, classes: int) -> list[Tensor]:
    if name in ("kl", "jsd"):
        return [randn(g, rows, classes, scale=2.0)]
    if name == "masked":
        allowed = torch.rand(classes, generator=g) > 0.3
        target = _targets(g, rows, classes)
        target[target >= 0] = allowed.nonzero()[0, 0]  # an allowed class
        return [target, allowed]
    return [_targets(g, rows, classes)]


FUNCTIONS: dict[str, Callable[..., Tensor]] = {
    "z-loss": ce_z_loss,
    "soft-cap": soft_capped,
    "masked": masked_classes,
    "kl": kl_to_teacher,
    "jsd": jsd_to_teacher,
}


def _eager(program_key: str):
    """The loss computed whole: the program's row math over every row at once (no chunks, no
    traced gradient: autograd differentiates it), then its final step."""

    def eager(hidden, weight, bias, rows, consts, post, **_) -> tuple[Tensor]:
        program = row_loss.lookup(program_key)
        terms = program.rows(F.linear(hidden, weight, bias), *rows, *consts).double()
        return (program.post(terms, *post),)

    return eager


def _sample(
    name: str, fn_name: str, g, rows: int = ROWS, classes: int = CLASSES, chunk: int = 3, edit=None
) -> Sample:
    from seqcompile.patterns.loss.row_loss import program_of_function  # (patterns import ops)

    fn = FUNCTIONS[fn_name]
    hidden, weight = randn(g, rows, FEATURES), randn(g, classes, FEATURES, scale=0.5)
    bias = randn(g, classes)
    others = _others(fn_name, g, rows, classes)
    if edit is not None:
        edit(hidden, others)
    logits = torch.zeros(rows, classes)
    program, row_inputs, consts, post = program_of_function(fn, logits, others)
    args = dict(
        hidden=hidden, weight=weight, bias=bias, rows=row_inputs, consts=consts, post=post,
        program=program.key, chunk=chunk, compute_dtype=torch.float32,
        needs_grad=[True, True, True],
    )  # fmt: skip
    return Sample(name, args, _eager(program.key), grads=("hidden", "weight", "bias"))


def _all_ignored(hidden: Tensor, others: list[Tensor]) -> None:
    others[0].fill_(IGNORE)


def _nan_row(hidden: Tensor, others: list[Tensor]) -> None:
    hidden[2, 1] = math.nan


def samples() -> Iterator[Sample]:
    """The base samples, every tensor contiguous."""
    g = generator(5)
    for fn_name in FUNCTIONS:
        yield _sample(fn_name, fn_name, g)
    yield _sample("z-loss-one-chunk", "z-loss", g, chunk=0)
    yield _sample("kl-rows1", "kl", g, rows=1)
    yield _sample("z-loss-rows0", "z-loss", g, rows=0)
    yield _sample("z-loss-classes1", "z-loss", g, classes=1)
    yield _sample("kl-classes0", "kl", g, classes=0)
    yield _sample("z-loss-all-ignored", "z-loss", g, edit=_all_ignored)
    yield _sample("soft-cap-nan-hidden", "soft-cap", g, edit=_nan_row)
