"""A fused call that runs its kernels reaches the executor as its kernels' launches
(`triton_kernel_wrapper_functional` nodes, `lower/inline.py`) where the executor can make them: no
`seqfast` op is called per step, so none of the op's Python runs per call. Under the interpreter
with the eager executor the traced launches run what the op calls run, launch for launch and bit
for bit; a call whose launches do not trace stays a call, with the reason in the report; a traced
launch times nothing."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import seqcompile.lower as lower
from seqcompile import report
from seqcompile.codegen import KernelSpec, counting_launches, tuning
from seqcompile.codegen.cache import add_entry
from seqcompile.codegen.launches import tracing_launches
from seqcompile.codegen.tuning import Config
from seqcompile.lower import traced_launches
from seqcompile.ops import registry
from seqcompile.ops.add_norm import kernels as norm
from tests.lower.eager_steps import eager_step

ROOT = Path(__file__).resolve().parents[2]
TRACED = torch.ops.higher_order.triton_kernel_wrapper_functional


def _called(step) -> set[str]:
    """The ops the report says are called as ops."""
    return {use.op for use in step.seen.implementations if "called as an op" in use.reason}


def _opaque(targets) -> set[str]:
    """The `seqfast` ops among `targets` that write none of their arguments, by registry name."""
    return {
        registry.entry_of(t).name
        for t in targets
        if getattr(t, "namespace", None) == "seqfast" and not t._schema.is_mutable
    }


@pytest.mark.slow  # two GPT steps compiled under the interpreter (the default run's kernel tier
# takes the traced route wherever it compiles with the eager executor)
@pytest.mark.kernels("attention_fwd", "add_norm_fwd", "add_norm_bwd", "pointwise:forward")
def test_traced_launches_run_what_the_op_calls_run(interpret, monkeypatch):
    step = eager_step(monkeypatch, "traced")
    loss, grads, launched, given, called = (
        step.loss,
        step.grads,
        step.launched,
        step.targets(),
        _called(step),
    )
    assert len(given) == 2, "a forward and a backward"
    for targets in given:
        assert TRACED in targets
        assert _opaque(targets) <= called, (_opaque(targets), called)
    # on CPU the loss's check of its targets reads the host; on CUDA it is a device assert
    assert called == {"linear_cross_entropy"}, called
    with monkeypatch.context() as opaque:
        want = eager_step(opaque, "called")
        want_loss, want_grads, want_launched, kept = (
            want.loss,
            want.grads,
            want.launched,
            want.targets(),
        )
    assert all(TRACED not in targets and _opaque(targets) for targets in kept)
    assert launched == want_launched
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.kernels("add_norm_fwd", "add_norm_bwd")
def test_a_call_whose_launches_do_not_trace_is_called_with_the_reason(interpret, monkeypatch):
    forward_kernels = norm.forward

    def reads_the_host(**arguments):
        x = arguments["x"]
        if x.sum().item() != x.sum().item():  # a host read, which no trace at fake values makes
            raise AssertionError("unreachable")
        return forward_kernels(**arguments)

    monkeypatch.setattr(norm, "forward", reads_the_host)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="seqfast", options={"rest": "eager"})
    with report.collecting() as seen:
        compiled(x).sum().backward()
    torch._dynamo.reset()
    reasons = {use.direction: use.reason for use in seen.implementations if use.op == "add_norm"}
    called = "called as an op: its launcher reads a tensor on the host"
    assert called in reasons["forward"], reasons
    assert reasons["backward"].endswith("launched by the executor"), reasons
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.kernels("add_norm_fwd", "add_norm_bwd", "pointwise:forward", "pointwise:backward")
def test_at_symbolic_sizes_one_compile_launches_the_kernels_at_every_length(interpret):
    """A dynamic compile traces the launches with grids in the symbolic sizes: a second length
    runs the same compiled graphs (no second compile), the executor launching every kernel, and
    both match eager."""
    torch.manual_seed(0)
    norm_, fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def model(x):
        return torch.nn.functional.gelu(fc(norm_(x + 1))) * 2 + x

    compiled = torch.compile(model, backend="seqfast", dynamic=True, options={"rest": "eager"})
    for rows, compiles in ((6, 1), (11, 0)):
        x = torch.randn(rows, 16, requires_grad=True)
        with report.collecting() as seen, counting_launches() as launches:
            out = compiled(x)
            (grad,) = torch.autograd.grad(out.square().sum(), x)
        uses = [(use.op, use.reason) for use in seen.implementations]
        assert len({use.graph for use in seen.implementations}) == compiles, uses
        assert all(reason.endswith("launched by the executor") for _, reason in uses), uses
        kernels = ("add_norm_fwd", "add_norm_bwd", "pointwise:forward", "pointwise:backward")
        assert all(launches.of(kernel) for kernel in kernels), launches
        want = model(x)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(grad, torch.autograd.grad(want.square().sum(), x)[0])
    torch._dynamo.reset()


@pytest.mark.kernels("add_norm_fwd")
def test_a_launcher_that_reads_a_symbolic_sizes_value_is_called(interpret, monkeypatch):
    """A launcher deciding by a size's exact value would fix the compile to that size: it stays
    a call, and the compile keeps serving other sizes."""
    forward_kernels = norm.forward

    def by_the_row_count(**arguments):
        if int(arguments["x"].shape[0]) < 0:  # an exact value (its guard would fix the size)
            raise AssertionError("unreachable")
        return forward_kernels(**arguments)

    monkeypatch.setattr(norm, "forward", by_the_row_count)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    compiled = torch.compile(model, backend="seqfast", dynamic=True, options={"rest": "eager"})
    with report.collecting() as seen, torch.no_grad():
        compiled(torch.randn(5, 16))
        x = torch.randn(9, 16)
        out = compiled(x)
    torch._dynamo.reset()
    (use,) = [use for use in seen.implementations if use.op == "add_norm"]
    assert "called as an op: its launcher decides by the exact value of a symbolic size" in (
        use.reason
    )
    torch.testing.assert_close(out, model(x))


@pytest.mark.kernels("add_norm_fwd")
def test_a_call_that_cannot_be_tuned_at_compile_time_still_traces(interpret, monkeypatch, caplog):
    def out_of_memory(node):
        raise RuntimeError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(traced_launches.tuning, "autotuning", lambda device: True)
    monkeypatch.setattr(traced_launches, "run_on_random_inputs", out_of_memory)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16))
    x = torch.randn(4, 16)
    with report.collecting() as seen, torch.no_grad():
        out = torch.compile(model, backend="seqfast", options={"rest": "eager"})(x)
    torch._dynamo.reset()
    (use,) = [use for use in seen.implementations if use.op == "add_norm"]
    assert use.reason.endswith("launched by the executor"), use.reason
    assert "was not tuned at its sizes (CUDA out of memory" in caplog.text
    torch.testing.assert_close(out, model(x))


def test_a_traced_launch_times_nothing(monkeypatch, tmp_path):
    """It runs the configuration the tuning file holds at its key, else the default."""
    device = torch.device("cuda")  # (the device's name is only read to name the file)
    monkeypatch.setattr(tuning, "autotuning", lambda device: True)
    monkeypatch.setattr(tuning, "tuning_file", lambda device: tmp_path / "tuning.json")
    monkeypatch.setattr(tuning, "_fastest", lambda *args: pytest.fail("a traced launch timed"))
    spec = KernelSpec.of("add_norm_fwd", traced_tuning_test=True)
    space = [Config.of(BLOCK_N=32, num_warps=1), Config.of(BLOCK_N=32, num_warps=2)]
    ran = []
    with tracing_launches():
        tuning.launch(spec, (torch.float32, 32), space, ran.append, device)
        add_entry(tmp_path / "tuning.json", tuning._entry(spec, (torch.float32, 32)),
                  tuning._as_json(space[1]))  # fmt: skip
        tuning.launch(spec, (torch.float32, 32), space, ran.append, device)
    assert ran == space
    assert not tuning._MEMORY.keys() & {(spec, (torch.float32, 32), device, "")}


@pytest.mark.parametrize(
    ("device", "executor", "interpreting", "inlined"),
    [
        ("cuda", "inductor", False, True),
        ("cuda", "eager", False, False),  # (a traced launch dispatched op by op is slower)
        ("cpu", "eager", True, True),
        ("cpu", "inductor", True, False),  # (Inductor on CPU makes no Triton launches)
        ("cpu", "eager", False, False),  # (the reference runs)
        ("meta", "eager", False, False),
    ],
)
def test_where_launches_are_traced(monkeypatch, device, executor, interpreting, inlined):
    monkeypatch.setattr(traced_launches.runtime, "interpreting", lambda: interpreting)
    assert lower.launches_inlined(torch.device(device), executor) is inlined


ANALYSIS = textwrap.dedent(
    """
    import json
    import torch, triton
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten
    from triton.backends.compiler import GPUTarget
    from seqcompile.lower import traced_launches
    from seqcompile.ops import registry
    from seqcompile.ops.cross_entropy import reference as cross_entropy
    from seqcompile.ops.samples import replace_slots, tensor_slots

    class Sm90:  # Triton's driver where only the target is asked: the analysis compiles for it
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Sm90())
    TRACED = torch.ops.higher_order.triton_kernel_wrapper_functional

    class SeqfastCalls(TorchDispatchMode):  # (tests/checks.py's, which loads the interpreter)
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if func.namespace == "seqfast":
                self.calls.append((func, args, kwargs or {}, result))
            return result


    def calls(entry, sample):
        args = replace_slots(sample.args, lambda slot, t: t.clone().requires_grad_(
            slot in sample.grads and t.is_floating_point()))
        with SeqfastCalls() as recorded:
            outputs = [o for o in tree_leaves(entry.forward(**args)) if o.requires_grad]
            wrt = [t for _, t in tensor_slots(args) if t.requires_grad]
            if outputs and wrt:
                torch.autograd.grad(outputs, wrt, [torch.ones_like(o) for o in outputs],
                                    allow_unused=True)
        return [(op, a, k) for op, a, k, _ in recorded.calls if not op._schema.is_mutable]

    def argument(node):  # whether `node` is (a view of) one of the call's arguments
        while node.op == "call_function" and getattr(node.target, "is_view", False):
            node = node.args[0]
        return node.op == "placeholder"

    def written_arguments(op, args, kwargs):
        with FakeTensorMode() as fake_mode:
            flat, spec = tree_flatten(tree_map_only(torch.Tensor, fake_mode.from_tensor,
                                                    (args, kwargs)))
            where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
            def call(*tensors):
                filled = list(flat)
                for i, t in zip(where, tensors):
                    filled[i] = t
                call_args, call_kwargs = tree_unflatten(filled, spec)
                return op(*call_args, **call_kwargs)
            gm = make_fx(call)(*[flat[i] for i in where])
        (node,) = [n for n in gm.graph.nodes if n.target is op]
        traced = traced_launches.launch_trace(node, fake_mode)
        if isinstance(traced, str):
            return traced
        launches = traced.gm.graph.find_nodes(op="call_function", target=TRACED)
        return sorted({w for launch in launches for w in launch.kwargs["tensors_to_clone"]
                       if argument(launch.kwargs["kwargs"][w])}), len(launches)

    made = {}  # each op's first call (the references run them on CPU)
    for entry in registry.ENTRIES:
        sample = next(s for s in entry.samples() if not s.is_empty() and s.grads)
        for op, args, kwargs in calls(entry, sample):
            made.setdefault(op, (args, kwargs))
    traced_launches.runtime.use_kernels = lambda t: True  # (CPU tensors, CUDA's launchers)
    cross_entropy.check_range = lambda *args: None  # (on CUDA a device assert, no host read)
    found = {str(op): written_arguments(op, *call) for op, call in made.items()}
    print(json.dumps(found))
    """
)


@pytest.mark.slow  # (compiles every kernel of a sample per entry to Triton's IR)
def test_no_traced_launch_writes_an_argument_of_its_call():
    """As Inductor sees it on CUDA: torch's analysis of each kernel (compiled for sm_90, which
    needs no GPU; in a process without the interpreter, whose library functions it cannot
    compile) finds that each launch of each op of every entry writes only buffers its launcher
    allocated or computed, so Inductor copies none of the call's arguments."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SEQFAST_INTERPRET")
    }
    result = subprocess.run(
        [sys.executable, "-c", ANALYSIS], capture_output=True, text=True, env=env, timeout=900,
        cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.splitlines()[-1])
    untraced = {op: outcome for op, outcome in found.items() if isinstance(outcome, str)}
    assert not untraced, untraced
    assert sum(launches for _, launches in found.values()) >= len(registry.ENTRIES)
    writes = {op: written for op, (written, _) in found.items() if written}
    assert not writes, f"launches write the call's arguments: {writes}"
