"""The README's what-if path: bench → calibrate → `kvcap ab calibrated.yaml --treatment …` runs with no load flags,
because the calibrated scenario carries the workload and load the runs measured."""

from __future__ import annotations

import json

import yaml

from tests.conftest import run_cli
from tests.servers import start_fake_server


def test_calibrated_scenario_runs_a_what_if_as_is(tmp_path):
    run = tmp_path / "profile"
    with start_fake_server(slots=4, step_a="10ms", step_b="2ms") as srv:
        p = run_cli("bench", "--url", srv.url, "--out", str(run), "--quiet", "--json", "--metrics-url",
                    srv.url + "/metrics", "--input-tokens", "32", "--output-tokens", "16", "--concurrency", "1,2,4,8",
                    "--warmup", "0.5s", "--duration", "2s", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    scenario = tmp_path / "calibrated.yaml"
    p = run_cli("calibrate", str(run), "--out", str(scenario))
    assert p.returncode == 0, p.stderr[-2000:]
    data = yaml.safe_load(scenario.read_text())
    assert data["workload"] == {"input_tokens": 32, "output_tokens": 16}
    assert data["load"]["concurrency"] == [1, 2, 4, 8]
    out = tmp_path / "ab"
    p = run_cli("ab", str(scenario), "--treatment", "serving.max_num_seqs=8", "--out", str(out), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["verdict"] in ("performance-scaling", "capacity-only", "no-gain")
    control = json.loads((out / "control" / "summary.json").read_text())
    treatment = json.loads((out / "treatment" / "summary.json").read_text())
    # the truth the fit saw: 4 slots; the what-if's 8 slots hold all 8 requests at c=8
    assert max(lv["server_running_max"] for lv in control["levels"]) == 4
    assert max(lv["server_running_max"] for lv in treatment["levels"]) == 8
