"""The demo command trains with eager and seqfast and prints both curves and the report."""

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_prints_both_loss_curves_step_times_and_the_report():
    result = subprocess.run(
        [sys.executable, "-m", "seqcompile", "demo", "--steps", "3", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "eager loss" in out and "seqfast loss" in out
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 3
    assert "median step time" in out
    assert "fused sites:" in out
    assert re.search(r"^  attention +2\b", out, re.M) and re.search(r"^  norm +5\b", out, re.M)


@pytest.mark.slow
def test_demo_rejects_too_few_steps():
    result = subprocess.run(
        [sys.executable, "-m", "seqcompile", "demo", "--steps", "1"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--steps must be at least 2" in result.stderr
