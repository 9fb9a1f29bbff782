"""Telemetry written on change (issue 14) gives the analysis exactly what the full per-second grid gave.

The demo's scenario and arms (kvcap/scenarios/seed-reference-ab.yaml), every level, one repeat to keep it short:
each arm is simulated twice on the same seed — the old grid (``SimConfig.full_telemetry``) and on change — and the
summaries must agree key for key (resident = max held at once, effective capacity, means over the windows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcap.ab.experiment import packaged_scenario
from kvcap.analysis.telemetry import (
    HOLD,
    Series,
    Telemetry,
    dedupe_sources,
    expand_held,
    how,
    round_us,
    series,
    series_of,
)
from kvcap.analysis.telemetry_nodes import node_figures, nodes
from kvcap.rundir import RunDir
from kvcap.sim.run import SimConfig, run_sim
from kvcap.specs.scenario import load_scenario
from kvcap.workload.loadplan import LoadPlan

WALL_KEYS = ("wall_s", "realtime_factor", "engine_wall_s")


def _sim(arm: str, out: Path, full: bool) -> dict[str, Any]:
    sc = load_scenario(packaged_scenario("seed-reference.yaml"), {"serving.kv_offload": arm, "load.repeats": 1})
    return run_sim(SimConfig(scenario=sc, plan=LoadPlan.from_spec(sc.load), out=out, slo={"ttft_p95": 500.0,
                   "tpot_p95": 80.0}, record_itl=False, full_telemetry=full)).to_json()


def _no_wall(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without wall-clock figures (they differ run to run)."""
    return summary | {"sim": {k: v for k, v in summary["sim"].items() if k not in WALL_KEYS}}


@pytest.mark.parametrize("arm", ["none", "remote"])
def test_thinned_run_gives_the_same_summary(tmp_path: Path, arm: str) -> None:
    full = _sim(arm, tmp_path / "full", full=True)
    thin = _sim(arm, tmp_path / "thin", full=False)
    assert thin["capacity"] == full["capacity"]
    assert thin["capacity"]["resident"] is not None and thin["capacity"]["effective"] is not None
    assert _no_wall(thin) == _no_wall(full)
    # the expanded rows are the full grid's, row for row: by the row path and by the series (columnar) path
    full_rows = RunDir(tmp_path / "full").telemetry()
    thin_rows = RunDir(tmp_path / "thin").telemetry()
    assert expand_held(thin_rows) == full_rows
    assert dedupe_sources(thin_rows).rows() == full_rows
    big = (tmp_path / "full" / "telemetry.jsonl").stat().st_size
    small = (tmp_path / "thin" / "telemetry.jsonl").stat().st_size
    print(f"telemetry.jsonl ({arm}): full {big / 1e3:.0f} kB, on change {small / 1e3:.0f} kB, {big / small:.1f}×")
    assert big / small >= 2.3  # KV usage moves most seconds (blocks fill step by step, as vLLM reports them)


def test_a_held_value_is_not_carried_across_levels() -> None:
    """The last row of a level has no ``hold_s``: the gap before the next level stays empty."""
    row = {"source": "sim", "name": "server.requests_running", "labels": {"replica": "r0"}}
    rows = [row | {"t_s": 0.0, "value": 3, HOLD: 1.0}, row | {"t_s": 4.0, "value": 3},
            row | {"t_s": 10.0, "value": 1, HOLD: 1.0}, row | {"t_s": 12.0, "value": 2}]
    assert [(r["t_s"], r["value"]) for r in expand_held(rows)] == [
        (0.0, 3), (1.0, 3), (2.0, 3), (3.0, 3), (4.0, 3), (10.0, 1), (11.0, 1), (12.0, 2)]
    assert all(HOLD not in r for r in expand_held(rows))
    scraped = [row | {"t_s": 0.0, "value": 1}, row | {"t_s": 5.0, "value": 1}]
    assert expand_held(scraped) is scraped  # real scrapes pass through untouched


