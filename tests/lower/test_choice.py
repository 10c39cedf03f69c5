"""What each fused call runs, chosen with an injected timer (as CUDA would time it): the fastest
candidate that agrees with the reference wins, a tie goes to the kernel, a candidate that
disagrees or holds more memory is never chosen and the report says why, the choice is read back
from disk and measured again after a version change, and the option forces one."""

import pytest
import torch
import torch.nn.functional as F
import triton
from conftest import TOLERANCES
from torch import nn

from seqcompile import report
from seqcompile.codegen import counting_launches
from seqcompile.lower import choice, measure
from seqcompile.lower.measure import Measurer
from seqcompile.ops import registry


class Block(nn.Module):
    """A residual + LayerNorm and a pointwise region after a linear: `add_norm` and `pointwise`."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x, residual):
        h = x + residual
        return F.gelu(self.fc(self.norm(h))) * 2 + h


class Timer:
    """Times by candidate name, and the names it was asked to time."""

    def __init__(self, kernel: float, lowering: float, vendor: float = 3.0):
        self.times = {"kernel": kernel, "lowering": lowering, "vendor": vendor}
        self.asked: list[str] = []

    def __call__(self, name, run):
        self.asked.append(name)
        return self.times[name]


def _step(measurer: Measurer | None = None, **options):
    """A compiled step of `Block` (the eager executor unless `options` say), checked against
    eager; the report."""
    torch.manual_seed(0)
    model = Block()
    x, residual = torch.randn(2, 5, 8, requires_grad=True), torch.randn(2, 5, 8)
    want = model(x, residual)
    want.square().sum().backward()
    want_grads = [x.grad, *(p.grad for p in model.parameters())]
    x.grad = None
    model.zero_grad()
    compiled = torch.compile(model, backend="seqfast", options={"rest": "eager", **options})
    with report.collecting() as seen:
        if measurer is None:
            got = compiled(x, residual)
        else:
            with choice.measuring_with(measurer):
                got = compiled(x, residual)
    got.square().sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])
    grads = [x.grad, *(p.grad for p in model.parameters())]
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, **TOLERANCES[torch.float32])
    return seen


def _runs(seen) -> dict[tuple[str, str], tuple[str, str]]:
    return {(u.direction, u.op): (u.implementation, u.reason) for u in seen.implementations}


@pytest.fixture(autouse=True)
def _fresh_results(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQFAST_CACHE_DIR", str(tmp_path))


@pytest.mark.parametrize(
    "rest",
    ["eager", pytest.param("inductor", marks=pytest.mark.slow)],  # Inductor compiles
)
def test_the_fastest_candidate_that_agrees_wins_and_the_report_says_so(rest):
    timer = Timer(kernel=2.0, lowering=1.0)
    seen = _step(Measurer(timer), rest=rest)
    measured = [u for u in seen.implementations if u.reason.startswith("measured:")]
    assert timer.asked.count("lowering") == len(measured), "each lowering as compiled agreed"
    runs = _runs(seen)
    assert set(runs) == {
        (d, op) for d in ("forward", "backward") for op in ("add_norm", "pointwise")
    }
    for implementation, reason in runs.values():
        assert implementation == "lowering"
        assert reason == "measured: kernel 2 ms, lowering 1 ms"
    assert not seen.kernels, "a call that runs its lowering launches no kernel of its own"
    assert "what each fused call runs:" in str(seen)
    assert "add_norm: lowering (measured: kernel 2 ms, lowering 1 ms)" in str(seen)


def test_a_tie_goes_to_the_kernel():
    seen = _step(Measurer(Timer(kernel=1.0, lowering=0.97)))
    assert {run for run, _ in _runs(seen).values()} == {"kernel"}
    assert seen.kernels


def test_a_candidate_that_disagrees_with_the_reference_is_never_chosen(monkeypatch):
    def off_by_one(traced):
        return lambda inputs: [t + 1 for t in measure.run_as_traced(traced)(inputs)]

    monkeypatch.setattr(choice, "run_as_traced", off_by_one)
    timer = Timer(kernel=2.0, lowering=1.0)
    seen = _step(Measurer(timer))
    for implementation, reason in _runs(seen).values():
        assert implementation == "kernel"
        assert "lowering left out: it differs from the reference: output 0 by" in reason
    assert "lowering" not in timer.asked, "a candidate that disagrees is not timed"


def test_a_kernel_that_disagrees_gives_way_to_the_lowering(monkeypatch):
    called = measure._called

    def wrong(node, inputs):
        run = called(node, inputs)
        return lambda: [t * 2 if t.is_floating_point() else t for t in run()]

    monkeypatch.setattr(measure, "_called", wrong)
    seen = _step(Measurer(Timer(kernel=1.0, lowering=2.0)))
    for implementation, reason in _runs(seen).values():
        assert implementation == "lowering"
        assert reason.startswith("measured: lowering 2 ms; kernel left out: it differs")


def test_a_lowering_that_allocates_more_than_the_kernel_is_not_chosen():
    def allocated(name, run):
        return {"kernel": 0, "lowering": 2 * choice.ALLOCATION_SLACK}[name]

    seen = _step(Measurer(Timer(kernel=2.0, lowering=1.0), allocated))
    for implementation, reason in _runs(seen).values():
        assert implementation == "kernel"
        assert f"allocates {2 * choice.ALLOCATION_SLACK} bytes while it runs" in reason


def test_a_choice_is_read_back_and_measured_again_after_a_version_change(monkeypatch):
    _step(Measurer(Timer(kernel=2.0, lowering=1.0)))
    (path,) = (choice.cache_dir() / "implementations").iterdir()
    assert "torch-" in path.name and f"triton-{triton.__version__}" in path.name

    timer = Timer(kernel=1.0, lowering=2.0)  # another answer, were anything timed
    seen = _step(Measurer(timer))
    assert not timer.asked
    for implementation, reason in _runs(seen).values():
        assert (implementation, reason) == (
            "lowering",
            "measured earlier: kernel 2 ms, lowering 1 ms",
        )

    monkeypatch.setattr(triton, "__version__", "0.0.0-other")
    seen = _step(Measurer(timer))
    assert timer.asked
    assert {run for run, _ in _runs(seen).values()} == {"kernel"}


def test_the_option_forces_an_implementation_without_measuring():
    timer = Timer(kernel=2.0, lowering=1.0)
    seen = _step(Measurer(timer), implementations={"pointwise": "kernel", "norm": "lowering"})
    assert not timer.asked
    runs = _runs(seen)
    assert runs["forward", "pointwise"] == ("kernel", "forced by the implementations option")
    assert runs["backward", "add_norm"] == ("lowering", "forced by the implementations option")


def test_a_lowering_that_holds_every_score_is_not_eligible():
    """Attention's lowering holds the (query, key) scores: more than any tensor the call takes."""
    q, k, v = (torch.randn(1, 2, 16, 4, requires_grad=True) for _ in range(3))

    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.5, dim=-1) @ v

    timer = Timer(kernel=2.0, lowering=1.0)
    compiled = torch.compile(attention, backend="seqfast", options={"rest": "eager"})
    with report.collecting() as seen, choice.measuring_with(Measurer(timer)):
        out = compiled(q, k, v)
    torch._dynamo.reset()
    torch.testing.assert_close(out, attention(q, k, v), **TOLERANCES[torch.float32])
    runs = _runs(seen)
    implementation, reason = runs["forward", "attention"]
    assert implementation == "kernel"
    assert reason.startswith("measured: kernel 2 ms, vendor 3 ms; the lowering is not eligible:")
    assert "holds 512 elements where the call's largest tensor has 128" in reason
    assert "lowering" not in timer.asked


