"""Autocast made explicit at capture: an autocast region inside the compiled code becomes casts in
the graph, with autocast's dtypes on every node, and the graph run without autocast computes what
eager computes under it."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TOLERANCES

from seqcompile.capture import autocast, fake_inputs, trace_pre_dispatch
from seqcompile.demo import Block, GPTConfig
from seqcompile.report import collecting

aten = torch.ops.aten


def captured(fn, *inputs):
    """The captured graph of `fn`, its output run by Dynamo's graph (autocast really entered),
    and its output run by the captured graph."""
    seen = {}

    def backend(gm, example_inputs):
        fake_mode, fakes = fake_inputs(example_inputs)
        seen["graph"] = trace_pre_dispatch(gm, fake_mode, fakes)
        seen["dynamo"] = list(gm(*example_inputs))
        seen["captured"] = list(seen["graph"](*example_inputs))
        return gm.forward

    torch.compile(fn, backend=backend)(*inputs)
    return seen["graph"], seen["dynamo"], seen["captured"]


def targets(graph):
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


def assert_same(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_region_becomes_casts_and_disappears(dtype):
    w = torch.randn(16, 8)

    def fn(x):
        with torch.autocast("cpu", dtype=dtype):
            h = F.linear(x, w)
            y = h.softmax(-1)
        return h, y, y.sum()

    graph, dynamo, explicit = captured(fn, torch.randn(4, 8))
    assert autocast.ENTER not in targets(graph) and autocast.EXIT not in targets(graph)
    linear = next(n for n in graph.graph.nodes if n.target is aten.linear.default)
    assert linear.meta["val"].dtype == dtype
    assert all(a.target is aten.to.dtype for a in linear.args)
    assert dynamo[0].dtype == dtype
    assert_same(explicit, dynamo)


def test_a_disabled_region_inside_stays_in_float32():
    w = torch.randn(16, 8)

    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.linear(x, w)
            with torch.autocast("cpu", enabled=False):
                full = F.linear(x, w)
        return h, full

    graph, dynamo, explicit = captured(fn, torch.randn(4, 8))
    assert autocast.ENTER not in targets(graph)
    assert [o.dtype for o in dynamo] == [torch.bfloat16, torch.float32]
    assert_same(explicit, dynamo)


def test_autocast_around_the_compiled_code_writes_casts_and_keeps_running_under_it():
    w = torch.randn(16, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph, dynamo, explicit = captured(lambda x: F.linear(x, w).relu(), torch.randn(4, 8))
    assert aten.to.dtype in targets(graph)
    assert dynamo[0].dtype == torch.bfloat16
    assert_same(explicit, dynamo)


def test_ops_autocast_leaves_alone_get_no_casts():
    def fn(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x * 2).exp()

    graph, dynamo, explicit = captured(fn, torch.randn(4, 8))
    assert aten.to.dtype not in targets(graph)
    assert_same(explicit, dynamo)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_block_under_autocast_inside_the_compiled_code_fuses_and_matches_eager(dtype):
    torch.manual_seed(0)
    block = Block(GPTConfig(vocab=64, max_len=32, d_model=32, n_heads=2, dropout=0.0))

    def step(x):
        with torch.autocast("cpu", dtype=dtype):
            return block(x)

    x = torch.randn(2, 8, 32, requires_grad=True)
    x_fast = x.detach().clone().requires_grad_()
    eager = step(x)
    with collecting() as report:
        fast = torch.compile(step, backend="seqfast")(x_fast)
    assert report.counts["norm"] == 2 and report.counts["attention"] == 1, report
    assert fast.dtype == eager.dtype
    torch.testing.assert_close(fast, eager, **TOLERANCES[dtype])
    eager.float().sum().backward()
    fast.float().sum().backward()
    torch.testing.assert_close(x_fast.grad, x.grad, **TOLERANCES[dtype])
