"""Where fused ops run, and the error when the interpreter was asked for too late."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from seqcompile.run import runtime


def test_cpu_tensors_use_the_reference_unless_interpreting(monkeypatch):
    monkeypatch.delenv("SEQFAST_INTERPRET", raising=False)
    assert not runtime.use_kernels(torch.zeros(1))
    monkeypatch.setenv("SEQFAST_INTERPRET", "1")
    assert runtime.use_kernels(torch.zeros(1))
    assert not runtime.use_kernels(torch.zeros(1, device="meta"))


def test_poison_fills_outputs_with_nan(monkeypatch):
    monkeypatch.setenv("SEQFAST_POISON", "1")
    cpu = torch.device("cpu")
    assert runtime.empty((3,), torch.float32, cpu).isnan().all()
    # outputs that cannot hold NaN (a bucketed position region) get a value no kernel writes
    assert (runtime.empty((3,), torch.int64, cpu) == torch.iinfo(torch.int64).max).all()
    assert (runtime.empty((3,), torch.int8, cpu) == 127).all()
    assert runtime.empty((3,), torch.bool, cpu).all()


@pytest.mark.slow
def test_interpreter_requested_after_triton_was_imported_says_what_to_do():
    script = textwrap.dedent(
        """
        import torch, torch._dynamo  # imports Triton without its interpreter
        import seqcompile.ops.add_norm
        x = torch.randn(2, 8)
        try:
            torch.ops.seqfast.add_norm(x, None, None, None, None, None, 0, 0.0, 1e-5, True,
                                       torch.float32, torch.float32)
        except RuntimeError as error:
            print(error)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["SEQFAST_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert "Set TRITON_INTERPRET=1 in the environment" in result.stdout, result.stderr[-2000:]


@pytest.mark.slow
def test_seqfast_interpret_set_before_import_turns_the_interpreter_on():
    script = "import seqcompile, os; print(os.environ.get('TRITON_INTERPRET'))"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["SEQFAST_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.stdout.strip() == "1", result.stderr
