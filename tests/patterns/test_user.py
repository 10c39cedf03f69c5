"""User patterns: plain PyTorch functions become a rewrite, or a pointwise kernel of their own,
counted per match under the pattern's name; scalar example inputs are literal wildcards."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion
from conftest import assert_close

import seqcompile
from seqcompile.backend import seqfast
from seqcompile.ops.pointwise import region as pointwise_region
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


def run_at_sizes(fn, shapes, dynamic):
    """One compiled `fn` called at each shape, its output and gradient compared with eager's;
    returns the report of every compile it made."""
    compiled = torch.compile(fn, backend=seqfast, dynamic=dynamic)
    with collecting() as report:
        for shape in shapes:
            x = torch.randn(*shape, requires_grad=True)
            expected_x = x.detach().clone().requires_grad_()
            actual, expected = compiled(x), fn(expected_x)
            assert_close(actual, expected)
            grad = torch.randn(expected.shape)
            actual.backward(grad)
            expected.backward(grad)
            assert_close(x.grad, expected_x.grad)
    return report


def test_a_replacement_reads_the_symbolic_sizes_of_a_dynamic_graph(registered):
    """One graph serves every size, so the replacement's size must be the graph's symbol."""
    registered("mean_last", mean_last, [torch.randn(4, 8)], mean_by_sum)
    report = run_at_sizes(scaled_mean, [(3, 64), (5, 16)], dynamic=True)
    assert report.counts["mean_last"] == 1, f"one dynamic graph, one site\n{report}"


def rms(x):
    return torch.sqrt((x * x).mean(-1, keepdim=True))


def rms_by_sum(x):
    return torch.sqrt((x * x).sum(-1, keepdim=True)) * x.shape[-1] ** -0.5


@pytest.mark.parametrize("dynamic,compiles", [(False, 3), (True, 1)])
def test_a_size_reading_replacement_is_right_at_every_size(registered, dynamic, compiles):
    """Recompiled at each size (static), or compiled once at symbolic sizes: the replacement
    reads the width of the site it replaces, never the example's 8."""
    registered("rms", rms, [torch.randn(4, 8)], rms_by_sum)
    report = run_at_sizes(lambda x: rms(x) + 1, [(3, 64), (5, 16), (2, 4)], dynamic)
    assert len(report.graphs) == compiles, report
    assert report.counts["rms"] == compiles, f"one site per compile\n{report}"
    assert not report.missed, report


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


def split_pairs(x):
    return x.view(x.shape[0], -1, 2).sum(-1)


def split_pairs_by_unflatten(x):
    return x.unflatten(-1, (-1, 2)).sum(-1)


@pytest.mark.parametrize(
    "pattern,replacement",
    [(mean_by_sum, mean_last), (split_pairs, split_pairs_by_unflatten)],
    ids=["divides by the width", "views at the batch size"],
)
@pytest.mark.parametrize("dynamic,compiles", [(False, 3), (True, 1)])
def test_a_pattern_that_reads_a_size_matches_the_same_code_at_every_size(
    registered, pattern, replacement, dynamic, compiles
):
    """Traced at (4, 8), the pattern holds 1/8 or a view to [4, -1, 2]; the model runs the same
    code at other sizes (literals of its own where static, sizes it computes where dynamic)."""
    registered("sized", pattern, [torch.randn(4, 8)], replacement)
    report = run_at_sizes(lambda x: pattern(x) * 2, [(3, 64), (5, 16), (2, 6)], dynamic)
    assert len(report.graphs) == compiles, report
    assert report.counts["sized"] == compiles, f"one site per compile\n{report}"
    assert not report.missed, report


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
        (
            lambda x: x.sum(-1, keepdim=True) / x.shape[-1] * torch.tensor(1.0, dtype=x.dtype),
            "makes a tensor constant",
        ),
    ],
    ids=["wrong dtype", "untraceable", "tensor constant"],
)
def test_a_replacement_that_cannot_serve_a_site_is_refused(registered, replacement, missed):
    registered("mean_last", mean_last, [torch.randn(4, 8)], replacement)
    check_fusion(
        scaled_mean,
        [torch.randn(3, 64, dtype=torch.float64, requires_grad=True)],
        counts={"mean_last": 0},
        missed=[missed],
    )


