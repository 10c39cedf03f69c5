"""Real models through seqfast, small and randomly initialized on CPU: each fused family finds as
many sites as the model's code has, nothing is refused, and a training step's loss and every
parameter gradient equal eager's. The default run takes one attention implementation of most
models; the slow tier takes the rest."""

import pytest
import torch
from conftest import TOLERANCES

from models.real_models import CASES, Case
from seqcompile.report import collecting

pytestmark = pytest.mark.slow  # whole models: the real-model tier

pytest.importorskip("transformers")

GRADIENT_RTOL = TOLERANCES[torch.float32]["rtol"]
GRADIENT_ATOL = 1e-5
"""Of the model's gradient scale (its largest gradient element): some gradients are zero in
exact arithmetic (a key projection's bias under softmax) and equal only up to rounding noise
of that scale."""


def params() -> list:
    found = []
    for case in CASES:
        for k, implementation in enumerate(case.implementations):
            # other implementations and the slowest models: half of them per run, in turn
            marks = [pytest.mark.slow, pytest.mark.rotating(2)] if k or case.slow else []
            found.append(
                pytest.param(case, implementation, id=f"{case.name}-{implementation}", marks=marks)
            )
    return found


def step(case: Case, implementation: str, compiled: bool):
    """A fresh model (same seed, same weights either way) and the loss of one step after its
    backward, with the compile report when `compiled`."""
    torch.manual_seed(0)
    model = case.build(implementation).train()
    run = torch.compile(model, backend="seqfast") if compiled else model
    with collecting() as report:
        loss = case.loss(run(**case.batch()))
        loss.backward()
    return model, loss, report


def assert_gradients_match(fast: torch.nn.Module, eager: torch.nn.Module) -> None:
    named = list(eager.named_parameters())
    scale = max(p.grad.abs().max() for _, p in named if p.grad is not None)
    for (name, p_fast), (_, p_eager) in zip(fast.named_parameters(), named, strict=True):
        if p_eager.grad is None:
            # a compiled graph's backward gives zeros for the outputs the loss does not read
            # (BERT's pooler), where eager leaves the gradient out
            assert p_fast.grad is None or not p_fast.grad.any(), f"{name}: a gradient eager lacks"
            continue
        assert p_fast.grad is not None, f"{name} has no gradient when compiled"
        torch.testing.assert_close(
            p_fast.grad, p_eager.grad, rtol=GRADIENT_RTOL, atol=GRADIENT_ATOL * scale, msg=name
        )


@pytest.mark.parametrize("case, implementation", params())
def test_every_site_fuses_and_the_step_matches_eager(case: Case, implementation: str):
    eager, expected, _ = step(case, implementation, compiled=False)
    fast, loss, report = step(case, implementation, compiled=True)

    fused = {family: report.counts[family] for family in case.sites}
    assert fused == case.sites, f"fused {fused}, expected {case.sites}\n{report}"
    assert report.counts["pointwise"] >= case.activations, f"too few pointwise regions\n{report}"
    reasons = [m.reason for m in report.missed]
    for needle in case.missed:
        assert any(needle in r for r in reasons), f"no refusal mentions {needle!r}\n{report}"
    assert len(reasons) == len(case.missed), f"unexpected refusals\n{report}"
    torch.testing.assert_close(loss, expected, **TOLERANCES[torch.float32])
    assert_gradients_match(fast, eager)