def test_the_default_table_names_ops_and_implementations_the_registry_has():
    ops = {str(op.name()): entry for entry in registry.ENTRIES for op in entry.ops}
    for op, (implementation, evidence) in choice.DEFAULT_TABLE.items():
        assert implementation in ops[op].implementations, op
        assert "benchmarks/results/" in evidence, "each row names its measurement"


def test_disagreement_reads_shapes_integers_infinities_and_tolerances():
    f = torch.tensor([1.0, float("inf"), float("nan")])
    assert measure.disagreement(f.clone(), f) is None
    assert measure.disagreement(f * torch.tensor([1.0005, 1, 1]), f) is None
    assert "by 0.01" in measure.disagreement(f + torch.tensor([0.01, 0, 0]), f)
    assert "other infinities" in measure.disagreement(-f, f)
    assert "finite at other elements" in measure.disagreement(f.nan_to_num(), f)
    assert "is torch.float64" in measure.disagreement(f.double(), f)
    assert measure.disagreement(torch.tensor([1, 2]), torch.tensor([1, 3])) == "output 0 differs"
    assert "returns 2 values where the reference returns 1" in measure.disagreement((f, f), f)


@pytest.mark.kernels("add_norm_fwd", "add_norm_bwd", "pointwise:forward", "pointwise:backward")
def test_where_the_executor_launches_the_kernels_their_traced_launches_are_measured(
    interpret, monkeypatch
):
    """The kernel candidate is what would run: its traced launches as the executor runs them, not
    the op called with its Python."""
    called = []
    monkeypatch.setattr(measure, "_called", lambda node, inputs: called.append(node) or None)
    timer = Timer(kernel=1.0, lowering=2.0)
    with counting_launches() as launches:
        seen = _step(Measurer(timer))
    assert not called and timer.asked.count("kernel") == timer.asked.count("lowering") > 0
    for use in seen.implementations:  # (a call like one measured before reads its result)
        assert use.implementation == "kernel"
        assert use.reason.endswith("kernel 1 ms, lowering 2 ms; launched by the executor")
    assert launches.of("add_norm_fwd") >= 2, "measured (checked, then timed) and run"
