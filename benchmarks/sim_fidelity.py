"""How close the simulator comes to real vLLM runs, with presets alone (no fitting to these runs).

Reads the published measurements in ``data/vllm_measured.yaml`` (sources there), simulates each point
with the same GPU, model, dtype, engine limits, lengths and load, and prints mean TTFT, TPOT, E2E and output
throughput, measured vs simulated, with the error. Throughput and latencies are computed from the simulated
records exactly as ``benchmark_serving.py`` does: total output tokens / (last completion − first send); E2E on
both sides is derived as the sources derive it, TTFT + TPOT × (mean output − 1). Each point is replayed as
``benchmarks/calibration.py`` replays it (``benchmarks.published.replay``).

    .venv/bin/python benchmarks/sim_fidelity.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.published import PublishedSet, e2e_s, load_sets, replay  # noqa: E402
from kvcap.specs.scenario import build_scenario  # noqa: E402


def simulate(s: PublishedSet, level: float) -> dict[str, float]:
    """One point replayed as ``benchmarks/calibration.py`` replays it (``published.replay``: a burst as a quota of
    N sent at once, a rate as the same request set at every rate, averaged over its replays), with the presets'
    cost model."""
    o = replay(s, build_scenario(s.scenario, "fidelity"), level)
    assert o is not None, (s.name, level)
    return {"ttft_ms": o.ttft_p50 * 1e3, "tpot_ms": o.tpot_p50 * 1e3,
            "e2e_ms": e2e_s(o.ttft_p50, o.tpot_p50, o.output_tokens) * 1e3, "output_tok_s": o.throughput}


def main() -> None:
    errors: dict[str, list[float]] = {"ttft_ms": [], "tpot_ms": [], "e2e_ms": [], "output_tok_s": []}
    per_set: dict[str, dict[str, list[float]]] = {}
    print(f"{'set':26} {'level':>6} | {'TTFT ms meas/sim':>18} | {'TPOT ms meas/sim':>18} | {'E2E s meas/sim':>15} "
          f"| {'out tok/s meas/sim':>19}")
    for s in load_sets(ROOT / "data" / "vllm_measured.yaml"):
        out_mean = s.lengths[1]
        for p in s.points:
            sim = simulate(s, p["level"])
            meas = dict(p)
            meas["e2e_ms"] = p["ttft_ms"] + p["tpot_ms"] * (out_mean - 1)
            for k in errors:
                errors[k].append(sim[k] / meas[k] - 1)
                per_set.setdefault(s.name, {}).setdefault(k, []).append(sim[k] / meas[k] - 1)
            print(f"{s.name:26} {p['level']:>6g} | {meas['ttft_ms']:>8.0f} / {sim['ttft_ms']:<7.0f} | "
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
