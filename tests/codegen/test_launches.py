"""Launch counts of generated kernels, and the kernel tier that relies on them: with the reference
running where the kernels should, every kernel-tier test must fail."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import needs_interpreter

from seqcompile.codegen import KernelSpec, counting_launches, kernel_function, recording_launches
from seqcompile.ops.add_norm import kernels as norm

TESTS = Path(__file__).resolve().parents[1]


def column_sum(fn):
    partial = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    first, second = torch.empty(4), torch.empty(4, dtype=torch.float16)
    fn[(1, 2)](partial, first, second, None, 3, 4, 2, BLOCK_G=2, BLOCK_N=4)
    torch.testing.assert_close(first, partial[0].sum(0))
    torch.testing.assert_close(second, partial[1].sum(0).half())


@needs_interpreter
def test_launches_are_counted_per_kernel_while_a_count_is_open():
    fn = kernel_function(norm.COLUMN_SUM)
    column_sum(fn)  # before any count is open: counted nowhere
    with counting_launches() as outer:
        column_sum(fn)
        with counting_launches() as inner:
            column_sum(fn)
    column_sum(fn)
    assert outer.of("column_sum") == 2 and inner.of("column_sum") == 1
    assert outer.names() == {"column_sum": 2}
    (file,) = outer.files()
    assert file.startswith("column_sum_") and outer.files()[file] == 2
    assert outer.of("add_norm_fwd") == 0


@needs_interpreter
def test_a_recorded_launch_is_typed_as_tritons_launcher_types_it():
    """Tensors by their dtype, ints by their value (1 a constant, as Triton specializes it), the
    `tl.constexpr` parameters as constants, and the compile options apart."""
    fn = kernel_function(norm.COLUMN_SUM)
    partial, out, half = torch.zeros(2, 3, 4), torch.empty(4), torch.empty(4).half()
    with recording_launches() as record, counting_launches() as count:
        fn[(1, 2)](partial, out, half, out, 3, 1, 2, BLOCK_G=2, BLOCK_N=4, num_warps=2)
    (launch,) = record
    assert count.names() == {"column_sum": 1} and launch.spec == norm.COLUMN_SUM
    assert dict(launch.signature) == {
        "PARTIAL": "*fp32", "OUT0": "*fp32", "OUT1": "*fp16", "OUT2": "*fp32", "G": "i32",
        "N": "constexpr", "K": "constexpr", "BLOCK_G": "constexpr", "BLOCK_N": "constexpr",
    }  # fmt: skip
    assert dict(launch.constexprs) == {"N": 1, "K": 2, "BLOCK_G": 2, "BLOCK_N": 4}
    assert "PARTIAL" in launch.aligned and "G" not in launch.aligned
    assert launch.options == (("num_warps", 2),)
    assert launch.arguments["PARTIAL"] is partial


def test_a_kernel_is_named_by_its_template_and_mode():
    assert KernelSpec.of("column_sum").name == "column_sum"
    assert KernelSpec.of("cross_entropy", mode="backward").name == "cross_entropy:backward"


@needs_interpreter
def test_a_launch_that_fails_is_not_counted():
    fn = kernel_function(norm.COLUMN_SUM)
    with counting_launches() as count, pytest.raises(Exception):  # noqa: B017 (Triton's own)
        fn[(1,)](torch.zeros(1))  # too few arguments
    assert count.names() == {}


REFERENCE_ON_CPU = textwrap.dedent(
    """
    import json
    import sys

    import pytest

    import seqcompile.run.runtime

    # the mutation: fused ops on CPU tensors run the reference, even under SEQFAST_INTERPRET=1
    seqcompile.run.runtime.use_kernels = lambda tensor: tensor.device.type == "cuda"


    class Record:
        \"\"\"Each test's `kernels` mark, outcome and failure text, written to argv[1].\"\"\"

        def __init__(self):
            self.tests = {}

        def pytest_collection_finish(self, session):
            for item in session.items:
                mark = item.get_closest_marker("kernels")
                self.tests[item.nodeid] = {
                    "kernels": list(mark.args) if mark else None,
                    "xfail": item.get_closest_marker("xfail") is not None,
                }

        def pytest_runtest_logreport(self, report):
            if report.when == "call" or not report.passed:
                self.tests[report.nodeid].update(
                    outcome=report.outcome, failure=str(report.longrepr) if report.failed else ""
                )

        def pytest_sessionfinish(self):
            with open(sys.argv[1], "w") as f:
                json.dump(self.tests, f)


    sys.exit(pytest.main(sys.argv[2:], plugins=[Record()]))
    """
)


@pytest.mark.slow
@needs_interpreter
def test_every_kernel_tier_test_fails_when_the_reference_runs_instead_of_the_kernels(tmp_path):
    """The kernel tier's outputs match the reference, so only the launch counts tell whether the
    kernels ran: under a mutation that sends CPU tensors to the reference, every test of the tier
    that names kernels must fail, and fail for that reason."""
    record = tmp_path / "tier.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = subprocess.run(
        [sys.executable, "-c", REFERENCE_ON_CPU, str(record), "-m", "interpreter and not slow",
         "-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(TESTS)],
        capture_output=True, text=True, cwd=TESTS.parent, env=env, timeout=600,
    )  # fmt: skip
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert record.exists(), output
    tests = json.loads(record.read_text())
    # (an expected failure fails either way: its outcome cannot tell which implementation ran)
    naming = {name: t for name, t in tests.items() if t["kernels"] and not t["xfail"]}
    for family in ("attention", "norm", "pointwise", "cross_entropy"):  # each op's own tests
        assert any(f"tests/ops/test_{family}.py::" in name for name in naming), output
    not_failed = [name for name, t in naming.items() if t.get("outcome") != "failed"]
    assert not not_failed, f"passed with the reference running instead: {not_failed}"
    other = {
        n: t["failure"][-500:] for n, t in naming.items() if "never launched" not in t["failure"]
    }
    assert not other, f"failed for another reason: {other}"
