"""Issue 14: a run's records as columns, analysed a block at a time. ``kvcap sim`` takes the column copy of its
records as it writes them and closes with the summary of that copy (never a parse of ``requests.jsonl``); a
level's rows wait on disk in blocks past ``BLOCK_ROWS``, and every statistic is made in two or three passes over
the blocks. The summary must be the same on every key whatever the blocks (one, or many of a few rows), and
the same as the JSONL's. Beside: exact order statistics by bucket, the token-count shortcut and the µs value
counts against their plain numpy definitions."""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcap.analysis.summary import build_summary
from kvcap.rundir import RunDir
from kvcap.rundir.store import column_reader
from kvcap.rundir.store.column_reader import read_columns
from kvcap.rundir.store.quantiles import OrderStats, _value_counts, percentiles
from kvcap.rundir.store.tokens import count_each_token, count_tokens
from tests.conftest import ROOT, run_cli

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


def _summary(out: Path, **reader: Any) -> str:
    run = RunDir(out)
    return _without_run_facts(build_summary(run, slo=run.slo,
                                            reader=partial(read_columns, **reader) if reader else None).to_json())


def _jsonl_only(out: Path, monkeypatch: pytest.MonkeyPatch, **reader: Any) -> str:
    with monkeypatch.context() as m:
        m.setattr(column_reader, "stored_columns", lambda path: None)
        return _summary(out, **reader)


@pytest.mark.parametrize("case", list(CASES))
def test_the_runs_summary_reads_its_copy_and_is_the_jsonls_in_any_blocks(case: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """In process (so the parse can be watched): the run's own summary reads the column copy it wrote, never
    ``requests.jsonl``; it is the JSONL's summary on every key, and so is the summary of the copy or the JSONL
    read in blocks of 7 or 64 rows (many blocks on disk, a level's last one in memory)."""
    from kvcap.cli import main

    parsed: list[int] = []
    chunks = column_reader.jsonl_chunks

    def watched(*args: Any, **kwargs: Any) -> Any:
        parsed.append(1)
        return chunks(*args, **kwargs)

    monkeypatch.setattr(column_reader, "jsonl_chunks", watched)
    out = tmp_path / "run"
    assert main(["sim", SCENARIO, *CASES[case], "--out", str(out), "--quiet"]) in (0, None)
    assert parsed == [], "the run's summary parsed requests.jsonl instead of reading its column copy"
    written = json.loads((out / "summary.json").read_text())
    assert written["levels"] and all(lv["requests"] > 0 for lv in written["levels"])
    one_block = _without_run_facts(written)
    assert one_block == _jsonl_only(out, monkeypatch)
    files = sorted(os.listdir(out))
    for rows in (7, 64):
        assert _summary(out, block_rows=rows) == one_block, rows
        assert _jsonl_only(out, monkeypatch, block_rows=rows, chunk_bytes=4096) == one_block, rows
    assert sorted(os.listdir(out)) == files, "the blocks left a file in the run directory"


def test_a_long_level_waits_on_disk_a_block_at_a_time(tmp_path: Path) -> None:
    """The rows held in memory stay under a block whatever the level's length: the rest are in blocks on disk
    (read back one at a time), and they are all the level's rows."""
    out = tmp_path / "run"
    p = run_cli("sim", SCENARIO, "--concurrency", "8", "--requests", "400", "--warmup", "0s", "--repeats", "1",
                "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    run = RunDir(out)
    (lv,) = run.levels()
    windows = {("concurrency", 8.0): {0: (lv.measure_start_s, lv.measure_end_s)}}
    level = read_columns(out / "requests.jsonl", windows, block_rows=50)[("concurrency", 8.0)]
    sizes = [block.n for block in level.blocks()]
    assert level.n == sum(sizes) == len(run.records()) and sizes[:-1] == [50] * (len(sizes) - 1) and sizes[-1] < 50
    assert len(level._spilled) == len(sizes) - 1 >= 7


def test_a_killed_runs_last_level_in_blocks_is_recounted_the_same(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A level without a line in ``levels.jsonl`` (its window from its records) that spills is counted by a
    second read; the summary is the one-block one."""
    out = tmp_path / "run"
    p = run_cli("sim", SCENARIO, "--concurrency", "4,16", "--requests", "150", "--warmup", "5s", "--repeats", "1",
                "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    lines = (out / "levels.jsonl").read_text().splitlines()
    (out / "levels.jsonl").write_text(lines[0] + "\n")
    one_block = _summary(out)
    assert _summary(out, block_rows=16) == one_block
    assert _jsonl_only(out, monkeypatch, block_rows=16) == one_block


def test_order_statistics_by_bucket_are_numpys() -> None:
    """Any sample (ties, negatives, zeros, NaN, a wide range), fed in blocks of any size, twice: the percentiles,
    the median and every rank asked are numpy's on the whole sample."""
    rng = np.random.default_rng(3)
    samples = [rng.lognormal(3, 2, 5000), np.round(rng.normal(0, 50, 3000), 3), np.full(700, 25.125),
               np.concatenate((rng.integers(0, 5, 2000).astype(float), [np.nan] * 9, [-0.0, 1e-300, 1e300])),
               rng.random(1), np.zeros(0)]
    for v in samples:
        cuts = np.sort(rng.integers(0, v.size + 1, 5))
        blocks = np.split(v, cuts)
        s = OrderStats(keep=10)
        for b in blocks:
            s.add(b)
        clean = v[~np.isnan(v)]
        ranks = rng.integers(0, max(clean.size, 1), 6) if clean.size else np.zeros(0, np.int64)
        s.ask_percentiles()
        s.ask(ranks)
        if clean.size:
            s.ask(np.array([(clean.size - 1) // 2, clean.size // 2]))
        for b in blocks:
            s.collect(b)
        assert s.percentiles() == percentiles(v)
        assert np.array_equal(s.first_values(), clean[:10])
        if clean.size:
            assert s.median() == float(np.median(clean))
            assert np.array_equal(s.value_at(ranks), np.sort(clean)[ranks])


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
        fast = count_tokens(first, flat, lens, windows)
        exact = count_each_token(first, flat, lens, windows, has)
        for w, a, b in zip(windows, fast, exact):
            assert np.array_equal(a, b), (trial, w)


def test_value_counts_are_numpys_unique() -> None:
    rng = np.random.default_rng(1)
    for us in (rng.integers(0, 200_000, 100_000), np.zeros(0, np.int64), np.array([1 << 20, (1 << 20) - 1, 0, -3]),
               np.concatenate((rng.integers(0, 1000, 500), rng.integers(10**8, 10**9, 50)))):
        vals, counts = _value_counts(us)
        want_vals, want_counts = np.unique(us, return_counts=True)
        assert np.array_equal(vals, want_vals) and np.array_equal(counts, want_counts)
