"""Shared test setup: Triton's interpreter on machines without CUDA, a private kernel cache, eager
for the rest of each graph unless a test names Inductor, the per-dtype tolerance table, a fresh
Dynamo cache per test, a check that no test leaves global state changed, and the kernel tier: tests
marked `interpreter` run the generated kernels and fail unless every kernel their `kernels(...)`
mark names was launched."""

import logging
import os
import tempfile

import torch

if not torch.cuda.is_available():
    # Triton decides at import whether its library is interpreted; kernels still run only where a
    # test sets SEQFAST_INTERPRET=1 (the `interpret` fixture), the reference runs elsewhere.
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("SEQFAST_CACHE_DIR", tempfile.mkdtemp(prefix="seqfast-test-kernels-"))
KEPT = ("SEQFAST_CACHE_DIR", "SEQFAST_TEST_ROTATION")  # the test suite's own
for name in [n for n in os.environ if n.startswith("SEQFAST_") and n not in KEPT]:
    del os.environ[name]
# The rest of each graph runs eager unless a test names Inductor: an Inductor compile per graph
# would take most of the run. The CPU lowerings Inductor gets are tested where `rest` is named.
os.environ["SEQFAST_REST"] = "eager"
# On CUDA every launch runs its default configuration: tuning at each of the tests' many sizes
# would time every candidate again; the GPU tier tests each candidate and tuning itself.
os.environ["SEQFAST_AUTOTUNE"] = "0"
# An error while a pattern reads or rewrites a site fails the test instead of leaving the site
# unfused (a test that checks the lenient path unsets it with monkeypatch).
os.environ["SEQFAST_STRICT"] = "1"

import pytest  # noqa: E402

pytest_plugins = ["pytester"]  # tests/test_harness.py runs child suites with this conftest

import rotation  # noqa: E402

from seqcompile.codegen import counting_launches  # noqa: E402
from seqcompile.patterns.user import registered_patterns  # noqa: E402

TOLERANCES = {
    torch.float64: dict(atol=1e-9, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
    torch.bool: dict(atol=0, rtol=0),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None):
    """Compare with the tolerance of `dtype` (default: `expected`'s dtype), NaN exactly where
    `expected` has NaN."""
    tol = TOLERANCES[dtype or expected.dtype]
    torch.testing.assert_close(actual, expected, **tol, check_dtype=True, equal_nan=True)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


# --------------------------------------------------------------------------------------------
# global state: a test that changes it and does not put it back fails, naming what it left


def _global_state() -> dict[str, object]:
    configs = {
        "torch._dynamo.config": torch._dynamo.config,
        "torch._inductor.config": torch._inductor.config,
        "torch._functorch.config": torch._functorch.config,
    }
    state: dict[str, object] = {
        f"{name}.{key}": value
        for name, module in configs.items()
        for key, value in module.get_config_copy().items()
    }
    state.update(
        {
            # Inductor sets other TRITON_* variables (its cache, ptxas) on its first compile
            "environment": {
                k: v
                for k, v in os.environ.items()
                if k.startswith("SEQFAST_") or k == "TRITON_INTERPRET"
            },
            "grad mode": torch.is_grad_enabled(),
            "default dtype": torch.get_default_dtype(),
            "deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
            "user patterns": [p.name for p in registered_patterns()],
            "seqcompile logger level": logging.getLogger("seqcompile").level,
        }
    )
    return state


@pytest.fixture(autouse=True)
def global_state_is_left_alone():
    """Settings leaking out of one test change what later tests see: the cause of a suite that
    passes only in one order. Change them with torch's scoped `config.patch(...)`, `monkeypatch`
    for the environment, or a fixture that restores them."""
    before = _global_state()
    yield
    after = _global_state()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, "the test left global state changed: " + "; ".join(
        f"{k}: {before.get(k, '<unset>')!r} -> {after.get(k, '<unset>')!r}" for k in changed
    )


# --------------------------------------------------------------------------------------------
# the kernel tier

WITHOUT_CUDA = "the interpreter tier runs on machines without CUDA"
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason=WITHOUT_CUDA)
"""For tests that launch kernels under the interpreter themselves, outside the tier."""


