#!/usr/bin/env python3
"""Client CPU per 1k tokens of ``kvcap bench`` on Ray (2 actors on a local 2-node cluster) against one process and
against ``--workers 2`` (local processes), at equal load on the fixed-timing fake server (50 ms TTFT, 20 ms ITL).

Per run and level:

* **worker CPU s / 1k tok** — each worker's own CPU over its level (``levels.jsonl`` ``client.cpu_fraction`` ×
  the level's length, summed over workers; a Ray actor's process includes Ray's core-worker threads), over the
  output tokens of the level's records. The steady cost of driving the load.
* **driver CPU s / 1k tok** — the whole ``kvcap bench`` process (``getrusage(RUSAGE_CHILDREN)`` around it: imports,
  probing, connecting to Ray, merging records, summary), over every output token of the run. It counts the
  processes it reaps too: ``--workers 2``'s worker processes are in it, Ray actors (the cluster's) are not.
* **tok/s**, **TTFT p50**, **TPOT p50** — what each client saw (the server's truth: 50 ms, 20 ms).

    .venv/bin/python benchmarks/bench_ray.py                 # 32 and 256 streams, 1 s + 5 s per level
    .venv/bin/python benchmarks/bench_ray.py --streams 64 --duration 10

The Ray cluster (tests/ray_cluster.py) and the server run on this host too: on a small machine every column shares
its cores, so compare the rows side by side, not with another machine's figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcap.rundir import RunDir  # noqa: E402
from tests.ray_cluster import ray_cluster  # noqa: E402
from tests.servers import start_fake_server  # noqa: E402


def run_bench(url: str, out: Path, streams: str, warmup: float, duration: float, extra: list[str]) -> dict[str, Any]:
    """One ``kvcap bench`` subprocess; returns its summary and the CPU it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "kvcap", "bench", "--url", url, "--out", str(out), "--quiet",
                           "--json", "--concurrency", streams, "--input-tokens", "128", "--output-tokens", "128",
                           "--warmup", f"{warmup}s", "--duration", f"{duration}s", "--input-lengths", "local",
                           *extra], capture_output=True, text=True, timeout=600, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"kvcap bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"summary": json.loads(proc.stdout), "driver_cpu_s": cpu}


def level_rows(name: str, out: Path, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level: workers' CPU per 1k tokens of that level, and the driver's per 1k tokens of the run."""
    run = RunDir(out)
    recs = run.records()
    total_tokens = sum(r["output_tokens"] for r in recs)
    rows = []
    for lv in run.levels():
        tokens = sum(r["output_tokens"] for r in recs if r["level"] == lv["level"] and r["repeat"] == lv["repeat"])
        wall = lv["t_end_s"] - lv["t_start_s"]
        per_worker = lv["client"].get("per_worker") or [lv["client"]]
        worker_cpu = sum(w["cpu_fraction"] for w in per_worker) * wall
        s = next(x for x in result["summary"]["levels"] if x["level"] == lv["level"])
        rows.append({"client": name, "streams": int(lv["level"]), "workers": len(per_worker),
                     "worker_cpu_per_1k": 1000 * worker_cpu / max(tokens, 1),
                     "driver_cpu_per_1k": 1000 * result["driver_cpu_s"] / max(total_tokens, 1),
                     "tok_s": s.get("output_tok_s"), "ttft_p50": s["ttft_ms"]["p50"],
                     "tpot_p50": s["tpot_ms"]["p50"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'client':<16}{'streams':>8}{'workers':>8}{'worker CPU s/1k tok':>21}{'driver CPU s/1k tok':>21}"
            f"{'tok/s':>9}{'TTFT p50':>10}{'TPOT p50':>10}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["streams"], r["client"])):
        lines.append(f"{r['client']:<16}{r['streams']:>8}{r['workers']:>8}{r['worker_cpu_per_1k']:>21.4f}"
                     f"{r['driver_cpu_per_1k']:>21.4f}{r['tok_s'] or 0:>9.0f}{r['ttft_p50']:>10.1f}"
                     f"{r['tpot_p50']:>10.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="32,256", help="closed-loop levels (32,256)")
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=5.0)
    a = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvcap-bench-ray-") as tmp, \
            ray_cluster(Path(tmp) / "ray", nodes=2) as cluster, \
            start_fake_server(ttft="50ms", itl="20ms") as srv:
        for name, extra in (("1 process", []), ("--workers 2", ["--workers", "2"]),
                            ("--ray 2 workers", ["--ray", cluster.address, "--workers", "2"])):
            out = Path(tmp) / name.replace(" ", "_").strip("-")
            rows += level_rows(name, out, run_bench(srv.url, out, a.streams, a.warmup, a.duration, extra))
    print(table(rows))


if __name__ == "__main__":
    main()
