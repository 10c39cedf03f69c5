"""The fuzzer's records: each passing program's fusion counts and refusals, summed up at the end
of the run (per family, what fused against what README.md promises, the refusal reasons seen,
and the programs where nothing fused)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

RECORDS = pytest.StashKey[list]()


@pytest.fixture
def fusion_records(request: pytest.FixtureRequest) -> list:
    """(program, fusion counts, refusals) of every program checked in this run."""
    return request.config.stash.setdefault(RECORDS, [])


def pytest_terminal_summary(terminalreporter, config) -> None:
    records = config.stash.get(RECORDS, None)
    if not records:
        return
    write = terminalreporter.write_line
    fused, promised, reasons = Counter(), Counter(), Counter()
    for program, counts, missed in records:
        fused.update(counts)
        promised.update(program.promised)
        # sizes and node names vary from program to program; the reason's words do not
        reasons.update(re.sub(r"\d+", "N", m) for m in missed)
    blocks = sum(program.blocks for program, _, _ in records)
    terminalreporter.section("differential fuzzer")
    write(f"{len(records)} programs passed, {blocks} blocks")
    for family in sorted(fused.keys() | promised.keys()):
        write(f"  {family}: fused {fused[family]}, promised {promised[family]}")
    if reasons:
        write("refusals seen:")
        for reason, n in reasons.most_common():
            write(f"  {n:4d} x {reason}")
    nothing = [program.summary for program, counts, _ in records if not +counts]
    if nothing:
        write("programs where nothing fused:")
        for summary in nothing:
            write(f"  {summary}")
