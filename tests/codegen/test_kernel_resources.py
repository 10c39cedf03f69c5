"""The static resource report: the attention and norm kernels, compiled for sm_90 at their default
launch configurations with no GPU, spill nothing at head dims up to 128 and norm widths up to 8192,
in bf16, fp16 and fp32; in 16 bits the attention products run on wgmma; the backward's default
number of launches issues the fewer instructions."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes of Triton's compiler: CI runs it when it runs each file

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["kernels", "kernel", "dtype", "size", "config", "registers", "spilled bytes"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    """The report at the default configurations, head dims 64 and 128."""
    output = tmp_path_factory.mktemp("resources") / "resources.md"
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SEQFAST_INTERPRET")
    }
    command = ["-m", "benchmarks.kernel_resources", "--defaults", "--head-dims", "64,128"]
    result = subprocess.run(
        [sys.executable, *command, "--output", str(output)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return output.read_text()


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in `text`, by column name."""
    lines = text[text.index("\n| ") + 1 :].split("\n\n")[0].splitlines()
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]


@pytest.fixture(scope="module")
def rows(report):
    """The report's rows, by column name."""
    found = table_rows(report)
    assert list(found[0])[: len(COLUMNS)] == COLUMNS
    return found


@pytest.fixture(scope="module")
def dropout_costs(report):
    """The report's second table: what dropout costs each attention kernel."""
    return table_rows(report.split("Dropout's cost")[1])


def test_every_kernel_and_dtype_is_in_the_report(rows):
    seen = {(row["kernel"], row["dtype"]) for row in rows}
    attention = ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dkdv:with_dq")
    for kernel in (*attention, "attention_bwd_dq", "add_norm_fwd"):
        for dtype in ("bf16", "fp16", "fp32"):
            assert (kernel, dtype) in seen
    assert {row["size"] for row in rows if row["kernel"] == "add_norm_bwd"} == {
        "768", "1024", "2048", "4096", "8192",
    }  # fmt: skip
    assert all(row["config"].startswith("* ") for row in rows)  # defaults only


def test_the_report_gives_what_dropout_costs_each_attention_kernel(rows, dropout_costs):
    """One row per attention kernel, dtype and head dim with dropout, its cost over the same
    kernel without: above 1 where both run one configuration (dropout adds instructions, never
    removes them; another configuration may issue fewer per score)."""
    drawn = [r for r in rows if r["kernels"].endswith(", dropout") and "attention" in r["kernels"]]
    assert len(dropout_costs) == len(drawn) > 0
    same = [row for row in dropout_costs if not row["other configuration"]]
    assert same and all(float(row["with / without"]) > 1 for row in same)


@pytest.fixture(scope="module")
def backward_costs(report):
    """The report's third table: the backward in one launch and in two."""
    return table_rows(report.split("The backward's cost")[1])


def test_the_backward_runs_in_one_launch_by_default_where_it_issues_less(rows, backward_costs):
    """One row per attention case, dtype and head dim; where one launch is the default it issues
    fewer instructions per score than the two launches together (the evidence the default
    stands on), and it is the default in 16 bits at head dim 64."""
    cases = {(r["kernels"], r["dtype"], r["size"]) for r in rows if "attention" in r["kernels"]}
    assert {(r["kernels"], r["dtype"], r["size"]) for r in backward_costs} == cases
    for row in backward_costs:
        if row["default launches"] == "one":
            assert float(row["one / two"]) < 1, row
    sixteen_bits = [r for r in backward_costs if r["dtype"] != "fp32" and r["size"] == "64"]
    assert sixteen_bits and all(r["default launches"] == "one" for r in sixteen_bits)


def test_no_default_configuration_spills(rows):
    spilling = [row for row in rows if row["spilled bytes"] != "0"]
    assert not spilling, [(r["kernels"], r["kernel"], r["dtype"], r["size"]) for r in spilling]


def test_attention_in_16_bits_runs_its_products_on_wgmma(rows):
    """Every product on wgmma, but for dkdv with dropout and dkdv adding dq at head dim 128: there
    their all-wgmma tiles spill (dropout's Philox rounds, dq's tile hold registers), so they take
    32-query tiles, whose scores (32 rows) run on mma.sync."""
    for row in rows:
        if not row["kernel"].startswith("attention") or row["dtype"] == "fp32":
            continue
        assert int(row["wgmma"]) > 0, row
        mixed = "dropout" in row["kernels"] and row["kernel"] == "attention_bwd_dkdv"
        mixed = mixed or row["kernel"] == "attention_bwd_dkdv:with_dq"
        if not (mixed and row["size"] == "128"):
            assert row["mma.sync"] == "0", row
