"""The demo command trains with eager, Inductor and seqfast and prints the curves, step times,
kept memory and the report."""

import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_prints_the_loss_curves_step_times_kept_memory_and_the_report():
    environment = {k: v for k, v in os.environ.items() if k != "SEQFAST_REST"}  # as a user runs it
    result = subprocess.run(
        [sys.executable, "-m", "seqcompile", "demo", "--steps", "3", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"step +eager loss +inductor loss +seqfast loss", out)
    assert len([line for line in out.splitlines() if re.match(r" +\d+ ", line)]) == 3
    for row in ("median step time (ms)", "kept for the backward (MiB)"):
        (line,) = [line for line in out.splitlines() if line.startswith(row)]
        assert len([float(x) for x in line[len(row) :].split()]) == 3, line
    assert "carry over to CUDA" in out
    assert "fused sites:" in out
    assert re.search(r"^  attention +2\b", out, re.M) and re.search(r"^  norm +5\b", out, re.M)


@pytest.mark.slow
def test_demo_rejects_too_few_steps():
    result = subprocess.run(
        [sys.executable, "-m", "seqcompile", "demo", "--steps", "1"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--steps must be at least 2" in result.stderr
