"""User patterns: two plain PyTorch functions become a rewrite that counts under its own name."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion
from conftest import assert_close

import seqcompile
from seqcompile.backend import seqfast
from seqcompile.report import collecting


@pytest.fixture
def registered():
    names = []

    def register(name, *args):
        names.append(name)
        return seqcompile.register_pattern(name, *args)

    yield register
    for name in names:
        seqcompile.unregister_pattern(name)


def squared_relu(x):
    return F.relu(x) ** 2


def squared_relu_by_square(x):
    return torch.square(F.relu(x))


def test_user_pattern_rewrites_and_counts_under_its_name(registered, tmp_path):
    registered("squared_relu", squared_relu, [torch.randn(4, 8)], squared_relu_by_square)

    def fn(a, b):
        return squared_relu(a) + squared_relu(b * 3)

    check_fusion(
        fn,
        [torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)],
        counts={"squared_relu": 2, "pointwise": 1},
        options={"dump_dir": str(tmp_path)},
    )
    fused = next(tmp_path.glob("*/*_normalize.py")).read_text()
    assert fused.count("aten.pow") == 2  # what the replacement took away


def test_pattern_is_normalized_like_the_graph(registered):
    """The pattern divides by 2, the model multiplies by 0.5: normalization makes them one."""
    registered(
        "half_add",
        lambda x, y: x / 2 + y,
        [torch.randn(2), torch.randn(2)],
        lambda x, y: torch.add(y, x, alpha=0.5),
    )
    check_fusion(
        lambda x, y: x * 0.5 + y,
        [torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)],
        counts={"half_add": 1},
    )


def test_user_patterns_run_before_the_families(registered):
    """A user rewrite of a norm site takes it from the built-in family."""
    registered(
        "my_norm",
        lambda x, y: F.layer_norm(x + y, (8,)),
        [torch.randn(2, 8), torch.randn(2, 8)],
        lambda x, y: F.layer_norm(y + x, (8,)) * 1.0,
    )
    check_fusion(
        lambda x, y: F.layer_norm(x + y, (8,)),
        [torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)],
        counts={"my_norm": 1, "norm": 1},
    )


def test_no_match_means_no_count(registered):
    registered("squared_relu", squared_relu, [torch.randn(4, 8)], squared_relu_by_square)
    report = check_fusion(
        lambda x: F.gelu(x) ** 2, [torch.randn(3, 8, requires_grad=True)], counts={}
    )
    assert "squared_relu" not in report.counts


@pytest.mark.parametrize(
    "name,message",
    [("norm", "built-in family"), ("not a name", "identifier"), (3, "identifier")],
)
def test_bad_names_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        seqcompile.register_pattern(name, squared_relu, [torch.randn(2)], squared_relu_by_square)


def test_untraceable_function_is_refused_clearly():
    def bad(x):
        return x.reshape(7, 7)

    with pytest.raises(ValueError, match="replacement_fn of 'bad'.*could not be traced"):
        seqcompile.register_pattern("bad", squared_relu, [torch.randn(4, 8)], bad)


def mean_last(x):
    return x.mean(-1, keepdim=True)


def mean_by_sum(x):
    return x.sum(-1, keepdim=True) / x.shape[-1]


def scaled_mean(x):
    return mean_last(x) * 2


@pytest.mark.parametrize("shape", [(4, 8), (3, 64), (5, 16)])
def test_a_replacement_that_reads_a_size_is_traced_at_each_site(registered, shape):
    """Traced once at the example (4, 8), the replacement would divide by 8 at every size."""
    registered("mean_last", mean_last, [torch.randn(4, 8)], mean_by_sum)
    check_fusion(scaled_mean, [torch.randn(*shape, requires_grad=True)], counts={"mean_last": 1})


def test_a_replacement_reads_the_symbolic_sizes_of_a_dynamic_graph(registered):
    """One graph serves every size, so the replacement's size must be the graph's symbol."""
    registered("mean_last", mean_last, [torch.randn(4, 8)], mean_by_sum)
    compiled = torch.compile(scaled_mean, backend=seqfast, dynamic=True)
    with collecting() as report:
        for shape in [(3, 64), (5, 16)]:
            x = torch.randn(*shape, requires_grad=True)
            expected_x = x.detach().clone().requires_grad_()
            actual, expected = compiled(x), scaled_mean(expected_x)
            assert_close(actual, expected)
            grad = torch.randn(expected.shape)
            actual.backward(grad)
            expected.backward(grad)
            assert_close(x.grad, expected_x.grad)
    assert report.counts["mean_last"] == 1, f"one dynamic graph, one site\n{report}"


@pytest.mark.parametrize(
    "shape,counts,missed",
    [
        ((3, 8), {"mean_last": 1}, []),
        ((3, 64), {"mean_last": 0}, ["not as traced at this site's (float32[3, 64])"]),
    ],
)
def test_a_pattern_whose_trace_holds_a_size_matches_only_where_it_holds(
    registered, shape, counts, missed
):
    """The pattern traced at (4, 8) divides by 8; at width 64, `/ 8` is not the mean."""
    registered("mean_last", mean_by_sum, [torch.randn(4, 8)], mean_last)
    check_fusion(
        lambda x: x.sum(-1, keepdim=True) / 8,
        [torch.randn(*shape, requires_grad=True)],
        counts=counts,
        missed=missed,
    )


@pytest.mark.parametrize(
    "shape,counts,missed",
    [
        ((3, 8), {"scale_by_width": 1}, []),
        ((3, 64), {"scale_by_width": 0}, ["not as traced at this site's (float32[3, 64])"]),
    ],
)
def test_a_pointwise_pattern_whose_trace_holds_a_size_marks_only_where_it_holds(
    registered, shape, counts, missed
):
    registered("scale_by_width", lambda x: x * x.shape[-1], [torch.randn(4, 8)])
    check_fusion(
        lambda x: torch.sin(x * 8),
        [torch.randn(*shape, requires_grad=True)],
        counts=counts,
        missed=missed,
    )


@pytest.mark.parametrize(
    "replacement,missed",
    [
        (
            lambda x: x.sum(-1, keepdim=True, dtype=torch.float32) / x.shape[-1],
            "returns float32[3, 1], but the site computes float64[3, 1]",
        ),
        (
            lambda x: x.sum(-1, keepdim=True).view(4, 1) / x.shape[-1],
            "could not be traced at this site's inputs (float64[3, 64])",
        ),
    ],
    ids=["wrong dtype", "untraceable"],
)
def test_a_replacement_that_cannot_serve_a_site_is_refused(registered, replacement, missed):
    registered("mean_last", mean_last, [torch.randn(4, 8)], replacement)
    check_fusion(
        scaled_mean,
        [torch.randn(3, 64, dtype=torch.float64, requires_grad=True)],
        counts={"mean_last": 0},
        missed=[missed],
    )
