"""``kvcap sim`` summarises the columns it took from its records as it wrote them (issue 14), not a re-read of
``requests.jsonl``: the summary must be the file's on every key, and the in-hand path must really be the one
taken. Beside: the token-count shortcut (only records across a window's edge are timed token by token) and the
µs value counts against their plain numpy definitions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcap.analysis import live_columns
from kvcap.analysis.columns import _count_each_token, _count_tokens
from kvcap.analysis.live_columns import LiveColumns
from kvcap.analysis.quantiles import _value_counts
from kvcap.analysis.summary import build_summary
from kvcap.rundir import RunDir

from .conftest import ROOT, run_cli

SCENARIO = str(ROOT / "scenarios" / "seed-reference.yaml")
CASES = {
    "closed loop, warmup, two repeats": ["--concurrency", "4,16", "--requests", "150", "--warmup", "5s",
                                         "--repeats", "2"],
    "closed loop timed, parking": ["--set", "serving.kv_offload=remote", "--set", "serving.offload_admission=tiers",
                                   "--concurrency", "96", "--duration", "40s", "--warmup", "3s", "--repeats", "1"],
    "open loop, window cut mid-flight": ["--rate", "2,6", "--duration", "25s", "--warmup", "4s", "--repeats", "2"],
    "no per-token ITLs": ["--concurrency", "8", "--requests", "100", "--warmup", "0s", "--repeats", "1", "--no-itl"],
}


def _without_run_facts(summary: dict[str, Any]) -> str:
    summary = dict(summary)
    for key in ("sim", "interrupted"):
        summary.pop(key, None)
    return json.dumps(summary, sort_keys=True)


@pytest.mark.parametrize("case", list(CASES))
def test_the_runs_own_summary_is_the_files_on_every_key(case: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """In process (so the fallback can be watched): the columns in hand are used, and give the summary a fresh
    read of the written file gives."""
    from kvcap.cli import main

    fallbacks: list[int] = []
    read = live_columns.read_columns

    def watched(*args: Any, **kwargs: Any) -> Any:
        fallbacks.append(1)
        return read(*args, **kwargs)

    monkeypatch.setattr(live_columns, "read_columns", watched)
    out = tmp_path / "run"
    assert main(["sim", SCENARIO, *CASES[case], "--out", str(out), "--quiet"]) in (0, None)
    assert fallbacks == [], "the summary re-read requests.jsonl instead of using the columns in hand"
    written = json.loads((out / "summary.json").read_text())
    run = RunDir(out)
    fresh = build_summary(run, slo=run.manifest.get("slo") or {})
    assert written["levels"] and all(lv["requests"] > 0 for lv in written["levels"])
    assert _without_run_facts(written) == _without_run_facts(fresh)


def test_a_window_other_than_the_announced_one_falls_back_to_the_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = run_cli("sim", SCENARIO, "--concurrency", "4", "--requests", "60", "--warmup", "0s", "--repeats", "1",
                "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    run = RunDir(out)
    records = run.records()
    live = LiveColumns(chunk=16)
    live.open(("concurrency", 4.0), 0, 0.0)
    for rec in records:
        live.add(rec, 0.0)
    live.close((0.0, 1e9))  # not the window levels.jsonl holds
    fresh = build_summary(run, slo={})
    assert _without_run_facts(build_summary(run, slo={}, reader=live.reader)) == _without_run_facts(fresh)


def test_counting_only_the_records_across_an_edge_gives_every_tokens_count() -> None:
    """Random records (some without ITLs or a first token), windows anywhere, at a record's first token and at
    token times exactly: the shortcut equals the token-by-token count."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(1, 200))
        lens = rng.integers(0, 30, n)
        lens[rng.random(n) < 0.1] = 0
        flat = (rng.random(int(lens.sum())) * rng.choice([1.0, 40.0, 3000.0])).round(3)
        first = rng.random(n) * 60
        first[rng.random(n) < 0.05] = np.nan
        windows = [tuple(sorted(rng.random(2) * 80)) for _ in range(int(rng.integers(1, 4)))]
        has = (lens > 0) & ~np.isnan(first)
        if has.any():
            i = int(np.flatnonzero(has)[0])
            token = first[i] + np.cumsum(flat[int(lens[:i].sum()):int(lens[:i + 1].sum())])[-1] / 1e3
            windows += [(first[i], token), (token, token + 1.0)]  # edges on a first token and a last one
        fast = _count_tokens(first, flat, lens, windows)
        exact = _count_each_token(first, flat, lens, windows, has)
        for w, a, b in zip(windows, fast, exact):
            assert np.array_equal(a, b), (trial, w)


def test_value_counts_are_numpys_unique() -> None:
    rng = np.random.default_rng(1)
    for us in (rng.integers(0, 200_000, 100_000), np.zeros(0, np.int64), np.array([1 << 20, (1 << 20) - 1, 0, -3]),
               np.concatenate((rng.integers(0, 1000, 500), rng.integers(10**8, 10**9, 50)))):
        vals, counts = _value_counts(us)
        want_vals, want_counts = np.unique(us, return_counts=True)
        assert np.array_equal(vals, want_vals) and np.array_equal(counts, want_counts)
