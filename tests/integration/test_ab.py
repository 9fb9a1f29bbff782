"""`kvcap ab` end to end: two server commands kvcap starts and stops itself, interleaved repeats, compare, report."""

from __future__ import annotations

import json
import sys

import yaml

from kvcap.procs import free_port
from kvcap.rundir import RunDir
from tests.conftest import ROOT, run_cli


def test_ab_interleaves_repeats_and_reports(tmp_path):
    arms = []
    for name, slots in (("control", 8), ("treatment", 24)):
        port = free_port()
        arms.append({"name": name, "url": f"http://127.0.0.1:{port}",
                     "command": f"{sys.executable} -m kvcap.testing.server --port {port} --slots {slots} "
                                "--step-a 20ms --step-b 3ms",
                     "vary": {"serving.slots": slots}})
    exp = {"name": "slots", "fixed": {"model.name": "fake-model"}, "arms": arms,
           "load": {"concurrency": [8, 16, 24], "warmup": "0.5s", "duration": "2.5s", "repeats": 2},
           "workload": {"input_tokens": 16, "output_tokens": 24}, "slo": {"ttft_p95": "500ms", "tpot_p95": "80ms"}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    out = tmp_path / "ab"
    p = run_cli("ab", str(path), "--out", str(out), "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout)
    assert result["verdict"] == "performance-scaling"
    assert result["control"]["effective"] == 8 and result["treatment"]["effective"] == 16
    # A B A B: the schedule alternates arms, and each arm's directory holds both repeats on one time axis
    assert [(s["arm"], s["repeat"]) for s in result["schedule"]] == [
        ("control", 0), ("treatment", 0), ("control", 1), ("treatment", 1)]
    for arm in ("control", "treatment"):
        run = RunDir(out / arm)
        reps = sorted({(lv.level, lv.repeat) for lv in run.levels()})
        assert reps == [(lv, r) for lv in (8, 16, 24) for r in (0, 1)]
        assert run.manifest.fixed["load.repeats"] == 2 and run.manifest.arm == arm
        starts = {r: min(x.t_start_s or 0.0 for x in run.levels() if x.repeat == r) for r in (0, 1)}
        assert starts[1] > starts[0] + 5
        summary = json.loads((out / arm / "summary.json").read_text())
        assert all(len(lv["output_tok_s_repeats"]) == 2 for lv in summary["levels"])
    assert (out / "compare.json").exists()
    html = (out / "report.html").read_text()
    assert "performance-scaling" in html and html.count("<svg") >= 6
    assert "performance-scaling" in (out / "report.md").read_text()


def test_ab_bad_experiment_exit_2(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"arms": [{"name": "a", "url": "http://127.0.0.1:9"}],
                                    "load": {"concurrency": [1]}}))
    p = run_cli("ab", str(path), "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and "exactly two arms" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_what_if_on_a_scenario_runs_control_as_written_and_treatment_changed(cli, tmp_path):
    # `ab SCENARIO --treatment KEY=VALUE`: no experiment file needed for a what-if (issue 12)
    out = tmp_path / "wi"
    p = cli("ab", str(ROOT / "scenarios" / "seed-reference.yaml"), "--treatment", "serving.kv_offload=remote",
            "--set", "load.repeats=1", "--set", "load.concurrency=[48,96]", "--set", "load.duration=20s",
            "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    manifests = {arm: json.loads((out / arm / "manifest.json").read_text()) for arm in ("control", "treatment")}
    assert manifests["control"]["fixed"]["serving.kv_offload"] == "none"
    assert manifests["treatment"]["fixed"]["serving.kv_offload"] == "remote"
    assert manifests["treatment"]["under_test"] == ["serving.kv_offload"]
    assert result["verdict"] == "capacity-only"
    bad = cli("ab", str(ROOT / "scenarios" / "seed-reference.yaml"), "--treatment", "serving.bogus=1",
              "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "serving.bogus" in bad.stderr and "Traceback" not in bad.stderr
