"""How fast the simulator runs: simulated requests per second of wall time and the real-time factor.

The goal (issue 5): 100,000 requests of 1,024 in / 256 out on the reference cluster (4 × RTX 4090, Llama-2-7B)
in ≤ 10 s of wall time on one core. Baseline on the same machine: the same simulator with decode spans turned
off (one event per engine step, the way step-level simulators such as Vidur advance), so the ratio is what the
closed-form spans buy. Each case runs in this process, one core, records kept in memory or written to disk.

    .venv/bin/python benchmarks/sim_speed.py [--requests 100000]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcap.rundir import RunWriter  # noqa: E402
from kvcap.sim.cluster import cluster_model  # noqa: E402
from kvcap.sim.run import simulate_level  # noqa: E402
from kvcap.specs.scenario import load_scenario  # noqa: E402
from kvcap.workload.loadplan import LoadPlan  # noqa: E402


class NullWriter:
    """Keeps nothing: measures the engine alone."""

    records = 0

    def record(self, rec: dict[str, Any]) -> None:
        self.records += 1

    def level(self, info: dict[str, Any]) -> None:
        pass

    def telemetry(self, rows: list[dict[str, Any]]) -> None:
        pass


def case(name: str, overrides: dict[str, Any], concurrency: int, requests: int, per_step: bool = False,
         to_disk: bool = False, itl: bool = True) -> dict[str, Any]:
    sc = load_scenario(ROOT / "scenarios" / "seed-reference.yaml",
                       {"workload.input_tokens": 1024, "workload.output_tokens": 256, **overrides})
    cm = cluster_model(sc)
    if per_step:
        build = cm.build

        def build_per_step(on_finish=None):  # type: ignore[no-untyped-def]
            sim = build(on_finish)
            sim.max_span = 1
            return sim

        object.__setattr__(cm, "build", build_per_step)
    plan = LoadPlan(mode="concurrency", levels=(float(concurrency),), warmup_s=0.0, duration_s=None,
                    requests=requests, repeats=1)
    tmp = tempfile.TemporaryDirectory()
    writer: Any = RunWriter(Path(tmp.name) / "run") if to_disk else NullWriter()
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    info, simulated = simulate_level(cm, plan, float(concurrency), 0, 0.0, writer, record_itl=itl)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    if to_disk:
        writer.close()
        size = sum(f.stat().st_size for f in (Path(tmp.name) / "run").iterdir())
    else:
        size = 0
    tmp.cleanup()
    n = info["sim"]["finished"]
    return {"case": name, "requests": n, "wall_s": wall, "cpu_s": cpu, "simulated_s": simulated,
            "req_per_s": n / wall, "realtime": simulated / wall, "events": info["sim"]["events"],
            "mb_written": size / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--baseline-requests", type=int, default=10_000,
                    help="requests for the per-step baseline (it is slow; rates are per request)")
    a = ap.parse_args()
    rows = [
        case("control c=48, engine only", {}, 48, a.requests),
        case("treatment (remote) c=96, engine only", {"serving.kv_offload": "remote"}, 96, a.requests),
        case("control c=48, records + ITLs to disk", {}, 48, a.requests, to_disk=True),
        case("baseline: one event per step, c=48", {}, 48, a.baseline_requests, per_step=True),
    ]
    print(f"{'case':42} {'requests':>9} {'wall s':>7} {'req/s':>9} {'× real time':>12} {'events':>9} {'MB':>6}")
    for r in rows:
        print(f"{r['case']:42} {r['requests']:>9,} {r['wall_s']:>7.2f} {r['req_per_s']:>9,.0f} {r['realtime']:>12,.0f} "
              f"{r['events']:>9,} {r['mb_written']:>6.0f}")
    base = rows[-1]["req_per_s"]
    print(f"\nspans vs one event per step: {rows[0]['req_per_s'] / base:.1f}× the simulated requests per second")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    goal = rows[0]["wall_s"] * 100_000 / max(rows[0]["requests"], 1)
    print(f"100,000 requests (control, engine only): {goal:.1f} s wall (goal ≤ 10 s)")


if __name__ == "__main__":
    main()