@pytest.fixture
def interpret(request, monkeypatch):
    """Run fused ops on CPU tensors through the generated kernels (Triton's interpreter). A test
    using it is in the kernel tier (mark `interpreter`) and must name, with the mark `kernels`,
    the kernels it means to test."""
    if torch.cuda.is_available():
        pytest.skip(WITHOUT_CUDA)
    if request.node.get_closest_marker("interpreter") is None:
        pytest.fail("take `interpret` or `impl` as an argument, so the test joins the kernel tier")
    monkeypatch.setenv("SEQFAST_INTERPRET", "1")


@pytest.fixture(params=["reference", pytest.param("kernels", marks=pytest.mark.interpreter)])
def impl(request, monkeypatch):
    """Which implementation runs fused ops on CPU tensors, each test once per implementation;
    every kernel output starts as NaN."""
    monkeypatch.setenv("SEQFAST_POISON", "1")
    if request.param == "kernels":
        request.getfixturevalue("interpret")
    return request.param


KERNELS_IN_SLOW_TIER = pytest.mark.parametrize(
    "impl",
    ["reference", pytest.param("kernels", marks=(pytest.mark.interpreter, pytest.mark.slow))],
    indirect=True,
)
"""`impl`'s two paths, the kernels' in the slow tier: for sweeps whose kernel path another test of
the default run already takes (the default run has a time budget)."""


def expected_kernels(item: pytest.Item) -> tuple[str, ...] | None:
    """The kernels a kernel-tier test must launch (`LaunchCount.of` names; none: a test of what
    the kernel path does without launching, such as empty inputs). None outside the tier, or
    where the test names nothing."""
    if item.get_closest_marker("interpreter") is None:
        return None
    marker = item.get_closest_marker("kernels")
    return None if marker is None else marker.args


def pytest_report_header(config):
    return rotation.header()


KERNEL_PATHS_ROTATING = {"tests/ops/test_attention.py": 3}
"""Files whose `impl` sweeps take the kernel path of a part of their cases per run, in turn
(`tests/rotation.py`): the default run has a time budget, and the interpreter's attention is its
heaviest share."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = KERNEL_PATHS_ROTATING.get(item.nodeid.split("::")[0])
        params = getattr(getattr(item, "callspec", None), "params", {})
        if parts is not None and params.get("impl") == "kernels":
            item.add_marker(pytest.mark.rotating(parts))
    rotation.deselect(config, items)
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    unnamed = []
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "interpret" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.interpreter)
        if item.get_closest_marker("interpreter") and expected_kernels(item) is None:
            unnamed.append(item.nodeid)
    if unnamed:
        raise pytest.UsageError(
            "kernel-tier tests must name the kernels they launch with"
            " @pytest.mark.kernels('template' or 'template:mode', ...), or none with"
            " @pytest.mark.kernels(): " + ", ".join(unnamed)
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """In the kernel tier, count kernel launches during the test and fail it when a kernel its
    `kernels` mark names never ran (the reference ran instead, or nothing did), or when a test
    that names none launched one. A kernel that never ran is reported before any other failure
    of the test, as its cause (a count of what the launcher did fails too when it never ran)."""
    names = expected_kernels(item)
    if names is None or torch.cuda.is_available():
        return (yield)
    failure = None
    with counting_launches() as launches:
        try:
            result = yield
        except Exception as error:  # judged below: a kernel that never ran is the first cause
            failure = error
    missing = [name for name in names if launches.of(name) == 0]
    if missing:
        raise AssertionError(
            f"kernels {missing} were never launched; launches: {launches.names() or 'none'}"
        ) from failure
    if failure is not None:
        raise failure
    if not names and launches.names():
        raise AssertionError(f"the test names no kernel but launched {launches.names()}")
    return result
