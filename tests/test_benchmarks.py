"""The benchmark scripts run end to end at toy sizes, so a GPU session finds them working."""

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import KERNEL_BENCHMARKS, MODEL_BENCHMARKS
from benchmarks.headline import headline_table

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a minute in all: CI runs them when it runs each file


@pytest.mark.parametrize("module", [*dict.fromkeys(KERNEL_BENCHMARKS.values()), *MODEL_BENCHMARKS])
def test_benchmark_quick_run_writes_a_table(module, tmp_path):
    text = quick_run(module, tmp_path)
    assert "device: cpu" in text
    assert "| eager |" in text and "| seqfast |" in text


def test_the_step_profile_groups_the_time_and_says_what_each_fused_call_runs(tmp_path):
    text = quick_run("benchmarks.step_profile", tmp_path)
    assert "| matmuls |" in text and "| host ms to enqueue a step |" in text
    assert re.search(r"^- add_norm forward: kernel, [a-z ]+: \d+$", text, re.MULTILINE), text


def test_the_train_step_runs_each_model_in_each_mode(tmp_path):
    text = quick_run("benchmarks.train_step", tmp_path)
    for model in ("demo", "gpt2-sdpa", "llama"):
        assert f"| {model} | seqfast reduce-overhead |" in text
    assert "MISMATCH" not in text


@pytest.mark.kernels("attention_fwd", "attention_bwd_dkdv:with_dq", "attention_bwd_dq")
def test_the_attention_benchmark_runs_the_backward_each_way(interpret):
    """The rows "seqfast(one launch)" and "seqfast(two launches)" (on CUDA) run the backward's
    kernels of that way, and leave the op's choice as it was."""
    from benchmarks import attention_executors as bench
    from benchmarks.attention import forward_backward
    from benchmarks.attention_cases import Case, make_inputs
    from seqcompile.codegen.launches import counting_launches

    case = Case(length=20, head_dim=16, batch=1, heads=2, causal=True, p=0.0, bias="none")
    inputs = make_inputs(case, torch.float32, torch.device("cpu"))
    choice = bench.attention_kernels.backward_variants
    for name, dq in (("seqfast(one launch)", 0), ("seqfast(two launches)", 1)):
        with counting_launches() as launches, bench.backward_forced(name):
            forward_backward(functools.partial(bench.seqfast_attention, case=case), inputs, True)
        assert launches.of("attention_bwd_dq") == dq, name
        assert launches.of("attention_bwd_dkdv:with_dq") == 1 - dq, name
    assert bench.attention_kernels.backward_variants is choice


def test_the_attention_benchmark_checks_flex_and_grouped_heads(tmp_path):
    """FlexAttention runs each case without dropout on the same mask (forward only on CPU) and is
    checked before it is timed; the grouped-query case runs every executor."""
    text = quick_run("benchmarks.attention", tmp_path)
    for bias in ("none", "pad", "tri"):
        assert re.search(rf"\| 0 \| {bias} \| flex \| [0-9.e-]+ \|.*rel err", text), bias
    assert "| 0.1 | none | flex |" in text and "not taken: FlexAttention has no dropout" in text
    for executor in ("flex", "seqfast", "eager"):
        assert re.search(rf"\| 1x2/1 \| True \| 0 \| none \| {executor} \|.*rel err", text)
    assert "MISMATCH" not in text


def test_the_score_modifications_benchmark_checks_every_executor_it_times(tmp_path):
    text = quick_run("benchmarks.attention_mods", tmp_path)
    for mod in ("causal", "window", "softcap", "alibi", "t5 buckets", "documents"):
        assert f"| 64 | {mod} | seqfast |" in text and f"| 64 | {mod} | flex |" in text
    assert "rel err" in text and "MISMATCH" not in text and "FAILED" not in text


def test_the_plans_benchmark_compares_both_planners_without_a_device(tmp_path):
    text = quick_run("benchmarks.memory_plans", tmp_path)
    assert "device: none: compiled on the meta device" in text
    assert "| seqfast | 0.25 |" in text and "| torch's min-cut | 0.25 |" in text


