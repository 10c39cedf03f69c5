"""Sweeps too long to run whole in every CI run take one part of their cases per run, in turn,
so that every case runs within as many runs as there are parts (the mark `rotating(parts)`).

Which part: the run's index modulo `parts`, the index being today's date (days since year 1), or
`SEQFAST_TEST_ROTATION=N`; `SEQFAST_TEST_ROTATION=all` runs every case. The cases of one test
function are dealt out in the order of their ids (case i in part i % parts), so each part holds
as many as the next, and a failing case reruns under the index the header printed."""

from __future__ import annotations

import datetime
import os

import pytest

ENV = "SEQFAST_TEST_ROTATION"


def run_index() -> int | None:
    """This run's index (None: every case runs)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value == "all":
        return None
    if value:
        try:
            return int(value)
        except ValueError:
            raise pytest.UsageError(f"{ENV} must be an integer or 'all'; got {value!r}") from None
    return datetime.date.today().toordinal()


def header() -> str:
    index = run_index()
    if index is None:
        return f"rotating sweeps: every case ({ENV}=all)"
    return (
        f"rotating sweeps: run index {index} (rerun with {ENV}={index}; every case with {ENV}=all)"
    )


def deselect(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the cases of rotating sweeps that are not this run's part."""
    index = run_index()
    if index is None:
        return
    groups: dict[tuple[str, str], list[str]] = {}
    for item in items:
        if item.get_closest_marker("rotating") is not None:
            groups.setdefault(_function(item), []).append(item.nodeid)
    # dealt by id, not by the collection's order, which pytest-randomly shuffles
    position = {nodeid: i for ids in groups.values() for i, nodeid in enumerate(sorted(ids))}
    kept, left = [], []
    for item in items:
        marker = item.get_closest_marker("rotating")
        mine = marker is None or position[item.nodeid] % marker.args[0] == index % marker.args[0]
        (kept if mine else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


def _function(item: pytest.Item) -> tuple[str, str]:
    return item.nodeid.split("::")[0], getattr(item, "originalname", item.name)