@pytest.mark.parametrize("replacement", [squared_relu_by_square, None], ids=["rewrite", "kernel"])
def test_each_match_counts_once(registered, replacement):
    """Three matches, one feeding another: three sites, whether rewritten or each fused into a
    pointwise region of its own (not one region for the three)."""
    registered("squared_relu", squared_relu, [torch.randn(4, 8)], replacement)
    check_fusion(
        lambda x, y: squared_relu(squared_relu(x) - 1) + squared_relu(y),
        [torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)],
        counts={"squared_relu": 3},
    )


@pytest.mark.kernels("pointwise:forward", "pointwise:backward")
def test_a_pointwise_pattern_gets_kernels_of_its_own_named_after_it(registered, interpret):
    """The match is a region of its own, apart from the ops around it, and the files of its
    forward and backward kernels carry the pattern's name."""
    registered("squared_relu", squared_relu, [torch.randn(4, 8)])
    report = check_fusion(
        lambda x: torch.tanh(squared_relu(torch.sin(x) * 2) + 1),
        [torch.randn(3, 8, requires_grad=True)],
        counts={"squared_relu": 1, "pointwise": 2},
    )
    named = [k for k in report.kernels if dict(k.spec.key)["region"].startswith("squared_relu_")]
    # the backward launches the forward again: the match's output is recomputed, not kept
    assert sorted({k.spec.name for k in named}) == ["pointwise:backward", "pointwise:forward"]
    for kernel in named:
        assert "region squared_relu_" in kernel.source.path.read_text()
        assert kernel.source.path.name.startswith("pointwise_squared_relu_")
        assert kernel.op == "squared_relu"
    (region,) = {dict(k.spec.key)["region"] for k in named}
    ops = {n.target for n in pointwise_region.lookup(region).forward.graph.nodes}
    assert torch.ops.aten.mul.Tensor not in ops and torch.ops.aten.tanh.default not in ops, ops


def quick_gelu(x, alpha):
    return x * torch.sigmoid(alpha * x)


def test_a_scalar_example_input_matches_any_literal_and_passes_it_on(registered):
    received = []

    def replacement(x, alpha):
        received.append(alpha)
        return x * torch.sigmoid(x * alpha)

    registered("quick_gelu", quick_gelu, [torch.randn(4, 8), 1.702], replacement)
    received.clear()  # the trace at registration
    check_fusion(
        lambda x: quick_gelu(x, 1.5) + quick_gelu(x * 3, 2.0),
        [torch.randn(3, 8, requires_grad=True)],
        counts={"quick_gelu": 2},
    )
    assert sorted(received) == [1.5, 2.0]


@pytest.mark.parametrize("scale,counts", [(2.5, {"tanh_scaled": 1}), (2.25, {"tanh_scaled": 0})])
def test_a_literal_in_the_pattern_body_must_match_exactly(registered, scale, counts):
    """`alpha` is a wildcard; the 2.5 written in the body is not."""
    registered(
        "tanh_scaled",
        lambda x, alpha: torch.tanh(x * 2.5) * alpha,
        [torch.randn(4, 8), 1.7],
        lambda x, alpha: torch.tanh(2.5 * x) * alpha,
    )
    check_fusion(
        lambda x: torch.tanh(x * scale) * 3.0,
        [torch.randn(3, 8, requires_grad=True)],
        counts=counts,
    )


@pytest.mark.parametrize(
    "pattern,example,message",
    [
        (lambda x, a: x / a, 2.0, "with a=2.1234567 instead the trace has other ops"),
        (lambda x, a: x * (a * 2), 1.5, "the literal 3.0 of aten.mul.Tensor in the trace becomes"),
        (lambda x, a: x * 3, 1.5, "nothing in the trace changes"),
    ],
    ids=["normalized", "folded", "unused"],
)
def test_a_literal_parameter_must_land_in_the_trace_as_itself(pattern, example, message):
    with pytest.raises(ValueError, match="Write the literal the trace holds as the parameter"):
        try:
            seqcompile.register_pattern("scaled", pattern, [torch.randn(4, 8), example])
        except ValueError as error:
            assert message in str(error)
            raise


def test_a_pattern_with_two_outputs_is_replaced_before_the_first_read(registered):
    """The first output is read before the second is computed: the replacement goes in there."""
    registered(
        "sin_cos",
        lambda x: (torch.sin(x) * 2, torch.cos(x) * 3),
        [torch.randn(4, 8)],
        lambda x: (2 * torch.sin(x), 3 * torch.cos(x)),
    )
    check_fusion(
        lambda x: (torch.sin(x) * 2 + 1) * (torch.cos(x) * 3),
        [torch.randn(3, 8, requires_grad=True)],
        counts={"sin_cos": 1},
    )
