"""Load keys that conflict are either an error naming both or follow one precedence the summary states
(issue 11, item 6): `--set load.requests=N` on a scenario with `load.duration` runs N requests, not fewer."""

from __future__ import annotations

import json
from pathlib import Path

from kvcap.specs.load import LIMIT_RULE, displaced_by_overrides
from tests.conftest import ROOT

SCENARIO = str(ROOT / "scenarios" / "seed-reference.yaml")


def _measured(run: Path) -> int:
    return sum(1 for line in (run / "requests.jsonl").open() if json.loads(line)["phase"] == "measure")


def test_set_requests_replaces_the_scenarios_duration(cli, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli("sim", SCENARIO, "--set", "load.requests=400", "--set", "load.repeats=1", "--concurrency", "4",
               "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    # the scenario's 60 s window holds ~184 requests at c=4: both limits applying would stop there, unseen
    assert _measured(out) == 400
    assert "load.duration=60s from the file is replaced by load.requests=400" in proc.stderr
    limits = json.loads(proc.stdout)["limits"]
    assert limits["requests"] == 400 and limits["duration_s"] is None
    assert any("load.duration" in n for n in limits["notes"])
    assert json.loads((out / "manifest.json").read_text())["notes"] == limits["notes"]


def test_both_limits_on_the_command_line_apply_and_the_summary_says_so(cli, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = cli("sim", SCENARIO, "--set", "load.requests=400", "--set", "load.duration=60s", "--set",
               "load.repeats=1", "--concurrency", "4", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    assert _measured(out) < 400  # the window ended first
    limits = json.loads(proc.stdout)["limits"]
    assert limits["rule"] == LIMIT_RULE and limits["notes"] == []


def test_set_rate_replaces_the_scenarios_concurrency(cli, tmp_path: Path) -> None:
    proc = cli("sim", SCENARIO, "--set", "load.rate=[2]", "--set", "load.requests=20", "--set", "load.repeats=1",
               "--out", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    levels = json.loads(proc.stdout)["levels"]
    assert [(lv["mode"], lv["level"]) for lv in levels] == [("rate", 2)]


def test_concurrency_and_rate_in_one_file_is_an_error_naming_both(cli, tmp_path: Path) -> None:
    sc = tmp_path / "both.yaml"
    sc.write_text("load: {concurrency: [4], rate: [2], requests: 10}\n")
    proc = cli("sim", str(sc), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "load.concurrency" in proc.stderr and "load.rate" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_arrival_with_a_closed_loop_is_an_error(cli, tmp_path: Path) -> None:
    proc = cli("sim", SCENARIO, "--arrival", "constant", "--requests", "5", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "load.arrival" in proc.stderr and "Traceback" not in proc.stderr


def test_displaced_keys_rule() -> None:
    data = {"load": {"duration": "60s", "concurrency": [8]}}
    assert displaced_by_overrides(data, {"load.requests": 10}) == {
        "load.duration": "load.duration=60s from the file is replaced by load.requests=10 from the command line"}
    assert displaced_by_overrides(data, {"load.requests": 10, "load.duration": "5s"}) == {}
    assert displaced_by_overrides(data, {"load.requests": None}) == {}
    assert list(displaced_by_overrides(data, {"load.rate": [1.0]})) == ["load.concurrency"]
    assert displaced_by_overrides({"load": {}}, {"load.requests": 10}) == {}
