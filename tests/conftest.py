"""Shared test setup: Triton's interpreter on machines without CUDA, a private kernel cache, the
per-dtype tolerance table, and a fresh Dynamo cache per test."""

import os
import tempfile

import torch

if not torch.cuda.is_available():
    # Triton decides at import whether its library is interpreted; kernels still run only where a
    # test sets SEQFAST_INTERPRET=1 (the `interpret` fixture), the reference runs elsewhere.
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("SEQFAST_CACHE_DIR", tempfile.mkdtemp(prefix="seqfast-test-kernels-"))
for name in [n for n in os.environ if n.startswith("SEQFAST_") and n != "SEQFAST_CACHE_DIR"]:
    del os.environ[name]

import pytest  # noqa: E402

TOLERANCES = {
    torch.float64: dict(atol=1e-9, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None):
    """Compare with the tolerance of `dtype` (default: `expected`'s dtype)."""
    tol = TOLERANCES[dtype or expected.dtype]
    torch.testing.assert_close(actual, expected, **tol, check_dtype=True)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield


@pytest.fixture
def interpret(monkeypatch):
    """Run fused ops on CPU tensors through the generated kernels (Triton interpreter)."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter tier runs on machines without CUDA")
    monkeypatch.setenv("SEQFAST_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
