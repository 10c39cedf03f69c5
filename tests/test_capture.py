"""Capture keeps the ops patterns match whole, carries source locations, keeps symbolic sizes."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from seqcompile.capture import fake_inputs, trace_pre_dispatch
from seqcompile.fx import custom_function

aten = torch.ops.aten


def captured(fn, *inputs, dynamic=False):
    graphs = []

    def backend(gm, example_inputs):
        fake_mode, fakes = fake_inputs(example_inputs)
        graphs.append(trace_pre_dispatch(gm, fake_mode, fakes))
        return gm.forward

    torch.compile(fn, backend=backend, dynamic=dynamic)(*inputs)
    return graphs[0]


def test_pre_dispatch_keeps_the_ops_patterns_match_whole():
    w = torch.randn(8, 8)

    def fn(x):
        h = F.dropout(F.linear(x, w), 0.1, True)
        return F.layer_norm(h, (8,)), F.rms_norm(h, (8,)), h.softmax(-1)

    graph = captured(fn, torch.randn(2, 8))
    targets = {n.target for n in graph.graph.nodes}
    for op in (
        aten.linear.default,
        aten.dropout.default,
        aten.layer_norm.default,
        aten.rms_norm.default,
        aten.softmax.int,
    ):
        assert op in targets, op


def test_nodes_carry_fake_values_and_source_locations():
    graph = captured(lambda x: F.layer_norm(x * 2, (8,)), torch.randn(2, 8))
    norm = next(n for n in graph.graph.nodes if n.target is aten.layer_norm.default)
    assert norm.meta["val"].shape == (2, 8)
    assert "test_capture.py" in norm.meta["stack_trace"]


def test_symbolic_sizes_stay_symbolic():
    graph = captured(lambda x: F.layer_norm(x, (8,)), torch.randn(5, 8), dynamic=True)
    norm = next(n for n in graph.graph.nodes if n.target is aten.layer_norm.default)
    rows, width = norm.meta["val"].shape
    assert isinstance(rows, torch.SymInt) and width == 8


class _ScaledGelu(torch.autograd.Function):
    """GELU whose backward is deliberately not GELU's derivative: only the user's backward can
    give these gradients."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.tanh(x) * 3.0


class _CustomFunctionBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x, residual):
        h = self.norm(x + residual)
        return self.down(_ScaledGelu.apply(self.up(h))) + h


def test_a_custom_autograd_function_keeps_its_backward_and_the_parameters_before_it_their_grads():
    """The Function is element-wise, so it joins the up projection's bias in a region whose kernels
    compute its own backward (the down projection's bias and the residual are the other)."""
    from checks import check_fusion

    x, residual = torch.randn(2, 5, 8), torch.randn(2, 5, 8, requires_grad=True)
    check_fusion(_CustomFunctionBlock(), (x, residual), counts={"norm": 1, "pointwise": 2})


def test_a_custom_autograd_function_is_one_node():
    """One output: a call of `apply_one`, the grad-mode round trip tracing left behind it gone;
    its body is not traced inline."""
    graph = captured(lambda x: _ScaledGelu.apply(x) * 2, torch.randn(4, requires_grad=True))
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    assert custom_function.apply_one in targets
    assert torch._C._set_grad_enabled not in targets
    assert aten.gelu.default not in targets, "the custom function's body was traced inline"


def test_data_of_an_input_is_read_when_the_graph_runs_and_carries_no_gradient():
    """`w.data` traced as is would be a constant holding the traced value."""

    def fn(x, w):
        return torch.relu(x @ w.data) + x @ w

    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    compiled = torch.compile(fn, backend="seqfast")
    torch.testing.assert_close(compiled(x, w), fn(x, w))
    with torch.no_grad():
        w.mul_(3)
    out = compiled(x, w)
    torch.testing.assert_close(out, fn(x, w))
    out.sum().backward()
    torch.testing.assert_close(w.grad, x.t() @ torch.ones(3, 2))


class _DoubledInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        a.mul_(2)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_a_custom_function_that_modifies_its_input_runs_the_graph_as_captured():
    """Kept as one node, its change to `h` would be invisible to `h`'s later readers: the graph
    runs as Dynamo captured it, with a warning and a line in the report."""
    from seqcompile.report import collecting

    def fn(x, w):
        h = x * w
        _DoubledInPlace.apply(h)
        return h.sin()

    x = torch.randn(4)
    w = torch.randn(4, requires_grad=True)
    w_eager = w.detach().clone().requires_grad_()
    with collecting() as report, pytest.warns(UserWarning, match="ctx.mark_dirty"):
        out = torch.compile(fn, backend="seqfast")(x, w)
    expected = fn(x, w_eager)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(w.grad, w_eager.grad)
    assert any("runs as captured" in m.reason for m in report.missed)


def test_importing_the_capture_stage_loads_no_triton_and_no_operator():
    """Stage 1 stands on the ground floor (the FX helpers, the report as data): a fresh
    interpreter importing it loads neither Triton nor any fused operator."""
    code = (
        "import sys, seqcompile.capture\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'"
        " or m.startswith('seqcompile.ops')))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", result.stdout
