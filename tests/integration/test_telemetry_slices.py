"""Issue 14: a long run's telemetry is summarised a time slice at a time (``telemetry_slices``,
``telemetry_figures``), so the summary's memory does not grow with the run. The summary must be the whole
telemetry's on every key whatever the slices, each slice must hold only its own stretch of time, and a copy that
cannot be sliced exactly (rows out of time order) is read whole."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcap.analysis import telemetry_slices
from kvcap.analysis.summary import build_summary
from kvcap.analysis.telemetry import Telemetry, read_telemetry
from kvcap.analysis.telemetry_nodes import NodeFigures
from kvcap.rundir import COLUMN_COPIES, TELEMETRY, RunDir
from kvcap.rundir.store.column_file import Damaged, TelemetryWriter, fingerprint, telemetry_span
from kvcap.rundir.store.level_blocks import Spill
from tests.conftest import ROOT, run_cli

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
    return json.dumps(build_summary(run, slo=run.slo).to_json(), sort_keys=True)


def test_the_summary_is_the_whole_telemetrys_in_any_slices(long_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _summary(long_run)  # 266 s simulated: one slice of SLICE_S
    assert len(list(telemetry_slices.telemetry_slices(RunDir(long_run)))) == 1
    summary = json.loads(whole)
    assert (summary["capacity"]["resident"] == 96
            and summary["capacity"]["resident_source"] == "telemetry:running+parked")
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


def test_nic_utilisation_adds_up_over_slices() -> None:
    """A NIC's line rate stops being reported before the window ends: each slice's peaks are divided by the
    window's last rate, as the whole window's are (not by whatever rate the slice saw)."""
    rows = []
    for t in range(20):
        if t < 5:
            rows.append({"t_s": float(t), "source": "node", "name": "net.speed_bytes_s",
                         "labels": {"node": "n0", "device": "eth0"}, "value": 1e9 if t < 3 else 2e9})
        rx = 1e9 if t == 15 else 1e8 * (1 + t % 7)  # the peak in the last slice, which sees no line rate
        for name, value in (("net.rx_bytes_s", rx), ("net.tx_bytes_s", 5e7 * (1 + t % 3))):
            rows.append({"t_s": float(t), "source": "node", "name": name, "labels": {"node": "n0", "device": "eth0"},
                         "value": value})
    windows = [(0.0, 19.0), (2.0, 12.0)]
    whole = NodeFigures(windows)
    whole.add(Telemetry(rows))
    sliced = NodeFigures(windows)
    for lo, hi in ((-math.inf, 4.0), (4.0, 9.0), (9.0, math.inf)):
        sliced.add(Telemetry([r for r in rows if lo <= r["t_s"] < hi]), lo, hi)
    got = sliced.result()
    assert got == whole.result()
    assert got[0]["n0"]["link_util_max"] == round(1e9 / 2e9, 4) and got[1]["n0"]["link_util_max"] == 0.35


def test_a_copy_that_changes_while_sliced_is_read_whole(long_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _summary(long_run)
    original = telemetry_slices._slices

    def changed(*args: Any) -> Any:
        gen = original(*args)
        yield next(gen)
        raise Damaged("the copy changed")

    monkeypatch.setattr(telemetry_slices, "SLICE_S", 5.0)
    monkeypatch.setattr(telemetry_slices, "_slices", changed)
    assert _summary(long_run) == whole


def test_blocks_stay_in_memory_where_no_temporary_file_can_be_made(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    spill = Spill(tmp_path / "missing-too")
    block = {"start": np.arange(5.0), "w0": np.arange(5, dtype=np.int32)}
    where = spill.put(block)
    assert spill.in_memory and all(np.array_equal(spill.get(where)[k], v) for k, v in block.items())
