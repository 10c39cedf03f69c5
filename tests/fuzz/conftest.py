"""The fuzzer's records: each passing program's fusion counts, refusals and attention readings,
summed up at the end of the run (per family, what fused against what the docs promise, the
refusal reasons seen, what attention computed or read and which readings the code refuted, and
the programs where nothing fused)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

RECORDS = pytest.StashKey[list]()


@pytest.fixture
def fusion_records(request: pytest.FixtureRequest) -> list:
    """(program, fusion counts, refusals, attention readings) of every program checked in this
    run."""
    return request.config.stash.setdefault(RECORDS, [])


def pytest_terminal_summary(terminalreporter, config) -> None:
    records = config.stash.get(RECORDS, None)
    if not records:
        return
    write = terminalreporter.write_line
    fused, promised, reasons, readings = Counter(), Counter(), Counter(), Counter()
    for program, counts, missed, read in records:
        readings.update(re.sub(r"\d+", "N", r) for r in read)
        fused.update(counts)
        promised.update(program.promised)
        # sizes and node names vary from program to program; the reason's words do not
        reasons.update(re.sub(r"\d+", "N", m) for m in missed)
    blocks = sum(program.blocks for program, *_ in records)
    terminalreporter.section("differential fuzzer")
    write(f"{len(records)} programs passed, {blocks} blocks")
    for family in sorted(fused.keys() | promised.keys()):
        write(f"  {family}: fused {fused[family]}, promised {promised[family]}")
    if reasons:
        write("refusals seen:")
        for reason, n in reasons.most_common():
            write(f"  {n:4d} x {reason}")
    if readings:
        write("attention readings (and readings refuted by evaluating the code):")
        for reading, n in sorted(readings.items()):
            write(f"  {n:4d} x {reading}")
    nothing = [program.summary for program, counts, *_ in records if not +counts]
    if nothing:
        write("programs where nothing fused:")
        for summary in nothing:
            write(f"  {summary}")
