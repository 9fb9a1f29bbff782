"""llm-d's published tiered prefix-cache A/B against the simulator's prediction, with presets only.

Reads the published table (``data/llmd_tiered_prefix_cache.yaml``, source there), simulates both arms of
``scenarios/llmd-tiered-prefix-cache-ab.yaml`` at the four published stages with ``kvcap sim`` (nothing fitted to
the table: the model from its HF config, the H100 preset, the pools in tokens as the guide states them, vLLM's
defaults, llm-d's router at the guide's weights), and prints per stage the verdict (which arms meet p90 TTFT
≤ 3 s), mean and p90 TTFT, throughput (total tokens/s, prompt + output, as inference-perf reports it) and the
treatment/control throughput ratio; then each arm's knee (the highest stage meeting p90 TTFT ≤ 3 s) and the
wall time of the simulations.

    .venv/bin/python benchmarks/tier_fidelity.py [--duration 60s] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "scenarios" / "llmd-tiered-prefix-cache-ab.yaml"
PUBLISHED = ROOT / "data" / "llmd_tiered_prefix_cache.yaml"


def published() -> dict[str, Any]:
    return yaml.safe_load(PUBLISHED.read_text())


def arms() -> tuple[Path, list[tuple[str, dict[str, Any]]]]:
    """The experiment's scenario file and its arms' overrides, in order (control first)."""
    exp = yaml.safe_load(EXPERIMENT.read_text())
    return EXPERIMENT.parent / exp["scenario"], [(a["name"], a.get("set", {})) for a in exp["arms"]]


def simulate(stages: list[float], duration: str | None = None, extra: list[str] | None = None
             ) -> dict[str, dict[float, dict[str, float]]]:
    """Both arms through ``kvcap sim`` at ``stages`` (req/s): per arm and stage, mean and p90 TTFT (s), total
    tokens/s and the prompt tokens served from HBM and from the tier."""
    scenario, arm_sets = arms()
    out: dict[str, dict[float, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tier-fidelity-") as tmp:
        for name, sets in arm_sets:
            cmd = [sys.executable, "-m", "kvcap", "sim", str(scenario), "--out", f"{tmp}/{name}", "--json", "--quiet",
                   "--rate", ",".join(f"{s:g}" for s in stages)]
            if duration:
                cmd += ["--duration", duration]
            for key, value in {**sets}.items():
                cmd += ["--set", f"{key}={value}"]
            for item in extra or []:
                cmd += ["--set", item]
            run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if run.returncode not in (0, 1):
                raise SystemExit(f"kvcap sim failed for {name}: {run.stderr.strip().splitlines()[-1:]}")
            summary = json.loads(run.stdout)
            out[name] = {float(lv["level"]): _figures(lv, Path(tmp) / name) for lv in summary["levels"]}
    return out


def _figures(level: dict[str, Any], run_dir: Path) -> dict[str, float]:
    """A level's TTFT (s), total tokens/s and hit shares, from its summary line and its request records."""
    ttft = level.get("ttft_ms") or {}
    prompt = hbm = tier = 0
    out_tokens = level.get("output_tok_s") or 0.0
    per_request = []
    records = run_dir / "requests.jsonl"
    if records.is_file():
        for line in records.read_text().splitlines():
            r = json.loads(line)
            if r.get("level") != level.get("level") or r.get("phase", "measure") != "measure":
                continue
            prompt += r.get("input_tokens") or 0
            hbm += r.get("prefix_hit_tokens") or 0
            tier += r.get("tier_hit_tokens") or 0
            if r.get("ok"):
                per_request.append(((r.get("input_tokens") or 0), (r.get("output_tokens") or 0)))
    ins = sum(i for i, _ in per_request)
    outs = sum(o for _, o in per_request)
    total = out_tokens * (ins + outs) / outs if outs else 0.0  # output tok/s scaled by the prompt + output share
    return {"ttft_mean_s": (ttft.get("mean") or 0.0) / 1e3, "ttft_p90_s": (ttft.get("p90") or 0.0) / 1e3,
            "throughput_tok_s": total, "hit_hbm": hbm / prompt if prompt else 0.0,
            "hit_tier": tier / prompt if prompt else 0.0}


