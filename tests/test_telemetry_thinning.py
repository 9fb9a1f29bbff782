"""Telemetry written on change (issue 14) gives the analysis exactly what the full per-second grid gave.

The demo's scenario and arms (kvcap/scenarios/seed-reference-ab.yaml), every level, one repeat to keep it short:
each arm is simulated twice on the same seed — the old grid (``SimConfig.full_telemetry``) and on change — and the
summaries must agree key for key (resident = max held at once, effective capacity, means over the windows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcap.analysis.telemetry import HOLD, dedupe_sources, expand_held
from kvcap.experiment import packaged_scenario
from kvcap.rundir import RunDir
from kvcap.sim.run import SimConfig, run_sim
from kvcap.specs.scenario import load_scenario
from kvcap.workload.loadplan import LoadPlan

WALL_KEYS = ("wall_s", "realtime_factor", "engine_wall_s")


def _sim(arm: str, out: Path, full: bool) -> dict[str, Any]:
    sc = load_scenario(packaged_scenario("seed-reference.yaml"), {"serving.kv_offload": arm, "load.repeats": 1})
    return run_sim(SimConfig(scenario=sc, plan=LoadPlan.from_spec(sc.load), out=out, slo={"ttft_p95": 500.0,
                   "tpot_p95": 80.0}, record_itl=False, full_telemetry=full))


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
    # the expanded rows are the full grid's, row for row
    assert dedupe_sources(RunDir(tmp_path / "thin").telemetry()) == RunDir(tmp_path / "full").telemetry()
    big = (tmp_path / "full" / "telemetry.jsonl").stat().st_size
    small = (tmp_path / "thin" / "telemetry.jsonl").stat().st_size
    print(f"telemetry.jsonl ({arm}): full {big / 1e3:.0f} kB, on change {small / 1e3:.0f} kB, {big / small:.1f}×")
    assert big / small >= 2.5


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


def test_the_name_index_gives_the_series_a_scan_gives(tmp_path: Path) -> None:
    from kvcap.analysis.telemetry import Rows, series

    _sim("remote", tmp_path / "run", full=False)
    rows = dedupe_sources(RunDir(tmp_path / "run").telemetry())
    assert isinstance(rows, Rows)
    plain = list(rows)
    names = {r["name"] for r in plain}
    nodes = {r["labels"].get("node") for r in plain} - {None}
    assert len(names) > 10 and nodes
    for name in names:
        assert series(rows, name) == series(plain, name), name
        for node in nodes:
            assert series(rows, name, node=node) == series(plain, name, node=node), (name, node)
