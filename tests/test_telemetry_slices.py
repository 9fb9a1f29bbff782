"""Issue 14: a long run's telemetry is summarised a time slice at a time (``telemetry_slices``,
``telemetry_figures``), so the summary's memory does not grow with the run. The summary must be the whole
telemetry's on every key whatever the slices, each slice must hold only its own stretch of time, and a copy that
cannot be sliced exactly (rows out of time order) is read whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcap.analysis import telemetry_slices
from kvcap.analysis.column_file import TelemetryWriter, fingerprint, telemetry_span
from kvcap.analysis.summary import build_summary
from kvcap.analysis.telemetry import read_telemetry
from kvcap.rundir import COLUMN_COPIES, TELEMETRY, RunDir

from .conftest import ROOT, run_cli

SCENARIO = str(ROOT / "scenarios" / "seed-reference.yaml")


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two timed levels of 120 s, the second parking requests in the remote tier (every telemetry figure moves)."""
    out = tmp_path_factory.mktemp("slices") / "run"
    p = run_cli("sim", SCENARIO, "--set", "serving.kv_offload=remote", "--set", "serving.offload_admission=tiers",
                "--concurrency", "32,96", "--duration", "120s", "--warmup", "5s", "--repeats", "1",
                "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    return out


def _summary(out: Path) -> str:
    run = RunDir(out)
    return json.dumps(build_summary(run, slo=run.manifest.get("slo") or {}), sort_keys=True)


def test_the_summary_is_the_whole_telemetrys_in_any_slices(long_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _summary(long_run)  # 266 s simulated: one slice of SLICE_S
    assert len(list(telemetry_slices.telemetry_slices(RunDir(long_run)))) == 1
    summary = json.loads(whole)
    assert summary["capacity"]["resident"] == 96 and summary["capacity"]["resident_source"] == "telemetry:running+parked"
    assert all(lv["nodes"] and "server_parked_max" in lv for lv in summary["levels"])
    for slice_s in (5.0, 13.0, 64.0):
        monkeypatch.setattr(telemetry_slices, "SLICE_S", slice_s)
        slices = list(telemetry_slices.telemetry_slices(RunDir(long_run)))
        assert len(slices) >= 266 // slice_s
        assert _summary(long_run) == whole, slice_s


def test_each_slice_holds_its_own_stretch_of_time(long_run: Path) -> None:
    """Every grid sample time of the whole run is in exactly one slice, with the whole run's value there."""
    run = RunDir(long_run)
    (whole, _, _), = telemetry_slices.telemetry_slices(run)
    for name in ("server.requests_running", "server.requests_parked", "server.kv_usage", "link.util"):
        t_all, v_all = whole.arrays(name)
        got_t: list[float] = []
        got_v: list[float] = []
        for tel, lo, hi in telemetry_slices.telemetry_slices(run, slice_s=9.0):
            t, v = tel.arrays(name)
            inside = (t >= lo) & (t < hi)
            assert t[~inside].size <= 1  # at most the row marking where a held value stops (no value)
            got_t += t[inside].tolist()
            got_v += v[inside].tolist()
            assert sum(raw[0].size for raw in tel.raw) <= 46 * (9 + 2) + 46  # its rows: ~9 s of the 46 series
        assert got_t == t_all.tolist() and got_v == v_all.tolist(), name


def test_analyzes_copy_is_in_time_order_and_one_out_of_order_is_read_whole(long_run: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy ``analyze`` writes from the JSONL is in time order, so it is sliced too; a copy written series by
    series says so in its index and is read whole. The summary is the same every way."""
    out = tmp_path / "run"
    out.mkdir()
    for f in long_run.iterdir():
        if f.name not in COLUMN_COPIES:
            (out / f.name).write_bytes(f.read_bytes())
    p = run_cli("analyze", str(out))
    assert p.returncode == 0, p.stderr
    span = telemetry_span(out / TELEMETRY)
    assert span is not None and span[2] is True
    monkeypatch.setattr(telemetry_slices, "SLICE_S", 5.0)
    assert len(list(telemetry_slices.telemetry_slices(RunDir(out)))) > 40
    assert _summary(out) == _summary(long_run)
    whole = read_telemetry(RunDir(out))
    copy = TelemetryWriter(out / TELEMETRY)
    for sid, (t, v, h) in zip(copy.ids(whole.meta), whole.raw):
        copy.add_series(sid, t, v, h)
    copy.close(sum(1 for _ in RunDir(out).iter_telemetry()), fingerprint(out / TELEMETRY))
    span = telemetry_span(out / TELEMETRY)
    assert span is not None and span[2] is False
    assert len(list(telemetry_slices.telemetry_slices(RunDir(out)))) == 1
    assert _summary(out) == _summary(long_run)


def test_the_sims_copy_says_its_span(long_run: Path) -> None:
    span = telemetry_span(long_run / TELEMETRY)
    levels = [json.loads(line) for line in (long_run / "levels.jsonl").read_text().splitlines()]
    assert span is not None and span[2] is True and span[0] == 0.0
    assert levels[-1]["measure_end_s"] <= span[1] <= levels[-1]["measure_end_s"] + 60