def knee(per_stage: dict[float, dict[str, float]], limit_s: float) -> float | None:
    """The highest stage whose p90 TTFT is within ``limit_s`` (None: none is)."""
    ok = [s for s, f in per_stage.items() if f["ttft_p90_s"] <= limit_s]
    return max(ok) if ok else None


def verdict(control: dict[str, float], treatment: dict[str, float], limit_s: float) -> str:
    """Which arms meet p90 TTFT ≤ limit at a stage: both, treatment only, control only, or neither."""
    c, t = control["ttft_p90_s"] <= limit_s, treatment["ttft_p90_s"] <= limit_s
    return {(True, True): "both", (False, True): "treatment only", (True, False): "control only",
            (False, False): "neither"}[(c, t)]


def compare(pub: dict[str, Any], sim: dict[str, dict[float, dict[str, float]]]) -> dict[str, Any]:
    """Stage by stage, published vs predicted: verdicts, TTFT, throughput and its ratio; each arm's knee."""
    limit = float(pub["knee_p90_ttft_s"])
    rows = []
    pub_arms: dict[str, dict[float, dict[str, float]]] = {"control": {}, "treatment": {}}
    for st in pub["stages"]:
        q = float(st["qps"])
        for arm in pub_arms:
            pub_arms[arm][q] = st[arm]
        c, t = sim["control"][q], sim["treatment"][q]
        p_ratio = st["treatment"]["throughput_tok_s"] / st["control"]["throughput_tok_s"]
        s_ratio = t["throughput_tok_s"] / c["throughput_tok_s"] if c["throughput_tok_s"] else float("nan")
        rows.append({"qps": q, "published": st, "predicted": {"control": c, "treatment": t},
                     "verdict": (verdict(st["control"], st["treatment"], limit), verdict(c, t, limit)),
                     "ratio": (p_ratio, s_ratio)})
    knees = {arm: (knee(pub_arms[arm], limit), knee(sim[arm], limit)) for arm in pub_arms}
    return {"rows": rows, "knees": knees, "limit_s": limit}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", help="seconds per stage (the published 60 s by default)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for both arms")
    a = ap.parse_args(argv)
    pub = published()
    stages = [float(s["qps"]) for s in pub["stages"]]
    t0 = time.perf_counter()
    sim = simulate(stages, a.duration, a.set)
    took = time.perf_counter() - t0
    res = compare(pub, sim)
    print(f"{'QPS':>4} | {'verdict pub / sim':>32} | {'arm':9} | {'TTFT mean s pub/sim':>19} | "
          f"{'TTFT p90 s pub/sim':>19} | {'tok/s pub/sim':>17} | {'hits HBM/tier':>13} | {'T/C ratio pub/sim':>17}")
    for row in res["rows"]:
        for arm in ("control", "treatment"):
            p, s = row["published"][arm], row["predicted"][arm]
            ratio = f"{row['ratio'][0]:5.2f} / {row['ratio'][1]:5.2f}" if arm == "treatment" else ""
            vd = f"{row['verdict'][0]} / {row['verdict'][1]}" if arm == "control" else ""
            print(f"{row['qps']:>4g} | {vd:>32} | {arm:9} | {p['ttft_mean_s']:>8.2f} / {s['ttft_mean_s']:<8.2f} | "
                  f"{p['ttft_p90_s']:>8.2f} / {s['ttft_p90_s']:<8.2f} | {p['throughput_tok_s']:>7.0f} / "
                  f"{s['throughput_tok_s']:<7.0f} | {s['hit_hbm']:>5.2f} / {s['hit_tier']:<5.2f} | {ratio:>17}")
    same = sum(r["verdict"][0] == r["verdict"][1] for r in res["rows"])
    within = sum(abs(r["ratio"][1] / r["ratio"][0] - 1) <= 0.25 for r in res["rows"])
    print(f"\nverdict same at {same} of {len(res['rows'])} stages; throughput ratio within 25% at {within} of "
          f"{len(res['rows'])}")
    for arm, (p, s) in res["knees"].items():
        print(f"knee (p90 TTFT <= {res['limit_s']:g} s) {arm:9}: published {p} QPS, predicted {s} QPS")
    print(f"simulated {2 * len(stages)} stage runs in {took:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
