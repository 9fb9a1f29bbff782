"""The analysis as rewritten for scale (issue 14: records streamed into numpy columns, telemetry as per-series
arrays) gives the summary the old path gave on the same run directories — every key, every float, key order too.

The expected summaries were written by the code before the rewrite (tests/data/summary_golden/README.md), so this
compares against the old way itself, not against a second copy of the new one."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import pytest

from kvcap.analysis.summary import build_summary
from kvcap.rundir import RunDir
from kvcap.rundir.store.column_reader import read_columns
from tests.conftest import ROOT

GOLDEN = ROOT / "tests" / "data" / "summary_golden"


def _trends_to_9_digits(summary: dict[str, Any]) -> dict[str, Any]:
    """A change made on purpose since: a stationarity trend's figures are given to 9 significant digits
    (the same whether a long level's samples were summed whole or in slices), so the old figures are too."""
    for lv in summary["levels"]:
        st = lv.get("stationarity") or {}
        for k, v in st.items():
            if isinstance(v, float):
                st[k] = float(f"{v:.9g}")
    return summary


def _counters_read_at_edges(summary: dict[str, Any]) -> dict[str, Any]:
    """Another on purpose: a counter's increase over a level counts the samples just outside its window
    (``counter_increase``), so a level with one sample of the preemptions counter inside — 0, an int, before — now
    has its increase, a float (the counter never moves in these runs)."""
    for lv in summary["levels"]:
        if "preemptions" in lv:
            lv["preemptions"] = float(lv["preemptions"])
    return summary


@pytest.mark.parametrize("which", ["sim", "bench"])
@pytest.mark.parametrize("chunk_bytes", [None, 4096])
def test_the_new_analysis_gives_the_old_summary(which: str, chunk_bytes: int | None) -> None:
    run = GOLDEN / which
    expected = _counters_read_at_edges(_trends_to_9_digits(json.loads((run / "summary.expected.json").read_text())))
    reader = partial(read_columns, chunk_bytes=chunk_bytes) if chunk_bytes else None
    got = json.loads(json.dumps(build_summary(RunDir(run), reader=reader).to_json()))
    assert got == expected
    assert json.dumps(got) == json.dumps(expected)
    # the runs hold what the comparison is about: errors of several classes, ITLs, telemetry by node
    levels = got["levels"]
    assert sum(lv["errors"] for lv in levels) > 0 and all(lv["itl_ms"]["p50"] for lv in levels)
    assert got["capacity"]["resident"] is not None
