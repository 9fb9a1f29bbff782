"""The streaming columnar reader (``rundir.store.columns``, issue 14) against the list path, on real run directories.

``build_summary`` reads ``requests.jsonl`` in chunks into per-level numpy columns; the list path reads every
record into memory first (``read_jsonl``) and builds the same columns in one chunk. On a ``sim`` run (per-token
ITLs, two repeats, ok / http_4xx / cancelled records in warm-up and measured phases) and a ``bench`` run against
the test server with injected faults, the two give the same ``summary.json`` on every key, floats *exactly*
equal: both do the same arithmetic on the same columns in the same record order (a record's token times are its
own running sum, never carried over from the chunk before), so nothing may differ, not even in the last bit.
Chunks here are 2 KB, so levels straddle chunks and chunks straddle levels.
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcap.analysis.stats import tokens_in_window
from kvcap.analysis.summary import build_summary
from kvcap.rundir import REQUESTS, RunDir, read_jsonl
from kvcap.rundir.store.column_reader import columns_of, read_columns
from kvcap.rundir.store.columns import LevelArrays
from kvcap.rundir.store.quantiles import ItlValues, percentiles
from tests.conftest import ROOT, run_cli
from tests.servers import start_fake_server

SLO = {"ttft_p95": 2000.0, "tpot_p95": 80.0}
SMALL_CHUNKS = partial(read_columns, chunk_bytes=2048)


def records_columns(path: Path, windows: dict) -> dict:
    """The columns from every record read into memory first (``read_jsonl``, one chunk): the list path the
    streaming reader must equal."""
    return columns_of([read_jsonl(path)], windows)


def sim_run(out: Path) -> Path:
    """A small real ``kvcap sim`` run: long prompts a 24 GiB GPU refuses (http_4xx), requests still in flight at
    the drain limit (cancelled), a slow remote tier, ITLs kept, two repeats of two levels."""
    from dataclasses import replace

    from kvcap.sim.run import SimConfig, run_sim
    from kvcap.specs.scenario import load_scenario
    from kvcap.workload.loadplan import LoadPlan

    sc = load_scenario(ROOT / "scenarios" / "seed-reference.yaml", {
        "workload.input_tokens": "uniform:256,8200", "workload.output_tokens": "uniform:16,96", "load.repeats": 2,
        "load.warmup": "1s", "load.duration": "8s", "load.concurrency": [4, 16], "cluster.nodes": 1,
        "cluster.gpu.memory": "24GiB", "serving.kv_offload": "remote", "cluster.remote_memory_bandwidth": "10Mbps"})
    run_sim(SimConfig(scenario=sc, plan=replace(LoadPlan.from_spec(sc.load), drain_timeout_s=3.0), out=out, slo=SLO))
    return out


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = sim_run(tmp_path_factory.mktemp("sim") / "run")
    errors = {(r["phase"], r["error"]) for r in read_jsonl(out / REQUESTS)}
    assert {("measure", None), ("measure", "http_4xx"), ("measure", "cancelled"), ("warmup", "cancelled")} <= errors
    return out


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    faults = ["http_500:every=10,offset=1", "http_429:every=10,offset=2", "reset:every=10,offset=3",
              "stall:every=10,offset=4", "malformed:every=10,offset=5", "error_in_200:every=10,offset=6"]
    out = tmp_path_factory.mktemp("bench") / "run"
    with start_fake_server(ttft="5ms", itl="2ms", fault=faults) as srv:
        proc = run_cli("bench", "--url", srv.url, "--out", str(out), "--quiet", "--concurrency", "2,4",
                       "--input-tokens", "8", "--output-tokens", "12", "--warmup", "0s", "--requests", "30",
                       "--repeats", "2", "--timeout", "10s", "--stall-timeout", "1s", "--slo", "ttft_p95=50ms")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def summary_json(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``build_summary``'s summary as summary.json holds it."""
    return build_summary(*args, **kwargs).to_json()


