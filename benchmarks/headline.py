"""The GPU session's headline: the few numbers that say where seqfast stands, read from the tables
the benchmarks appended to one results file in the same run (each row there was checked against
its reference before it was timed; the check column says how it went).

    python -m benchmarks.headline RESULTS_MD

A measure whose table is missing (its step did not run or was cut short) says so.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from pathlib import Path

from benchmarks.common import cell, table


@dataclasses.dataclass(frozen=True)
class Headline:
    label: str
    section: str
    """The start of the table's section title."""
    where: Mapping[str, str]
    """Column values a row must have; the first matching case (the columns before `executor`)
    is the one shown."""
    column: str
    higher_is_better: bool


HEADLINES = [
    Headline("demo GPT train step: tokens/s", "Training step", {"model": "demo"}, "tokens/s", True),
    Headline(
        "demo GPT train step: peak GiB", "Training step", {"model": "demo"}, "peak GiB", False
    ),
    Headline(
        "GPT-2 (SDPA) train step: tokens/s",
        "Training step",
        {"model": "gpt2-sdpa"},
        "tokens/s",
        True,
    ),
    Headline(
        "LLaMA-style train step: tokens/s", "Training step", {"model": "llama"}, "tokens/s", True
    ),
    Headline(
        "attention fwd+bwd ms, bf16, no mask",
        "Fused attention",
        {"causal": "False", "p": "0", "bias": "none"},
        "fwd+bwd ms",
        False,
    ),
    Headline(
        "attention fwd+bwd ms, causal",
        "Attention score modifications",
        {"modification": "causal"},
        "fwd+bwd ms",
        False,
    ),
    Headline(
        "residual + LayerNorm fwd+bwd: of copy bandwidth",
        "Fused residual + norm",
        {"norm": "layer", "pass": "fwd+bwd"},
        "of copy bw",
        True,
    ),
    Headline(
        "linear + cross-entropy: peak MiB",
        "Fused loss",
        {"case": "linear+cross-entropy"},
        "peak MiB",
        False,
    ),
]
OTHERS = {"eager": "eager", "inductor": "Inductor", "sdpa": "SDPA", "flex": "FlexAttention"}
"""Executors shown beside seqfast, by the start of their name in the tables."""


def sections(text: str) -> dict[str, list[dict[str, str]]]:
    """Each `## ` section's first table, as rows by column name."""
    found: dict[str, list[dict[str, str]]] = {}
    title, header = None, None
    for line in text.splitlines():
        if line.startswith("## "):
            title, header = line[3:].strip(), None
        elif title and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
                found.setdefault(title, [])
            elif len(cells) == len(header) and found.get(title) is not None:
                found[title].append(dict(zip(header, cells, strict=True)))
        elif header is not None and not line.strip():
            title = None  # the section's first table ended
    return found


def headline_row(headline: Headline, tables: dict[str, list[dict[str, str]]]) -> list[object]:
    rows = next((r for t, r in tables.items() if t.startswith(headline.section)), None)
    empty = ["-"] * len(OTHERS)
    if not rows:
        return [headline.label, *empty, "-", "-", "not measured in this run"]
    matching = [r for r in rows if all(r.get(k) == v for k, v in headline.where.items())]
    if not matching:
        return [headline.label, *empty, "-", "-", "no such case in this run"]
    case_columns = list(matching[0])[: list(matching[0]).index("executor")]
    case = [r for r in matching if all(r[c] == matching[0][c] for c in case_columns)]
    values = {r["executor"]: r.get(headline.column, "-") for r in case}
    seqfast = values.get("seqfast", "-")
    others = [next((v for e, v in values.items() if e.startswith(k)), "-") for k in OTHERS]
    numbers = [float(v) for v in others if _is_number(v)]
    versus = "-"
    if numbers and _is_number(seqfast) and float(seqfast) and all(numbers):  # (0: not measured)
        best = max(numbers) if headline.higher_is_better else min(numbers)
        ratio = float(seqfast) / best if headline.higher_is_better else best / float(seqfast)
        versus = f"{ratio:.2f}x"
    checks = [r.get("check", "") for r in case if r["executor"] != matching[0]["executor"]]
    bad = [c for c in checks if c.startswith(("MISMATCH", "FAILED"))]
    where = ", ".join(f"{c} {matching[0][c]}" for c in case_columns)
    checked = f"checked ({where})" if where else "checked"
    return [headline.label, *others, seqfast, versus, "; ".join(bad) or checked]


def headline_table(text: str) -> list[str]:
    tables = sections(text)
    rows = [headline_row(h, tables) for h in HEADLINES]
    columns = ["measure", *OTHERS.values(), "seqfast", "seqfast vs best other", "case, check"]
    lines = ["## Headline", ""]
    lines += [
        "From the tables below, measured in this run on this device. 'seqfast vs best other':"
        " above 1x seqfast is ahead of the best of the others shown.",
        "",
    ]
    return lines + table(columns, [[cell(v) for v in row] for row in rows])


def _is_number(value: object) -> bool:
    try:
        float(str(value))
    except ValueError:
        return False
    return True


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    path = Path(sys.argv[1])
    text = path.read_text() if path.exists() else ""
    print("\n".join(headline_table(text)))


if __name__ == "__main__":
    main()
