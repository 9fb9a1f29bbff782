"""The verdict over real HTTP: the project's batching server with 8 vs 24 slots, truths from its step model."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.servers import start_fake_server

SLO = "ttft_p95=500ms,tpot_p95=80ms"
OUT_TOKENS = 32


def arm(tmp_path, name: str, slots: int, a_ms: float, b_ms: float) -> str:
    out = tmp_path / name
    with start_fake_server(slots=slots, step_a=f"{a_ms}ms", step_b=f"{b_ms}ms") as srv:
        p = run_cli("bench", "--url", srv.url, "--out", str(out), "--quiet", "--concurrency", "8,16,24",
                    "--input-tokens", "16", "--output-tokens", str(OUT_TOKENS), "--warmup", "1s", "--duration", "3s",
                    "--slo", SLO, "--metrics-url", srv.url + "/metrics", "--vary", f"serving.slots={slots}",
                    timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    return str(out)


def verdict(control: str, treatment: str) -> dict:
    p = run_cli("compare", control, treatment, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_memory_that_buys_performance(tmp_path):
    # step = 20 ms + 3 ms × batch: TPOT 44 ms at 8, 68 ms at 16 (< 80), 92 ms at 24 (> 80)
    control = arm(tmp_path, "control", 8, 20, 3)
    treatment = arm(tmp_path, "treatment", 24, 20, 3)
    v = verdict(control, treatment)
    assert v["verdict"] == "performance-scaling"
    assert v["control"]["effective"] == 8 and v["treatment"]["effective"] == 16
    assert v["control"]["resident"] == 8 and v["treatment"]["resident"] == 24
    assert v["control"]["resident_source"] == "telemetry"
    # goodput truths from the step model: 8 streams / 44 ms and 16 streams / 68 ms
    assert v["control"]["goodput_tok_s"] == pytest.approx(8 / 0.044, rel=0.12)
    assert v["treatment"]["goodput_tok_s"] == pytest.approx(16 / 0.068, rel=0.12)
    assert v["goodput_gain"]["beyond_noise"] and v["treatment_took_effect"] is True
    lv16 = next(x for x in v["per_level"] if x["level"] == 16)
    assert lv16["tpot_p95_ms"][1] == pytest.approx(68, abs=4)
    assert v["fixed_variables"]["under_test"] == ["serving.slots"]
    bounds = {(d["arm"], d["bound"]) for d in v["diagnosis"]}
    assert bounds == {("control", "kv_capacity"), ("treatment", "compute")}


def test_memory_that_buys_only_residency(tmp_path):
    # compute-bound: step = 20 ms + 5 ms × batch → TPOT 60 ms at 8, 100 ms at 16: more slots cannot help
    control = arm(tmp_path, "control", 8, 20, 5)
    treatment = arm(tmp_path, "treatment", 24, 20, 5)
    v = verdict(control, treatment)
    assert v["verdict"] == "capacity-only"
    assert v["control"]["effective"] == 8 and v["treatment"]["effective"] == 8
    assert v["control"]["resident"] == 8 and v["treatment"]["resident"] == 24
    assert not v["goodput_gain"]["beyond_noise"]
    assert ("treatment", "compute") in {(d["arm"], d["bound"]) for d in v["diagnosis"]}


def test_mismatched_manifests_exit_3(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with start_fake_server(ttft="5ms", itl="1ms") as srv:
        for out, n in ((a, "8"), (b, "9")):
            p = run_cli("bench", "--url", srv.url, "--out", str(out), "--quiet", "--concurrency", "2",
                        "--input-tokens", n, "--output-tokens", "4", "--warmup", "0s", "--requests", "4")
            assert p.returncode == 0, p.stderr
    p = run_cli("compare", str(a), str(b))
    assert p.returncode == 3
    assert "workload.input_tokens" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("compare", str(a), str(b), "--allow-diff", "workload.input_tokens,workload.prompt_set", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["fixed_variables"]["equal"] is True