def both(run: Path, slo: dict[str, float] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(streamed in 2 KB chunks, list path) summaries of one run directory."""
    return summary_json(RunDir(run), slo, reader=SMALL_CHUNKS), summary_json(RunDir(run), slo,
                                                                               reader=records_columns)


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a == b
    assert json.dumps(a) == json.dumps(b)  # key order too (error classes in order of first appearance)


@pytest.mark.parametrize("which", ["sim", "bench"])
def test_streamed_columns_give_the_list_paths_summary_on_every_key(which, sim_dir, bench_dir):
    run = sim_dir if which == "sim" else bench_dir
    streamed, listed = both(run)
    assert_same(streamed, listed)
    assert summary_json(RunDir(run)) == listed  # the default reader (1 MB chunks: one here)
    lv = streamed["levels"]
    assert len(lv) == 2 and all(len(x["output_tok_s_repeats"]) == 2 for x in lv)
    assert sum(x["errors"] for x in lv) > 0 and lv[0]["itl_ms"]["p50"] is not None
    if which == "sim":
        assert sum(x["cancelled"] for x in lv) > 0
    else:
        assert {"http_5xx", "http_4xx", "connection", "timeout"} <= set(lv[0]["error_classes"])


def test_throughput_and_itl_percentiles_equal_the_per_record_truth(sim_dir):
    """Known truth from the raw records: each repeat's in-window tokens by the per-record reference
    (``tokens_in_window``: the record's own ``np.cumsum`` of its ITLs) and the ITL percentiles of the judged ok
    requests by ``np.percentile`` of their lists."""
    summary = summary_json(RunDir(sim_dir), reader=SMALL_CHUNKS)
    recs = read_jsonl(sim_dir / REQUESTS)
    windows = {(i["level"], i["repeat"]): (i["measure_start_s"], i["measure_end_s"])
               for i in read_jsonl(sim_dir / "levels.jsonl")}
    n_itl = 0
    for lv in summary["levels"]:
        mine = [r for r in recs if r["level"] == lv["level"]]
        tok = []
        for rep in (0, 1):
            t0, t1 = windows[(lv["level"], rep)]
            tok.append(round(sum(tokens_in_window(r, t0, t1) for r in mine if r["repeat"] == rep)
                             / max(t1 - t0, 1e-9), 3))
        assert lv["output_tok_s_repeats"] == tok
        itl = [x for r in mine if r["phase"] == "measure" and r["ok"] for x in r["itl_ms"]]
        n_itl += len(itl)
        assert lv["itl_ms"] == percentiles(np.asarray(itl))
    assert n_itl > 500


def test_itl_counts_past_the_exact_limit_give_the_same_percentiles(sim_dir):
    """Past ``itl_exact_max`` values a level's ITLs are counted per 1 µs value: every percentile bit-equal, the
    mean (exact from the integer µs sum, where np.mean sums floats pairwise) within 1e-12 relative."""
    exact = summary_json(RunDir(sim_dir), reader=SMALL_CHUNKS)
    counted = summary_json(RunDir(sim_dir), reader=partial(read_columns, chunk_bytes=2048, itl_exact_max=50))
    for a, b in zip(exact["levels"], counted["levels"]):
        ma, mb = a["itl_ms"].pop("mean"), b["itl_ms"].pop("mean")
        assert mb == pytest.approx(ma, rel=1e-12)
    assert exact == counted


def test_counted_percentiles_are_numpys_bit_for_bit():
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 5, 8, 101, 1000, 4097):
        values = np.round(rng.gamma(2.0, 5.0, n), 3)
        values[: n // 3] = values[0]  # ties
        store = ItlValues(exact_max=0)
        for part in np.array_split(values, 4):
            store.add(part)
        assert store.grid_us.size  # counted, not kept
        got, want = store.percentiles(), percentiles(values)
        assert got.pop("mean") == pytest.approx(want.pop("mean"), rel=1e-12)
        assert got == want, n


def test_off_grid_itls_are_kept_as_floats():
    store = ItlValues(exact_max=2)
    store.add(np.array([1.0, 2.0, 3.0]))       # on the 1 µs grid: counted
    store.add(np.array([0.12345, 4.0, 5.0]))   # not: everything back to floats, exact
    assert not store.grid_us.size and store.off_grid
    assert store.percentiles() == percentiles(np.array([1.0, 2.0, 3.0, 0.12345, 4.0, 5.0]))


def test_a_level_without_its_level_line_keeps_its_itls_and_gives_the_same_summary(sim_dir, tmp_path):
    """A killed run's last level has no line in levels.jsonl: its windows come from its records, so its tokens
    are counted after the read, from the ITLs kept for it."""
    run = tmp_path / "killed"
    shutil.copytree(sim_dir, run)
    lines = (run / "levels.jsonl").read_text().splitlines(keepends=True)
    (run / "levels.jsonl").write_text("".join(ln for ln in lines if json.loads(ln)["level"] != 16))
    streamed, listed = both(run)
    assert_same(streamed, listed)
    assert len(streamed["levels"]) == 2 and streamed["levels"][1]["output_tok_s"] > 0


def test_torn_and_corrupt_lines_are_skipped_as_read_jsonl_skips_them(sim_dir, tmp_path):
    run = tmp_path / "torn"
    shutil.copytree(sim_dir, run)
    lines = (run / REQUESTS).read_bytes().splitlines(keepends=True)
    mid = len(lines) // 2
    (run / REQUESTS).write_bytes(b"".join(lines[:mid]) + b'{"mode": "concurrency", "lev\n' + b"\n"
                                 + b"".join(lines[mid:]) + lines[3][:40])
    clean = summary_json(RunDir(sim_dir), reader=records_columns)
    streamed, listed = both(run)
    assert_same(streamed, listed)
    assert_same(streamed, clean)


def test_records_missing_fields_read_with_their_defaults(sim_dir, tmp_path):
    """Records without some fields (other writers) take the one-by-one path: the same figures as the full ones
    when the missing values are the defaults (truncated false, queue_ms null, repeat 0)."""
    run = tmp_path / "sparse"
    shutil.copytree(sim_dir, run)
    out = []
    for r in read_jsonl(run / REQUESTS):
        for key, default in (("truncated", False), ("queue_ms", None), ("repeat", 0)):
            if r.get(key) == default:
                r.pop(key)
        out.append(json.dumps(r) + "\n")
    (run / REQUESTS).write_text("".join(out))
    assert_same(summary_json(RunDir(run), reader=SMALL_CHUNKS), summary_json(RunDir(sim_dir)))


def test_a_line_holding_two_values_is_skipped_by_both_readers(tmp_path):
    """The chunked parse reads a chunk as one JSON array: a line like ``{..},{..}`` must not become two records
    there while the line-by-line rule skips it (one reader, one rule)."""
    from kvcap.rundir import jsonl_chunks

    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2},{"c": 3}\n{"d": 4}\n{"e": 5')
    assert read_jsonl(path) == [{"a": 1}, {"d": 4}]
    assert [r for chunk in jsonl_chunks(path, size=7) for r in chunk] == [{"a": 1}, {"d": 4}]


def test_a_request_without_an_end_has_all_its_tokens_at_its_first():
    """No ITLs, several tokens, no e2e (a cancelled record): every token at the first token's time, as the
    per-record definition has it — also when that time is a window's edge (it once gave NaN → INT64_MIN)."""
    rec = {"mode": "concurrency", "level": 1, "repeat": 0, "phase": "measure", "start_s": 10.0, "ok": False,
           "error": "cancelled", "input_tokens": 8, "output_tokens": 5, "ttft_ms": 500.0, "tpot_ms": None,
           "e2e_ms": None, "queue_ms": None, "truncated": False}
    arrays = LevelArrays([rec], {})
    for t0, t1 in ((10.5, 20.0), (0.0, 10.5), (10.0, 11.0), (11.0, 12.0)):
        assert arrays.request_tokens(t0, t1).tolist() == [tokens_in_window(rec, t0, t1)]


def test_itl_percentiles_when_the_last_values_leave_the_grid():
    """Counted on the µs grid, then a value off it: every value is kept as a float again (it once divided by
    zero)."""
    store = ItlValues(exact_max=4)
    store.add(np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    store.add(np.array([1.0005]))
    values = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 1.0005])
    got = store.percentiles()
    assert got["p50"] == float(np.percentile(values, 50)) and got["p99"] == float(np.percentile(values, 99))
