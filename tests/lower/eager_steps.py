"""One training step of a seeded GPT with dropout on the eager executor, its fused calls routed
as a test asks: traced launches (the default under the interpreter), planned launches (as on
CUDA), or op calls. Shared by the launch-route tests."""

import dataclasses

import torch
from torch.fx import GraphModule

import seqcompile.lower as lower
from seqcompile import report
from seqcompile.codegen import counting_launches
from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.lower.executor import Executor

CONFIG = GPTConfig(vocab=32, max_len=8, d_model=16, n_heads=2, n_layers=1, dropout=0.1)
ROUTES = ("traced", "planned", "called")


@dataclasses.dataclass
class Step:
    loss: torch.Tensor
    grads: list[torch.Tensor]
    launched: dict[str, int]
    """Launches by kernel."""
    given: list[GraphModule]
    """Each graph the executor was given."""
    seen: report.CompileReport

    def targets(self) -> list[list]:
        """Each given graph's call targets."""
        return [[n.target for n in gm.graph.nodes if n.op == "call_function"] for gm in self.given]


def eager_step(monkeypatch, route: str) -> Step:
    given = []
    compile_graph = Executor.compile

    def spy(self, gm, example_inputs, kind):
        given.append(gm)
        return compile_graph(self, gm, example_inputs, kind)

    monkeypatch.setattr(Executor, "compile", spy)
    if route != "traced":
        monkeypatch.setattr(lower, "launches_inlined", lambda device, executor: False)
    if route == "planned":
        monkeypatch.setattr(lower, "launches_planned", lambda device, executor: True)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    compiled = torch.compile(model, backend="seqfast", options={"rest": "eager"})
    generator = torch.Generator().manual_seed(0)
    with counting_launches() as launches, report.collecting() as seen:
        loss = compiled(*toy_batch(CONFIG, 2, 8, torch.device("cpu"), generator))
        loss.backward()
    torch._dynamo.reset()
    grads = [p.grad for p in model.parameters()]
    return Step(loss.detach(), grads, launches.names(), given, seen)
