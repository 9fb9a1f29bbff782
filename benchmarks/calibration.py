"""Held-out prediction errors of a calibrated simulator against published real-vLLM runs.

For each published set in ``data/vllm_measured.yaml`` (sources there): calibrate the step cost on its lowest
third of load levels (at least two) through ``benchmarks.published`` (the same fit ``kvcap calibrate`` runs),
predict every other level with the simulator, and print one table of the errors on the predicted points only —
the fit never sees them. The A100 0.25-utilisation set is predicted from the 0.5 set's fit with only the KV pool
changed to the one its log states (a what-if on memory: none of its points is fitted).

    .venv/bin/python benchmarks/calibration.py [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.published import (  # noqa: E402
    ITL_KEYS,
    PublishedSet,
    calibrate_and_predict,
    errors_pct,
    load_sets,
    observations,
    replay,
    rows,
)
from kvcap.calibrate.simulate import cost_vector  # noqa: E402
from kvcap.specs.scenario import build_scenario  # noqa: E402

DATA = ROOT / "data" / "vllm_measured.yaml"
WHAT_IF = {"a100-qwen2-7b-util0.25": "a100-qwen2-7b-util0.5"}
"""Sets with no fit of their own: predicted from another set's fit (same server, a different KV pool)."""
METRICS = ("tpot", "e2e", "throughput", "ttft")


def fit_levels(s: PublishedSet) -> tuple[float, ...]:
    """The lowest third of a set's levels, at least two: fixed before looking at any error."""
    levels = sorted(p["level"] for p in s.points)
    return tuple(levels[:max(2, math.ceil(len(levels) / 3))])


def predictions(sets: list[PublishedSet]) -> list[dict[str, Any]]:
    by_name = {s.name: s for s in sets}
    out = []
    for s in sets:
        source = by_name[WHAT_IF[s.name]] if s.name in WHAT_IF else s
        p = calibrate_and_predict(source, fit_levels(source), target=s if source is not s else None)
        out += [{**r, "fit_on": f"{source.name} @ {', '.join(f'{v:g}' for v in p.fitted)}",
                 "step_cost_ms": [round(v * 1e3, 5) for v in cost_vector(p.fit.cost)]} for r in rows(p)]
    return out


def uncalibrated(sets: list[PublishedSet], table: list[dict[str, Any]]) -> dict[str, float]:
    """Mean |error| of the presets-only simulator (``benchmarks/sim_fidelity.py``) on the same held-out points."""
    by_name = {s.name: s for s in sets}
    errs: dict[str, list[float]] = {m: [] for m in METRICS}
    for r in table:
        s = by_name[r["set"]]
        meas = next(o for o in observations(s) if o.level == r["level"])
        e = errors_pct(meas, replay(s, build_scenario(s.scenario, "presets"), r["level"]))
        for m in METRICS:
            if e[m] is not None and (m != "ttft" or not r["ttft_cached"]):
                errs[m].append(abs(e[m]))
    return {m: float(np.mean(v)) for m, v in errs.items()}


def fmt(v: float | None) -> str:
    return "   –   " if v is None else f"{v:+6.1f}%"


def header(name: str = "set", width: int = 24) -> str:
    return (f"{name:{width}} {'level':>5} {'fit on':>12} | {'TPOT ms meas/sim':>22} | {'E2E s meas/sim':>21} | "
            f"{'out tok/s meas/sim':>24} | {'TTFT ms meas/sim':>24}")


def row_text(r: dict[str, Any], fit_on: str, width: int = 24) -> str:
    """One predicted point: measured / simulated and the signed error of TPOT, E2E, throughput and TTFT."""
    m, s, e = r["measured"], r["simulated"], r["error_pct"]
    return (f"{r['set']:{width}} {r['level']:>5g} {fit_on:>12} | {m['tpot_ms']:6.2f} / {s['tpot_ms']:6.2f} "
            f"{fmt(e['tpot'])} | {m['e2e_ms'] / 1e3:5.2f} / {s['e2e_ms'] / 1e3:5.2f} {fmt(e['e2e'])} | "
            f"{m['output_tok_s']:6.0f} / {s['output_tok_s']:6.0f} {fmt(e['throughput'])} | "
            f"{m['ttft_ms']:6.0f} / {s['ttft_ms']:6.0f} {fmt(e['ttft'])}")


def itl_text(r: dict[str, Any], width: int = 24) -> str:
    """One point's pooled inter-token gap percentiles, measured / simulated and the signed error."""
    m, s = r["itl_ms"]["measured"], r["itl_ms"]["simulated"]
    cells = [f"{k[4:7]} {m[k]:6.2f} / {s[k]:6.2f} {fmt(100 * (s[k] / m[k] - 1))}" for k in ITL_KEYS]
    return f"{r['set']:{width}} {r['level']:>5g} | " + " | ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    sets = load_sets(DATA)
    table = predictions(sets)
    if args.json:
        print(json.dumps(table, indent=1))
        return
    print(header())
    for r in table:
        fit_on = r["fit_on"].split(" @ ")[1] + ("*" if not r["fit_on"].startswith(r["set"] + " ") else "")
        print(row_text(r, fit_on) + (" c" if r["ttft_cached"] else "") + (" w" if r["warm"] else "")
              + (" s" if r["saturated"] else ""))
    print("* fitted on a100-qwen2-7b-util0.5's levels, KV pool changed to the 93,872 tokens this set's log states")
    print("c: measured TTFT below the floor of an uncached prefill (FLOPs at the GPU's peak): prefix-cache hits")
    print("w: ran after other runs of the same prompts on the same server (prefix caching on): replayed after them, "
          "the prefix cache carried")
    print("s: saturated — throughput grew under 5% from the rate below, or a burst's prompts exceed one step's "
          "token budget: TTFT is the queue's order")
    gaps = [r for r in table if r["itl_ms"] and r["itl_ms"]["simulated"]]
    if gaps:
        print()
        print("inter-token gaps (not fitted; where the step is off): ms measured / simulated")
        for r in gaps:
            print(itl_text(r))
    print()
    presets = uncalibrated(sets, table)
    for k, cached in [(m, True) for m in METRICS] + [("ttft", False)]:
        a = np.abs([r["error_pct"][k] for r in table if r["error_pct"][k] is not None
                    and (cached or not r["ttft_cached"])])
        base = f"   presets alone {presets[k]:5.1f}%" if k != "ttft" or not cached else ""
        k = k if cached else "ttft (uncached points)"
        print(f"{k:10} held-out mean |error| {a.mean():5.1f}%   median {np.median(a):5.1f}%   worst {a.max():5.1f}%"
              f"   within 10%: {int((a <= 10).sum())}/{len(a)}{base}")
    below = np.abs([r["error_pct"]["ttft"] for r in table if r["error_pct"]["ttft"] is not None
                    and not r["ttft_cached"] and not r["saturated"]])
    print(f"ttft below saturation (uncached) mean |error| {below.mean():5.1f}%   worst {below.max():5.1f}%   "
          f"within 20%: {int((below <= 20).sum())}/{len(below)}")
    seen: dict[str, list[float]] = {}
    for r in table:
        seen.setdefault(r["fit_on"], r["step_cost_ms"])
    for f, c in seen.items():
        print(f"fit {f}: base {c[0]:.4g} ms, per_decode {c[1]:.4g} ms, per_prefill_token {c[2]:.4g} ms, "
              f"per_context_token {c[3]:.4g} ms")


if __name__ == "__main__":
    main()
