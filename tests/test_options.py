"""Options: defaults, environment overrides, precedence, and errors that name the valid choices."""

import pytest
import torch

from seqcompile.options import Budget, Options


def test_defaults():
    assert Options.resolve({}, environ={}) == Options()
    assert Options().rest is None and Options().partition == "auto" and not Options().disable


def test_environment_sets_every_option():
    env = {
        "SEQFAST_REST": "inductor",
        "SEQFAST_DUMP_DIR": "/tmp/d",
        "SEQFAST_DISABLE": "yes",
        "SEQFAST_PARTITION": "min_cut",
        "SEQFAST_LOG": "DEBUG",
    }
    assert Options.resolve({}, environ=env) == Options(
        rest="inductor", dump_dir="/tmp/d", disable=True, partition="min_cut", log="debug"
    )


def test_explicit_options_beat_the_environment():
    opts = Options.resolve(
        {"rest": "eager", "disable": False},
        environ={"SEQFAST_REST": "inductor", "SEQFAST_DISABLE": "1"},
    )
    assert opts.rest == "eager" and opts.disable is False


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown seqfast option\(s\) 'bogus'.*'rest'.*'dump_dir'"
    ):
        Options.resolve({"bogus": 1}, environ={})


@pytest.mark.parametrize(
    "options,message",
    [
        (
            {"rest": "cuda"},
            r"options\[\"rest\"\] must be one of 'inductor', 'eager' or None; got 'cuda'",
        ),
        ({"disable": "maybe"}, r"options\[\"disable\"\] must be a bool or one of '1', 'true'"),
        ({"partition": 3}, r"options\[\"partition\"\] must be one of 'auto', 'min_cut', 'default'"),
        ({"dump_dir": 5}, r"options\[\"dump_dir\"\] must be a directory path or None"),
        ({"memory_budget": 0}, r"options\[\"memory_budget\"\] must be a fraction .* in \(0, 1\]"),
        ({"memory_budget": 1.5}, r"must be a fraction of the save-everything plan"),
        ({"memory_budget": "lots"}, r"not a fraction or a size: 'lots'"),
        ({"checkpoint": "always"}, r"options\[\"checkpoint\"\] must be one of 'auto', 'none'"),
        (
            {"memory_budget": 0.5, "checkpoint": "none"},
            r"memory_budget.* needs options\[\"checkpoint\"\] \"auto\" or \"torch\"",
        ),
        (
            {"memory_budget": "6GiB", "checkpoint": "torch"},
            r"\"torch\" takes a fractional options\[\"memory_budget\"\]",
        ),
    ],
)
def test_bad_values_name_the_valid_choices(options, message):
    with pytest.raises(ValueError, match=message):
        Options.resolve(options, environ={})


@pytest.mark.parametrize(
    "value,budget",
    [
        (0.5, Budget(fraction=0.5)),
        (1, Budget(fraction=1.0)),
        ("0.25", Budget(fraction=0.25)),
        ("6GiB", Budget(size=6 * 2**30)),
        ("512 MB", Budget(size=512 * 10**6)),
        ("4096", Budget(size=4096)),
        (4096, Budget(size=4096)),
    ],
)
def test_memory_budget_takes_fractions_and_sizes(value, budget):
    assert Options.resolve({"memory_budget": value}, environ={}).memory_budget == budget
    env = {"SEQFAST_MEMORY_BUDGET": str(value)}
    assert Options.resolve({}, environ=env).memory_budget == budget


def test_bad_environment_value_is_an_error():
    with pytest.raises(ValueError, match="rest"):
        Options.resolve({}, environ={"SEQFAST_REST": "fast"})


def test_torch_compile_raises_value_error_for_bad_options():
    with pytest.raises(ValueError, match="valid options are"):
        torch.compile(lambda x: x + 1, backend="seqfast", options={"bogus": 1})(torch.randn(2))
