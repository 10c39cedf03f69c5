"""Evaluating graph values on concrete tensors: at the traced sizes and at other ones, inputs read
as random values only where asked, and refusals for what a check must not run."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from seqcompile.fx import evaluate as fx_evaluate
from seqcompile.fx.evaluate import Evaluator, Unevaluated, other_sizes, traced_sizes


def causal_of(x):
    n = x.shape[-1]
    return torch.arange(n)[None, :] <= torch.arange(n)[:, None], x.sum()


def trace(fn, *inputs, symbolic=False):
    mode = FakeTensorMode(shape_env=ShapeEnv()) if symbolic else FakeTensorMode()
    fakes = [mode.from_tensor(t, static_shapes=not symbolic) for t in inputs]
    with mode:
        return make_fx(fn, tracing_mode="symbolic" if symbolic else "fake")(*fakes)


def output_nodes(gm):
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


def test_a_value_computed_from_sizes_is_evaluated_at_the_traced_sizes_and_another():
    gm = trace(causal_of, torch.randn(3, 5), symbolic=True)
    mask, _ = output_nodes(gm)
    sizes = traced_sizes([mask])
    assert sorted(sizes.values()) == [3, 5]
    evaluator = Evaluator()
    torch.testing.assert_close(evaluator.value(mask, sizes), torch.ones(5, 5).tril().bool())
    torch.testing.assert_close(
        evaluator.value(mask, other_sizes(sizes)), torch.ones(6, 6).tril().bool()
    )


def test_inputs_are_read_as_random_values_only_where_asked():
    gm = trace(causal_of, torch.randn(3, 5))
    _, total = output_nodes(gm)
    assert isinstance(Evaluator().value(total, {}), Unevaluated)
    state = torch.random.get_rng_state()
    first = Evaluator(torch.Generator().manual_seed(0)).value(total, {})
    again = Evaluator(torch.Generator().manual_seed(0)).value(total, {})
    assert torch.equal(torch.random.get_rng_state(), state), "torch's generator was used"
    assert isinstance(first, torch.Tensor) and torch.equal(first, again)


def test_values_too_large_or_random_are_not_evaluated(monkeypatch):
    monkeypatch.setattr(fx_evaluate, "MAX_ELEMENTS", 24)
    gm = trace(causal_of, torch.randn(3, 5))
    mask, _ = output_nodes(gm)
    refused = Evaluator().value(mask, {})
    assert isinstance(refused, Unevaluated) and "25 elements" in refused.reason

    gm = trace(lambda x: torch.rand(3) + x, torch.randn(3))
    out = output_nodes(gm)
    refused = Evaluator(torch.Generator()).value(out, {})
    assert isinstance(refused, Unevaluated) and "random" in refused.reason


def test_given_values_stand_for_their_nodes_at_any_shape(monkeypatch):
    """A given node is read at the given shape (a few rows of the traced one), and what it is
    computed from is never evaluated."""

    def rows(x):
        h = x * 2
        return h - h.amax(-1, keepdim=True)

    gm = trace(rows, torch.randn(3, 5))
    h = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    computed = []
    compute = Evaluator._compute
    monkeypatch.setattr(
        Evaluator,
        "_compute",
        lambda self, node, *a: computed.append(node) or compute(self, node, *a),
    )
    given = torch.randn(2, 5)
    value = Evaluator(given={h: given}).value(output_nodes(gm), {})
    torch.testing.assert_close(value, given - given.amax(-1, keepdim=True))
    assert not any(n.op == "placeholder" for n in computed), computed


def test_given_rows_of_a_value_past_the_size_limit_are_evaluated():
    """The limit judges a value by its traced shape; given a few rows, the caller keeps it."""
    gm = trace(lambda x: x - x.amax(-1, keepdim=True), torch.empty(4097, 4096, device="meta"))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert isinstance(Evaluator(torch.Generator()).value(output_nodes(gm), {}), Unevaluated)
    rows = torch.randn(3, 4096)
    value = Evaluator(given={x: rows}).value(output_nodes(gm), {})
    torch.testing.assert_close(value, rows - rows.amax(-1, keepdim=True))
