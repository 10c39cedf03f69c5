"""User patterns: two plain PyTorch functions become a rewrite that counts under its own name."""

import pytest
import torch
import torch.nn.functional as F
from checks import check_fusion

import seqcompile


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
