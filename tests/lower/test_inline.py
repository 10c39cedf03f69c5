"""On CPU with `rest="inductor"`, Inductor receives the fused operators' lowerings inlined, never an
opaque `seqfast` call, and computes what the opaque calls compute, with the same random numbers and
the same graph outputs (what the backward keeps); with `rest="eager"`, the kernels under the
interpreter, or the calls forced to their kernels by the `implementations` option, the fused
calls stay."""

import pytest
import torch
import torch._inductor.compile_fx as compile_fx
from conftest import TOLERANCES
from torch._inductor import cpp_builder

from seqcompile import report
from seqcompile.demo import GPT, GPTConfig, toy_batch
from seqcompile.lower import executor
from seqcompile.ops.registry import FAMILIES, entry_of

COMPILE_FX_INNER = compile_fx.compile_fx_inner
CONFIG = GPTConfig(vocab=64, max_len=16, d_model=32, n_heads=2, n_layers=2, dropout=0.1)


def _batch():
    return toy_batch(CONFIG, 2, 16, torch.device("cpu"), torch.Generator().manual_seed(0))


def _seqfast_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The fused calls Inductor is given (not the seqfast helpers it runs as they are: the host's
    check of the targets, the dropout stream's C function on CPU)."""
    return [str(n.target) for n in gm.graph.nodes if entry_of(n) is not None]


def _step(monkeypatch, rest: str | None, **options):
    """One training step of a seeded GPT with dropout: the loss, the gradients, and the graphs
    Inductor was given (name, opaque seqfast calls, output metadata). `rest` None: the default."""
    given = []

    def spy(gm, example_inputs, **kwargs):
        (output,) = gm.graph.find_nodes(op="output")
        values = [getattr(a, "meta", {}).get("val") for a in output.args[0]]
        meta = [(tuple(v.shape), v.dtype, v.stride()) for v in values if torch.is_tensor(v)]
        given.append((_seqfast_calls(gm), meta))
        return COMPILE_FX_INNER(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    options = options if rest is None else {**options, "rest": rest}
    compiled = torch.compile(model, backend="seqfast", options=options)
    torch.manual_seed(1)
    loss = compiled(*_batch())
    loss.backward()
    torch._dynamo.reset()
    return loss.detach(), [p.grad for p in model.parameters()], given


@pytest.mark.slow  # an Inductor compile of a step, forward and backward
def test_inductor_gets_the_lowerings_and_computes_what_the_opaque_calls_compute(monkeypatch):
    loss, grads, given = _step(monkeypatch, "inductor")
    assert len(given) >= 2, "a forward and a backward"
    assert all(not calls for calls, _ in given), [calls for calls, _ in given]
    with monkeypatch.context() as opaque:
        kernels = {family: "kernel" for family in FAMILIES}
        want_loss, want_grads, kept = _step(opaque, "inductor", implementations=kernels)
    assert any(calls for calls, _ in kept), "without the lowering the calls reach Inductor"
    assert [meta for _, meta in given] == [meta for _, meta in kept], "the graphs' outputs"
    torch.testing.assert_close(loss, want_loss, **TOLERANCES[torch.float32])
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


def test_the_eager_executor_runs_the_fused_calls(monkeypatch):
    with report.collecting() as seen:
        loss, _, given = _step(monkeypatch, "eager")
    assert not given and torch.isfinite(loss)
    runs = {(use.implementation, use.reason) for use in seen.implementations}
    assert runs == {("kernel", "on CPU with the eager executor: the op runs its reference")}


def test_a_lowering_the_option_asks_for_runs_under_the_eager_executor(monkeypatch):
    with report.collecting() as seen:
        loss, grads, _ = _step(monkeypatch, "eager", implementations={"norm": "lowering"})
    want_loss, want_grads, _ = _step(monkeypatch, "eager")
    lowered = {use.op for use in seen.implementations if use.implementation == "lowering"}
    assert lowered == {"add_norm"}
    assert not [k for k in seen.kernels if k.op == "add_norm"], "a lowered call launches none"
    torch.testing.assert_close(loss, want_loss, **TOLERANCES[torch.float32])
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, **TOLERANCES[torch.float32])


@pytest.mark.slow  # an Inductor compile of a step, forward and backward
def test_by_default_inductor_gets_the_rest_unless_it_finds_no_compiler(monkeypatch, caplog):
    monkeypatch.delenv("SEQFAST_REST")
    _, _, given = _step(monkeypatch, None)
    assert given and all(not calls for calls, _ in given)

    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    executor._cpu_compiler.cache_clear()
    try:
        loss, _, given = _step(monkeypatch, None)
    finally:
        executor._cpu_compiler.cache_clear()
    assert not given and torch.isfinite(loss)
    assert "Inductor finds no C++ compiler (no C++ compiler found)" in caplog.text


@pytest.mark.slow  # Inductor compiles a whole GPT around interpreted kernels (half a minute)
@pytest.mark.kernels("attention_fwd", "add_norm_fwd", "pointwise")
def test_kernels_under_the_interpreter_stay_opaque_to_inductor(interpret, monkeypatch):
    _, _, given = _step(monkeypatch, "inductor")
    forward_calls = given[0][0]
    assert "seqfast.attention.default" in forward_calls, forward_calls


@pytest.mark.slow  # an Inductor compile with its backward
def test_attention_shaped_math_seqfast_leaves_is_not_rewritten_by_inductor_into_sdpa():
    """A softmax over the queries (dim -2) between two batched matmuls is no attention, and seqfast
    leaves it to the executor; Inductor's joint-graph pattern matcher rewrote it into SDPA, a
    softmax over the keys (wrong outputs, and a gradient in other strides, which the structural
    check caught). The joint passes run without the matcher there: outputs and gradients match."""

    def scores(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -2) @ v

    q, k, v = (
        torch.randn(2, 2, 8, 16, generator=torch.Generator().manual_seed(int(i))) for i in "012"
    )
    fast = [t.clone().requires_grad_() for t in (q, k, v)]
    slow = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(scores, backend="seqfast", options={"rest": "inductor"})
    out, expected = compiled(*fast), scores(*slow)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    out.sum().backward()
    expected.sum().backward()
    for a, e in zip(fast, slow, strict=True):
        torch.testing.assert_close(a.grad, e.grad, **TOLERANCES[torch.float32])
