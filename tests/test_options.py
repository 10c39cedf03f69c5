"""Options: defaults, environment overrides (an empty variable is unset), precedence, and errors
that name where a bad value came from and the valid choices."""

import dataclasses
import os

import pytest
import torch

from seqcompile.options import Budget, OptionError, Options


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
        ({"dump_dir": 5}, r"options\[\"dump_dir\"\] must be a folder path .* or None for no dump"),
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


def test_implementations_are_asked_per_operator_or_family_in_options_or_the_environment():
    asked = {"attention": "lowering", "loss": "kernel", "pointwise": "auto"}
    assert Options.resolve({"implementations": asked}, environ={}).implementations == asked
    env = {"SEQFAST_IMPLEMENTATIONS": " attention=LOWERING, loss=kernel;pointwise=auto"}
    assert Options.resolve({}, environ=env).implementations == asked
    with pytest.raises(OptionError, match=r"names 'flash', which is no fused operator or family"):
        Options.resolve({"implementations": {"flash": "kernel"}}, environ={})
    with pytest.raises(OptionError, match=r"asks 'vendor' of 'add_norm', which takes one of"):
        Options.resolve({"implementations": {"add_norm": "vendor"}}, environ={})
    with pytest.raises(OptionError, match=r"must be \"name=implementation\" pairs"):
        Options.resolve({}, environ={"SEQFAST_IMPLEMENTATIONS": "lowering"})


def test_bad_environment_value_is_an_error_naming_the_variable():
    with pytest.raises(ValueError, match=r"^SEQFAST_REST must be one of .* or unset; got 'fast'"):
        Options.resolve({}, environ={"SEQFAST_REST": "fast"})


# every option: a bad value and a value of the wrong type, given in options and in the environment
BAD = {
    "rest": ("cuda", 3),
    "dump_dir": (os.path.join(os.devnull, "dump"), 5),
    "disable": ("maybe", 2),
    "partition": ("fast", None),
    "log": ("loud", 10),
    "loss_chunk": ("-1", 1.5),
    "reuse_saved": ("sometimes", []),
    "memory_budget": ("lots", [0.5]),
    "checkpoint": ("always", True),
    "accumulate_grads": ("perhaps", 1.0),
    "implementations": ("attention=fast", 3),
    "verify": ("nah", object()),
}


def test_the_sweep_below_covers_every_option():
    assert set(BAD) == {f.name for f in dataclasses.fields(Options)}


@pytest.mark.parametrize("name", sorted(BAD))
def test_every_option_refuses_bad_values_naming_where_they_came_from(name):
    value, wrong_type = BAD[name]
    for given in (value, wrong_type):
        with pytest.raises(OptionError, match=rf'^options\["{name}"\] ') as raised:
            Options.resolve({name: given}, environ={})
        assert repr(given) in str(raised.value)
    env = f"SEQFAST_{name.upper()}"
    with pytest.raises(OptionError, match=rf"^{env} ") as raised:
        Options.resolve({}, environ={env: str(value)})
    assert "options[" not in str(raised.value)
    # an empty (or blank) variable is unset: the default, whatever the option
    for empty in ("", "  "):
        assert Options.resolve({}, environ={env: empty}) == Options()
    # and an explicit option still wins over a bad variable
    assert Options.resolve({name: getattr(Options(), name)}, environ={env: str(value)}) == Options()


@pytest.mark.parametrize(
    "options,shown",
    [
        ("memory_budget=0.5", r"options=\{'memory_budget': '0\.5'\}"),
        ("rest=eager, log=debug", r"options=\{'rest': 'eager', 'log': 'debug'\}"),
        ([("rest", "eager")], r"options=\{\"memory_budget\": 0\.5, \"rest\": \"eager\"\}"),
    ],
)
def test_options_that_are_not_a_dict_say_so_and_show_the_dict(options, shown):
    with pytest.raises(OptionError, match=r"seqfast options must be a dict .*" + shown):
        Options.resolve(options, environ={})


def test_unknown_names_of_any_type_are_listed():
    with pytest.raises(OptionError, match=r"unknown seqfast option\(s\) 'bogus', 1;"):
        Options.resolve({1: 2, "bogus": 3}, environ={})


def test_dump_dir_is_checked_when_the_options_are_read(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OptionError, match=r"dump_dir.* cannot hold the dump: it is a file"):
        Options.resolve({"dump_dir": str(a_file)}, environ={})
    with pytest.raises(OptionError, match=r"^SEQFAST_DUMP_DIR = .* is a file, so no folder"):
        Options.resolve({}, environ={"SEQFAST_DUMP_DIR": str(a_file / "dump")})
    with pytest.raises(OptionError, match=r"dump_dir.* must be a folder path"):
        Options.resolve({"dump_dir": ""}, environ={})
    deep = tmp_path / "not" / "yet"
    assert Options.resolve({"dump_dir": deep}, environ={}).dump_dir == str(deep)
    assert not deep.exists()  # made at the first dump, not when the options are read


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any folder")
def test_a_dump_dir_that_is_not_writable_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OptionError, match=r"is not writable"):
        Options.resolve({"dump_dir": str(locked / "dump")}, environ={})


def test_budget_errors_name_where_each_value_came_from():
    env = {"SEQFAST_MEMORY_BUDGET": "0.5", "SEQFAST_CHECKPOINT": "none"}
    with pytest.raises(OptionError, match=r"^SEQFAST_MEMORY_BUDGET = 0\.5 needs SEQFAST_CHECK"):
        Options.resolve({}, environ=env)
    with pytest.raises(OptionError, match=r'^options\["memory_budget"\] = .* needs SEQFAST_CHE'):
        Options.resolve({"memory_budget": 0.5}, environ={"SEQFAST_CHECKPOINT": "none"})


def test_torch_compile_raises_value_error_for_bad_options():
    with pytest.raises(ValueError, match="valid options are"):
        torch.compile(lambda x: x + 1, backend="seqfast", options={"bogus": 1})(torch.randn(2))


def test_options_are_checked_at_the_first_call_not_at_torch_compile():
    """Dynamo hands a backend its options only when it compiles a graph, at the first call."""
    compiled = torch.compile(lambda x: x + 1, backend="seqfast", options="memory_budget=0.5")
    with pytest.raises(ValueError, match=r"must be a dict .*\{'memory_budget': '0\.5'\}"):
        compiled(torch.randn(2))


def test_an_environment_error_at_compile_names_the_variable(monkeypatch):
    monkeypatch.setenv("SEQFAST_LOSS_CHUNK", "many")
    with pytest.raises(ValueError, match=r"^SEQFAST_LOSS_CHUNK must be a whole number"):
        torch.compile(lambda x: x + 1, backend="seqfast")(torch.randn(2))
