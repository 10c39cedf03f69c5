"""The fixture the operator tests share: which implementation runs the op on CPU tensors."""

import pytest
import torch


@pytest.fixture(params=["reference", "kernels"])
def impl(request, monkeypatch):
    """Which implementation runs on CPU tensors; every output starts as NaN."""
    monkeypatch.setenv("SEQFAST_POISON", "1")
    if request.param == "kernels":
        if torch.cuda.is_available():
            pytest.skip("the interpreter tier runs on machines without CUDA")
        monkeypatch.setenv("SEQFAST_INTERPRET", "1")
    return request.param
