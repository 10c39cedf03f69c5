"""Normalization rules, each on a small graph: the spelling it removes is gone, values unchanged."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from seqcompile.capture import fake_inputs, trace_pre_dispatch
from seqcompile.normalize import normalize_graph

aten = torch.ops.aten


def normalized(fn, *inputs):
    gm = torch.fx.symbolic_trace(fn)
    fake_mode = FakeTensorMode()
    fakes = [fake_mode.from_tensor(t) for t in inputs]
    graph = trace_pre_dispatch(gm, fake_mode, fakes)
    fired = normalize_graph(graph, fake_mode)
    targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
    return graph, fired, targets


@pytest.mark.parametrize(
    "fn,rule,absent,present",
    [
        (
            lambda x: F.dropout(x, 0.0, True) + 1,
            "drop_inactive_dropout",
            aten.dropout.default,
            None,
        ),
        (
            lambda x: F.dropout(x, 0.3, False) + 1,
            "drop_inactive_dropout",
            aten.dropout.default,
            None,
        ),
        (lambda x: x.float() * 2, "one_cast_spelling", aten.to.dtype, None),
        (
            lambda x: x.type_as(torch.ones(1, dtype=torch.float16)),
            "one_cast_spelling",
            aten.type_as.default,
            aten.to.dtype,
        ),
        (lambda x: x / 4, "div_by_constant", aten.div.Tensor, aten.mul.Tensor),
        (lambda x: torch.square(x), "square_as_pow", aten.square.default, aten.pow.Tensor_Scalar),
        (lambda x: x * x, "square_as_pow", aten.mul.Tensor, aten.pow.Tensor_Scalar),
        (lambda x: x / torch.sqrt(x + 1), "rsqrt_spellings", aten.sqrt.default, aten.rsqrt.default),
        (
            lambda x: torch.reciprocal(torch.sqrt(x + 1)),
            "rsqrt_spellings",
            aten.reciprocal.default,
            aten.rsqrt.default,
        ),
        (lambda x: (x + 1) ** -0.5, "rsqrt_spellings", aten.pow.Tensor_Scalar, aten.rsqrt.default),
        (
            lambda x: (x - x.max(-1, keepdim=True).values).softmax(-1),
            "softmax_of_shifted",
            aten.sub.Tensor,
            aten.softmax.int,
        ),
        (
            lambda x: F.softmax(x - x.amax(0, keepdim=True).detach(), 0, dtype=torch.float64),
            "softmax_of_shifted",
            aten.sub.Tensor,
            aten.softmax.int,
        ),
    ],
    ids=[
        "dropout-p0",
        "dropout-eval",
        "cast-noop",
        "type_as",
        "div",
        "square",
        "mul-self",
        "div-sqrt",
        "recip-sqrt",
        "pow-half",
        "softmax-max-shifted",
        "softmax-amax-shifted",
    ],
)
def test_rule(fn, rule, absent, present):
    x = torch.rand(3, 4) + 0.5
    graph, fired, targets = normalized(fn, x)
    assert fired[rule] >= 1, fired
    assert absent not in targets
    if present is not None:
        assert present in targets
    torch.testing.assert_close(graph(x), fn(x))


def test_real_casts_and_active_dropout_stay():
    _, fired, targets = normalized(lambda x: F.dropout(x.half(), 0.1, True), torch.rand(2, 2))
    assert aten.dropout.default in targets and aten.to.dtype in targets
    assert sum(fired.values()) == 0


@pytest.mark.parametrize(
    "fn,x",
    [
        (lambda x: x**2.0, torch.arange(6).view(2, 3)),
        (lambda x: x * x, torch.tensor([True, False])),
        (lambda x: x / 3.0, torch.rand(4)),
        (lambda x: x / 1e39, torch.rand(4)),
        (lambda x: torch.ops.aten._to_copy(x, dtype=torch.float32), torch.rand(4)),
        (lambda x: (x - x.max(0, keepdim=True).values).softmax(-1), torch.rand(3, 4)),
        (lambda x: (x - x.max(-1).values[..., None]).softmax(-1), torch.rand(3, 4)),
        (lambda x: (x - x.amax(-1, keepdim=True)).log_softmax(-1), torch.rand(3, 4)),
    ],
    ids=[
        "int-pow-float",
        "bool-square",
        "div-by-3",
        "div-by-huge",
        "to_copy-same-dtype",
        "softmax-shifted-by-another-dim",
        "softmax-shifted-without-keepdim",
        "log-softmax",
    ],
)
def test_rules_leave_spellings_that_differ_in_result_alone(fn, x):
    graph, fired, _ = normalized(fn, x)
    assert sum(fired.values()) == 0, fired
    result = graph(x)
    assert result.dtype == fn(x).dtype
    assert torch.equal(result, fn(x))
    if fn(x).data_ptr() != x.data_ptr():  # a copy must stay a copy
        assert result.data_ptr() != x.data_ptr()


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("ij,jk->ik", [(3, 4), (4, 5)]),
        ("bij,bkj->bik", [(2, 3, 4), (2, 5, 4)]),
        ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
        ("bhkd,bhqd->bhqk", [(2, 3, 6, 5), (2, 3, 4, 5)]),
        ("bqhd,bkhd->bhqk", [(2, 4, 3, 5), (2, 6, 3, 5)]),
        ("bhqk,bkhd->bqhd", [(2, 3, 4, 6), (2, 6, 3, 5)]),
        ("bhgid,bhjd->bhgij", [(2, 3, 2, 4, 5), (2, 3, 6, 5)]),  # grouped query heads
        ("bhgij,bhjd->bhgid", [(2, 3, 2, 4, 6), (2, 3, 6, 5)]),
        ("bhjd,bhgid->bhgij", [(2, 3, 6, 5), (2, 3, 2, 4, 5)]),
        ("bid,bjd->bij", [(2, 4, 5), (2, 6, 5)]),
    ],
)
def test_batched_matmul_einsum_becomes_matmul_with_the_same_values(equation, shapes):
    inputs = [torch.randn(s) for s in shapes]
    graph, fired, targets = normalized(lambda a, b: torch.einsum(equation, a, b), *inputs)
    assert fired["einsum_as_matmul"] == 1
    assert aten.einsum.default not in targets and aten.matmul.default in targets
    torch.testing.assert_close(graph(*inputs), torch.einsum(equation, *inputs))


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("ii->i", [(3, 3)]),
        ("ij,ij->ij", [(3, 4), (3, 4)]),
        ("i,j->ij", [(3,), (4,)]),
        ("bij,cjk->bik", [(2, 3, 4), (5, 4, 6)]),  # c summed over one operand alone
    ],
)
def test_other_einsums_stay(equation, shapes):
    inputs = [torch.randn(s) for s in shapes]
    if len(inputs) == 1:
        _, fired, targets = normalized(lambda a: torch.einsum(equation, a), *inputs)
    else:
        _, fired, targets = normalized(lambda a, b: torch.einsum(equation, a, b), *inputs)
    assert fired["einsum_as_matmul"] == 0 and aten.einsum.default in targets


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 0.25), (0, 2.0)])
def test_baddbmm_becomes_matmul_and_add(beta, alpha):
    c, a, b = torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    if beta == 0:
        c[0, 0, 0] = float("nan")  # baddbmm ignores the input then

    def fn(c, a, b):
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)

    graph, fired, targets = normalized(fn, c, a, b)
    assert fired["bmm_as_matmul"] == 1
    assert aten.baddbmm.default not in targets
    assert (aten.add.Tensor in targets) == (beta != 0)  # beta 0 drops c, NaN and all
    torch.testing.assert_close(graph(c, a, b), fn(c, a, b))


def dynamo_normalized(fn, *inputs):
    """As `normalized`, from the graph Dynamo captures (symbolic tracing drops in-place ops)."""
    found = []

    def backend(gm, example_inputs):
        fake_mode, fakes = fake_inputs(example_inputs)
        graph = trace_pre_dispatch(gm, fake_mode, fakes)
        found.append((graph, normalize_graph(graph, fake_mode)))
        return gm.forward

    torch.compile(fn, backend=backend)(*inputs)
    graph, fired = found[0]
    return graph, fired, [n.target for n in graph.graph.nodes if n.op == "call_function"]


def test_an_in_place_op_on_a_value_the_graph_made_becomes_out_of_place():
    def fn(x, y):
        scores = x * 2
        scores *= 0.5  # Falcon scales its scores in place
        buckets = (y > 0).long()
        buckets += 3  # T5's relative buckets
        return scores + 1, buckets

    graph, fired, targets = dynamo_normalized(fn, torch.randn(3, 4), torch.randn(3, 4))
    assert fired["out_of_place"] == 2
    assert aten.mul_.Tensor not in targets and aten.add_.Tensor not in targets
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for got, want in zip(graph(x, y), fn(x, y), strict=True):
        torch.testing.assert_close(got, want)


def test_an_in_place_op_seen_through_a_view_or_on_an_input_stays():
    def fn(x):
        y = x.clone()
        y[0].add_(1)  # through a view: y changes too
        x.mul_(2)  # the caller's tensor
        return y

    graph, fired, targets = dynamo_normalized(fn, torch.randn(3, 4))
    assert fired["out_of_place"] == 0
    assert aten.add_.Tensor in targets and aten.mul_.Tensor in targets


@pytest.mark.parametrize(
    "write",
    [
        lambda y: y.__setitem__((slice(None), 0), 0.0),
        lambda y: y.view(-1)[:3].fill_(0.0),
        lambda y: y.select(1, 2).add_(1.0).mul_(2.0),
    ],
    ids=["setitem", "view_of_a_view", "two_writes"],
)
def test_an_in_place_op_whose_result_is_written_through_a_view_stays(write):
    """`y.mul_(3); y[:, 0] = 0`: the write goes through a view of the in-place op's result, which
    a copy in its place would not receive."""

    def fn(x):
        y = x * 2
        y.mul_(3)
        write(y)
        return torch.relu(y) + 1

    x = torch.randn(4, 5)
    graph, fired, targets = dynamo_normalized(fn, x)
    assert fired["out_of_place"] == 0 and aten.mul_.Tensor in targets
    torch.testing.assert_close(graph(x.clone())[0], fn(x.clone()))
    compiled = torch.compile(fn, backend="seqfast")
    torch.testing.assert_close(compiled(x.clone()), fn(x.clone()))


def test_a_rule_whose_result_is_laid_out_otherwise_keeps_the_layout():
    """einsum of a transposed operand returns strides matmul would not (a graph output's
    strides are the caller's to rely on)."""
    p = torch.randn(2, 4, 1, 1, requires_grad=True)
    v = torch.randn(5, 4, 1, 2).transpose(0, -1).requires_grad_()

    def fn(p, v):
        return torch.einsum("bhqk,bhkd->bhqd", p, v)

    out = torch.compile(fn, backend="seqfast")(p, v)
    assert out.stride() == fn(p, v).stride()
    torch.testing.assert_close(out, fn(p, v))


def test_a_copy_into_a_value_stays_in_place_and_differentiates():
    """`aten.copy`, the out-of-place form of `copy_`, has no derivative."""

    def fn(x, w):
        h = x * w + 1
        h.copy_(w.expand(4, 8))
        return (h * w).sin()

    x, w = torch.randn(4, 8), torch.randn(8, requires_grad=True)
    w_eager = w.detach().clone().requires_grad_()
    torch.compile(fn, backend="seqfast")(x, w).sum().backward()
    fn(x, w_eager).sum().backward()
    torch.testing.assert_close(w.grad, w_eager.grad)