def test_the_host_cost_benchmark_times_each_fused_call_a_step_makes(tmp_path):
    """A replayed call per fused call of the step: one attention forward and backward per layer,
    and the launches the stubs counted."""
    text = quick_run("benchmarks.host_overhead", tmp_path, options=())
    calls, launches = map(
        int, re.search(r"per step: (\d+) fused calls, (\d+) launches", text).groups()
    )
    rows = re.findall(r"^\| seqfast\.(\w+)\.default \| (\d+) \|", text, re.MULTILINE)
    assert sum(int(n) for _, n in rows) == calls and launches > 0
    assert {"attention": "2", "attention_backward": "2"}.items() <= dict(rows).items()
    traced = re.search(
        r"the executor launches them\): (\d+) fused calls per step .*, (\d+) launches", text
    )
    # on CPU only the loss's check of its targets, a host read, keeps its call an op call
    assert traced is not None and int(traced[1]) <= 1 and int(traced[2]) == launches, text
    dynamic = re.search(
        r"at symbolic sizes, a step at another length \((\d+) graphs compiled again\): (\d+) fused"
        r" calls",
        text,
    )
    assert dynamic is not None and int(dynamic[1]) == 0 and int(dynamic[2]) <= 1, text
    planned = re.findall(r"^\| seqfast\.(\w+)\.default \|(?: [^|]+ \|){3} ([^|]+) \|", text, re.M)
    assert dict(planned)["attention"].strip() != "not traced", "the attention call is planned"


def test_compile_time_is_measured_cold_and_warm_for_both_executors(tmp_path):
    text = quick_run("benchmarks.compile_time", tmp_path, options=())
    for executor in ("inductor", "seqfast"):
        assert re.search(rf"^\| {executor} \| [\d.]+ \| [\d.]+ \|", text, re.MULTILINE), text


def quick_run(module, tmp_path, options=("--no-inductor",)):
    """The markdown `module --quick` writes, after checking it exited cleanly."""
    output = tmp_path / "results.md"
    result = subprocess.run(
        [sys.executable, "-m", module, "--quick", *options, "--output", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    text = output.read_text()
    assert f"command: `python -m {module} --quick" in text
    return text


def test_the_headline_reads_each_measure_from_a_sessions_tables():
    """On a committed GPU session's results: each value is its table's, for the first case; a
    table the session did not reach is said to be missing."""
    text = (ROOT / "benchmarks" / "results" / "nvidia-h200.md").read_text()
    train_step = "\n".join(
        [
            "## Training step, GPT-2-small scale, bf16 autocast",
            "",
            "| model | executor | tokens/s | peak GiB | check |",
            "|---|---|---|---|---|",
            "| demo | eager | 1e+05 | 12 | the reference |",
            "| demo | inductor | 2.65e+05 | 12.1 | ok |",
            "| demo | seqfast | 1.09e+05 | 5.25 | ok |",
            "| llama | eager | 9e+04 | 14 | the reference |",
            "| llama | inductor | 2e+05 | 13 | ok |",
            "| llama | seqfast | 2.2e+05 | 9 | MISMATCH |",
            "",
        ]
    )
    text = text.replace("## Training step", "## (an older table) Training step")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in headline_table(train_step + text)}
    train = rows["demo GPT train step: tokens/s"].split(" | ")
    assert train[1:6] == ["1e+05", "2.65e+05", "-", "-", "1.09e+05"] and train[6] == "0.41x"
    assert rows["demo GPT train step: peak GiB"].split(" | ")[6] == "2.29x"
    llama = rows["LLaMA-style train step: tokens/s"].split(" | ")
    assert llama[6] == "1.10x" and llama[7].startswith("MISMATCH")
    assert "no such case in this run" in rows["GPT-2 (SDPA) train step: tokens/s"]
    on_a_cpu = train_step.replace("| 5.25 |", "| 0 |")  # a CPU reports no peak
    cpu = {line.split(" | ")[0].lstrip("| "): line for line in headline_table(on_a_cpu)}
    assert cpu["demo GPT train step: peak GiB"].split(" | ")[6] == "-"
    attention = rows["attention fwd+bwd ms, bf16, no mask"]
    assert "| 6.31 |" in attention and "| 14.8 |" in attention and "L 4096, D 128" in attention
    assert "not measured in this run" in rows["attention fwd+bwd ms, causal"]
    assert all("not measured" in line for line in headline_table("") if "train step" in line)