def _scan_series(rows: list[dict[str, Any]], name: str, node: str | None = None) -> list[tuple[float, float]]:
    """The reference: every row scanned, values per sample time in row order, summed / averaged / maximised."""
    agg = how(name)
    acc: dict[float, list[float]] = {}
    for r in rows:
        if r["name"] == name and (node is None or r["labels"].get("node") == node):
            acc.setdefault(float(r["t_s"]), []).append(float(r["value"]))
    fn = {"sum": sum, "max": max}.get(agg, lambda v: sum(v) / len(v))
    return sorted((t, float(fn(v))) for t, v in acc.items())


def test_the_series_path_gives_what_a_scan_of_the_expanded_rows_gives(tmp_path: Path) -> None:
    """``Telemetry`` (per-series arrays, held values put back on the grid by numpy, aggregated once and cached)
    against a plain scan of the rows ``expand_held`` gives: the same floats for every name, node and window."""
    _sim("remote", tmp_path / "run", full=False)
    raw = RunDir(tmp_path / "run").telemetry()
    tel = dedupe_sources(raw)
    assert isinstance(tel, Telemetry) and len(tel) > len(raw)  # held rows put back on the grid
    plain = expand_held(raw)
    names = {r["name"] for r in plain}
    node_names = {r["labels"].get("node") for r in plain} - {None}
    assert len(names) > 10 and node_names and set(nodes(tel)) == node_names
    for name in names:
        assert series(tel, name) == _scan_series(plain, name), name
        for node in node_names:
            assert series(tel, name, node=node) == _scan_series(plain, name, node), (name, node)
    t0, t1 = plain[len(plain) // 3]["t_s"], plain[2 * len(plain) // 3]["t_s"]
    windowed = [r for r in plain if t0 <= r["t_s"] <= t1]
    assert node_figures(tel, t0, t1) == node_figures(windowed, -1e18, 1e18)


def test_memory_follows_the_rows_written_not_the_grid() -> None:
    """A value held for 10⁶ grid seconds is kept as the two rows written (issue 14: memory flat in run length);
    its series, a window of it and the node figures are still the grid's."""
    row = {"source": "sim", "name": "server.requests_running", "labels": {"replica": "r0", "node": "n0"}}
    tel = dedupe_sources([row | {"t_s": 0.0, "value": 5, HOLD: 1.0}, row | {"t_s": 1e6, "value": 7}])
    assert [a.size for a in tel.raw[0]] == [2, 2, 2]
    s = series_of(tel, "server.requests_running")
    assert len(s) == 1_000_001 and s.t[-1] == 1e6 and float(s.v[:-1].max()) == float(s.v[:-1].min()) == 5.0
    w = s.within(10.0, 20.0)
    assert w.t.tolist() == [float(t) for t in range(10, 21)] and set(w.v.tolist()) == {5.0}
    figs = node_figures(tel, 0.0, 1e6)["n0"]
    assert figs["running_max"] == 7.0 and figs["running_mean"] == round((5 * 1_000_000 + 7) / 1_000_001, 4)


def test_series_plus_adds_per_sample_time() -> None:
    """Running + parked (the resident series): values added where the times meet, each kept where they do not."""
    a = Series(np.array([0.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0]))
    b = Series(np.array([1.0, 3.0]), np.array([10.0, 20.0]))
    both = a.plus(b)
    assert both.t.tolist() == [0.0, 1.0, 2.0, 3.0] and both.v.tolist() == [1.0, 12.0, 3.0, 20.0]
    assert not Series(np.zeros(0), np.zeros(0)) and a.within(0.5, 2.0).v.tolist() == [2.0, 3.0]


def test_grid_times_round_as_python_rounds():
    """The grid's times are ``round(t + k·step, 6)`` as the sampler wrote them, computed by numpy: the same float as
    Python's ``round`` for every value, ties and near-ties included (those go through Python's ``round``)."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.uniform(0, 2e5, 200_000), np.arange(0, 20_000, 0.25) + 1e-7,
                        np.arange(0, 100, 1e-3) + 5e-7, np.cumsum(np.full(50_000, 0.1)), np.array([0.0, 2.5e-6, 1e6])])
    assert round_us(x).tolist() == [round(v, 6) for v in x.tolist()]
