#!/usr/bin/env python3
"""Points per minute of ``kvcap search`` on one grid: 1 local process, N local processes (``--jobs N``) and Ray
tasks on a local 2-node cluster (``--ray``, tests/ray_cluster.py), and whether each wrote the same points.jsonl as
the single process (it must: the simulations are deterministic by seed).

The grid: the issue's KV dtype × offload tier × VRAM grid on the seed's reference scenario, times
``cluster.nodes`` (``--nodes``, default 2,4), levels up to 192. Each row is one ``kvcap search`` subprocess:
**points/min** from search.json (the search itself: points over its wall time), **total s** the whole command
(Python start-up and, on Ray, joining the cluster included).

    .venv/bin/python benchmarks/search_speed.py                  # 16 points, 1 vs cores processes vs Ray
    .venv/bin/python benchmarks/search_speed.py --jobs 4 --nodes 2,4,8 --duration 30

Everything runs on this host: on a small machine the Ray nodes share the same cores as the processes, so Ray's
row shows its overhead, not a second machine's worth of speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.ray_cluster import ray_available, ray_cluster  # noqa: E402

SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"


def grid_args(nodes: str) -> list[str]:
    return ["--grid", "model.kv_dtype=fp16,fp8", "--grid", "serving.kv_offload=none,remote",
            "--grid", "cluster.gpu.memory=24GiB,48GiB", "--grid", f"cluster.nodes={nodes}"]


def run_search(out: Path, args: list[str], duration: float, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvcap", "search", str(SCENARIO), *args, "--concurrency", "48,64,96,128,192",
           "--duration", f"{duration:g}s", "--warmup", "5s", "--repeats", "1", "--target", "effective>=96",
           "--summary-only", "--quiet", "--out", str(out), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"kvcap search failed ({proc.returncode}): {proc.stderr[-2000:]}")
    search = json.loads((out / "search.json").read_text())
    return {"search": search, "total_s": total, "points": (out / "points.jsonl").read_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="local processes for the N row (cores)")
    ap.add_argument("--nodes", default="2,4", help="values of cluster.nodes in the grid (2,4: 16 points)")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per level (20)")
    ap.add_argument("--ray-cpus", type=int, default=max((os.cpu_count() or 2) // 2, 1),
                    help="CPUs each of the 2 Ray nodes offers (half the cores)")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcap-search-speed-") as tmp:
        base = Path(tmp)
        args = grid_args(a.nodes)
        cases: list[tuple[str, list[str]]] = [("1 process", ["--jobs", "1"]),
                                              (f"{a.jobs} processes", ["--jobs", str(a.jobs)])]
        results = {name: run_search(base / f"local-{i}", args, a.duration, extra)
                   for i, (name, extra) in enumerate(cases)}
        if ray_available():
            with ray_cluster(base / "ray-logs", nodes=2, num_cpus=a.ray_cpus) as cluster:
                name = f"Ray, 2 nodes × {a.ray_cpus} CPU"
                results[name] = run_search(base / "ray", args, a.duration, ["--ray", cluster.address])
                nodes = {json.loads(x)["node"] for x in (base / "ray" / "timings.jsonl").read_text().splitlines()}
                results[name]["nodes_used"] = len(nodes)
        reference = results["1 process"]["points"]
        for name, r in results.items():
            s = r["search"]
            rows.append((name, s["finished"], s["wall_s"], r["total_s"], s["points_per_min"],
                         "yes" if r["points"] == reference else "NO", r.get("nodes_used", "")))
    head = f"{'executor':<24}{'points':>7}{'search s':>10}{'total s':>9}{'points/min':>12}{'same points':>13}" \
           f"{'nodes used':>12}"
    print(head)
    print("-" * len(head))
    for name, n, wall, total, ppm, same, used in rows:
        print(f"{name:<24}{n:>7}{wall:>10.2f}{total:>9.2f}{ppm:>12.1f}{same:>13}{used!s:>12}")
    print(f"\n(cores on this host: {os.cpu_count()}; the grid: kv_dtype × kv_offload × gpu.memory × "
          f"nodes={a.nodes}, levels 48-192, {a.duration:g} s per level)")


if __name__ == "__main__":
    main()
