"""Under the eager executor on CUDA a fused call runs its traced launches as a plan
(`lower/planned_launches.py`): each launch a direct `kernel[grid](...)` into the buffers the trace
allocated, the views that only reach a kernel dropped. Checked on CPU under the interpreter, where
the route is forced: the plan runs what the traced launches run, launch for launch and bit for
bit."""

import operator

import pytest
import torch

import seqcompile.lower as lower
from seqcompile import report
from seqcompile.lower.executor import Executor
from seqcompile.lower.planned_launches import Launch, launches_planned
from seqcompile.ops.registry import entry_of
from tests.lower.eager_steps import eager_step

TRACED = torch.ops.higher_order.triton_kernel_wrapper_functional


@pytest.mark.parametrize(
    ("device", "executor", "planned"),
    [("cuda", "eager", True), ("cuda", "inductor", False), ("cpu", "eager", False)],
)
def test_where_launches_are_planned(device, executor, planned):
    assert launches_planned(torch.device(device), executor) is planned


@pytest.mark.slow  # two GPT steps compiled under the interpreter
@pytest.mark.kernels("attention_fwd", "add_norm_fwd", "add_norm_bwd", "pointwise:forward")
def test_a_plan_runs_what_the_traced_launches_run(interpret, monkeypatch):
    step = eager_step(monkeypatch, "planned")
    reasons = {use.reason.rsplit("; ", 1)[-1] for use in step.seen.implementations}
    assert "launched from its plan" in reasons, reasons
    given = step.given
    launches = [n for gm in given for n in gm.graph.nodes if isinstance(n.target, Launch)]
    assert launches, "the plans' launches are in the graphs the executor runs"
    for gm in given:
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert TRACED not in targets
        fused = {entry_of(t).name for t in targets if entry_of(t) is not None}
        assert fused <= {"linear_cross_entropy"}, fused  # (its host check of the targets)
    for launch in launches:  # the views that only reach a kernel are gone
        tensors = launch.args[1].values()
        assert not any(getattr(t, "target", None) == torch.ops.aten.expand.default for t in tensors)
    with monkeypatch.context() as traced:
        want = eager_step(traced, "traced")
    assert step.launched == want.launched
    assert torch.equal(step.loss, want.loss)
    for got, expected in zip(step.grads, want.grads, strict=True):
        assert torch.equal(got, expected)


def _reshapes_a_launch_output(node) -> bool:
    viewed = node.args[0] if node.target is torch.ops.aten.view.default else None
    return getattr(viewed, "target", None) is operator.getitem and isinstance(
        viewed.args[0].target, Launch
    )


def _force_plans(monkeypatch) -> None:
    monkeypatch.setattr(lower, "launches_inlined", lambda device, executor: False)
    monkeypatch.setattr(lower, "launches_planned", lambda device, executor: True)


@pytest.mark.kernels("add_norm_fwd", "add_norm_bwd")
def test_a_norm_runs_from_its_plan(interpret, monkeypatch):
    _force_plans(monkeypatch)
    given = []
    compile_graph = Executor.compile

    def spy(self, gm, example_inputs, kind):
        given.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        reshaped = [n for n in gm.graph.nodes if _reshapes_a_launch_output(n)]
        assert not reshaped, "its buffer is allocated as the output is read"
        return compile_graph(self, gm, example_inputs, kind)

    monkeypatch.setattr(Executor, "compile", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="seqfast", options={"rest": "eager"})
    with report.collecting() as seen:
        out = compiled(x)
        out.square().sum().backward()
    torch._dynamo.reset()
    grads = [p.grad.clone() for p in model.parameters()]
    reasons = {use.direction: use.reason for use in seen.implementations if use.op == "add_norm"}
    assert all(r.endswith("launched from its plan") for r in reasons.values()), reasons
    assert len(given) == 2 and all(any(isinstance(t, Launch) for t in g) for g in given)
    assert not any(entry_of(t) or t is TRACED for g in given for t in g)
    model.zero_grad()
    want = model(x)
    want.square().sum().backward()
    torch.testing.assert_close(out, want)
    for got, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad)


class _Kernel:
    """Stands for a kernel: records each launch's grid and arguments, writes ones into OUT."""

    def __init__(self) -> None:
        self.launches = []

    def __getitem__(self, grid):
        def launch(**arguments):
            self.launches.append((grid, arguments))
            arguments["OUT"].fill_(1.0)

        return launch


def test_a_launch_copies_a_written_tensor_only_where_it_shares_the_calls_memory():
    kernel = _Kernel()
    given = torch.zeros(4)
    fresh = Launch(kernel, {"BLOCK": 4}, ["OUT"], copied=set())
    out = fresh((2, 1, 1), {"OUT": given, "N": 4})["OUT"]
    assert out is given and bool(given.eq(1).all())
    assert kernel.launches == [((2, 1, 1), {"OUT": given, "N": 4, "BLOCK": 4})]
    argument = torch.zeros(4)
    guarded = Launch(kernel, {}, ["OUT"], copied={"OUT"})
    out = guarded((1, 1, 1), {"OUT": argument})["OUT"]
    assert out is not argument and bool(out.eq(1).all()) and bool(argument.eq(0).all())
    assert operator.getitem(guarded((1,), {"OUT": argument}), "OUT").sum() == 4
