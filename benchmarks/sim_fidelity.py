"""How close the simulator comes to real vLLM runs, with presets alone (no fitting to these runs).

Reads the published measurements in ``data/vllm_measured.yaml`` (sources there), simulates each point
with the same GPU, model, dtype, engine limits, lengths and load, and prints mean TTFT, TPOT, E2E and output
throughput, measured vs simulated, with the error. Throughput and latencies are computed from the simulated
records exactly as ``benchmark_serving.py`` does: total output tokens / (last completion − first send); E2E of
the measured runs is derived as TTFT + TPOT × (mean output − 1).

    .venv/bin/python benchmarks/sim_fidelity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcap.rundir import RunDir  # noqa: E402
from kvcap.sim.run import SimConfig, run_sim  # noqa: E402
from kvcap.specs.lengths import parse_length  # noqa: E402
from kvcap.specs.scenario import build_scenario  # noqa: E402
from kvcap.workload.loadplan import LoadPlan  # noqa: E402


def simulate(scenario: dict[str, Any], mode: str, level: float, requests: int | None) -> dict[str, float]:
    sc = build_scenario(scenario, "fidelity")
    if mode == "burst":  # N requests at once, nothing after: a closed loop of N with a quota of N
        plan = LoadPlan(mode="concurrency", levels=(level,), warmup_s=0.0, duration_s=None, requests=int(level))
    else:
        plan = LoadPlan(mode="rate", levels=(level,), warmup_s=0.0, duration_s=None, requests=requests,
                        arrival="poisson")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        run_sim(SimConfig(scenario=sc, plan=plan, out=out, record_itl=False))
        recs = [r for r in RunDir(out).records() if r["ok"]]
    start = min(r["start_s"] for r in recs)
    end = max(r["end_s"] for r in recs)
    out_tokens = sum(r["output_tokens"] for r in recs)
    return {"ttft_ms": float(np.mean([r["ttft_ms"] for r in recs])),
            "tpot_ms": float(np.mean([r["tpot_ms"] for r in recs if r["tpot_ms"] is not None])),
            "e2e_ms": float(np.mean([r["e2e_ms"] for r in recs])),
            "output_tok_s": out_tokens / (end - start), "mean_out": out_tokens / len(recs)}


def main() -> None:
    data = yaml.safe_load((ROOT / "data" / "vllm_measured.yaml").read_text())
    errors: dict[str, list[float]] = {"ttft_ms": [], "tpot_ms": [], "e2e_ms": [], "output_tok_s": []}
    per_set: dict[str, dict[str, list[float]]] = {}
    print(f"{'set':26} {'level':>6} | {'TTFT ms meas/sim':>18} | {'TPOT ms meas/sim':>18} | {'E2E s meas/sim':>15} "
          f"| {'out tok/s meas/sim':>19}")
    for s in data["sets"]:
        out_mean = parse_length(s["scenario"]["workload"]["output_tokens"]).mean
        for p in s["points"]:
            sim = simulate(s["scenario"], s["load"]["mode"], float(p["level"]), s["load"].get("requests"))
            meas = dict(p)
            meas["e2e_ms"] = p["ttft_ms"] + p["tpot_ms"] * (out_mean - 1)
            for k in errors:
                errors[k].append(sim[k] / meas[k] - 1)
                per_set.setdefault(s["name"], {}).setdefault(k, []).append(sim[k] / meas[k] - 1)
            print(f"{s['name']:26} {p['level']:>6g} | {meas['ttft_ms']:>8.0f} / {sim['ttft_ms']:<7.0f} | "
                  f"{meas['tpot_ms']:>8.2f} / {sim['tpot_ms']:<7.2f} | {meas['e2e_ms'] / 1e3:>6.2f} / "
                  f"{sim['e2e_ms'] / 1e3:<6.2f} | {meas['output_tok_s']:>8.0f} / {sim['output_tok_s']:<8.0f}")
    print()
    for name, errs in per_set.items():
        print(f"{name:26} " + "   ".join(f"{k} {np.mean(np.abs(v)):5.1%}" for k, v in errs.items()))
    print()
    for k, v in errors.items():
        a = np.abs(np.asarray(v))
        print(f"{k:13} mean |error| {a.mean():6.1%}   median {np.median(a):6.1%}   worst {a.max():6.1%}   "
              f"bias {np.mean(v):+6.1%}")


if __name__ == "__main__":
    main()
