"""The rules tests/conftest.py enforces on every test: a kernel-tier test names the kernels it
launches and launches them, and a test leaves global state as it found it. Each rule is tried on
a small suite run by a child pytest with this conftest."""

import re
from pathlib import Path

import pytest
from conftest import needs_interpreter

pytestmark = pytest.mark.slow  # each test runs a child test session

TESTS = Path(__file__).resolve().parent

COLUMN_SUM = """
import pytest
import torch

from seqcompile.codegen import kernel_function
from seqcompile.ops.add_norm import kernels as norm


def column_sum():
    fn = kernel_function(norm.COLUMN_SUM)
    fn[(1, 1)](torch.ones(1, 1, 4), torch.empty(4), None, None, 1, 4, K=1, BLOCK_G=1, BLOCK_N=4)
"""


@pytest.fixture
def child(pytester):
    """A child pytest in its own process, with this suite's conftest."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(rotation=(TESTS / "rotation.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    interpreter\n    kernels\n    rotating\n")
    return pytester


def test_a_kernel_tier_test_that_names_no_kernels_stops_the_collection(child):
    child.makepyfile("def test_unnamed(interpret):\n    pass\n")
    result = child.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*must name the kernels they launch*test_unnamed*"])


@needs_interpreter
def test_the_kernels_a_test_names_are_the_kernels_it_launches(child):
    child.makepyfile(
        COLUMN_SUM
        + """
@pytest.mark.kernels("column_sum")
def test_launches_what_it_names(interpret):
    column_sum()


@pytest.mark.kernels("add_norm_fwd")
def test_never_launches_what_it_names(interpret):
    column_sum()


@pytest.mark.kernels()
def test_names_none_but_launches(interpret):
    column_sum()


def test_asks_for_the_interpreter_at_run_time(request):
    request.getfixturevalue("interpret")
"""
    )
    result = child.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*_ test_never_launches_what_it_names _*",
            "E *kernels ?'add_norm_fwd'? were never launched; launches: {'column_sum': 1}",
            "*_ test_names_none_but_launches _*",
            "E *the test names no kernel but launched {'column_sum': 1}",
            "*_ test_asks_for_the_interpreter_at_run_time _*",
            "E *take `interpret` or `impl` as an argument*",
        ]
    )


def test_a_test_that_leaves_global_state_changed_fails(child):
    child.makepyfile(
        """
import os

import torch


def test_sets_a_config():
    torch._inductor.config.fallback_random = not torch._inductor.config.fallback_random


def test_sets_a_variable():
    os.environ["SEQFAST_LOG"] = "debug"


def test_patches_a_config_for_a_while():
    with torch._inductor.config.patch(fallback_random=True):
        pass
"""
    )
    result = child.runpytest_subprocess("-p", "no:randomly")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*_ ERROR at teardown of test_sets_a_config _*",
            "E *left global state changed: torch._inductor.config.fallback_random: False -> True",
            "*_ ERROR at teardown of test_sets_a_variable _*",
            "E *left global state changed: environment: *'SEQFAST_LOG': 'debug'}",
        ]
    )


SETS_A_CONFIG = re.compile(
    r"monkeypatch\.setattr\(\s*[\"']?torch\.[\w.]*config\b"  # undone by deleting, in pytest 9.2
    r"|^\s*torch\.[\w.]*config\.\w+\s*=(?!=)",
    re.MULTILINE,
)


def test_tests_change_torch_configs_only_through_their_own_patch():
    offenders = []
    for path in TESTS.rglob("*.py"):
        if path == Path(__file__).resolve():  # its child suites break the rule on purpose
            continue
        text = path.read_text()
        for match in SETS_A_CONFIG.finditer(text):
            offenders.append(
                f"{path.relative_to(TESTS)}:{text.count(chr(10), 0, match.start()) + 1}"
            )
    assert not offenders, f"use torch's config.patch(...) instead: {offenders}"


def test_a_rotating_sweep_runs_every_case_once_over_its_parts(child, monkeypatch):
    child.makepyfile(
        """
import pytest

@pytest.mark.rotating(3)
@pytest.mark.parametrize("case", range(30))
def test_case(case):
    pass

def test_plain():
    pass
"""
    )
    ran = []
    for index in ("7", "8", "9", "all"):
        monkeypatch.setenv("SEQFAST_TEST_ROTATION", index)
        result = child.runpytest_subprocess("-v")  # (randomly shuffles the cases)
        assert result.ret == pytest.ExitCode.OK
        passed = re.findall(r"test_case\[(\d+)\] PASSED", result.stdout.str())
        assert "test_plain PASSED" in result.stdout.str()
        ran.append(sorted(map(int, passed)))
    parts, every = ran[:3], ran[3]
    assert every == list(range(30))
    assert sorted(sum(parts, [])) == every  # each case in exactly one part
    assert all(len(part) == 10 for part in parts), parts
