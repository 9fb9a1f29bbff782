#!/usr/bin/env python3
"""Peak memory of `kvcap bench` against the run's length: does it stay flat as the request count grows?

    .venv/bin/python benchmarks/bench_memory.py [--sizes 2000,10000,40000] [--concurrency 64]

Each size is one `kvcap bench` process (closed loop, 16 in / 16 out tokens, every record written with its
per-token ITLs) against one fresh fake server streaming as fast as it can (``--ttft 0 --itl 0``), so the run is as
many requests per second as this machine serves. Prints, per size: wall seconds, requests/s, the bench process's
peak RSS (``wait4``'s ru_maxrss: the load generator, the writer and the closing analysis together) and
requests.jsonl's size. Flat means the peak does not grow with the request count once the level's in-flight state
is bounded.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.servers import start_fake_server  # noqa: E402 - the project's own test server, started as the tests do


def bench_case(url: str, requests: int, concurrency: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "kvcap", "bench", "--url", url, "--concurrency", str(concurrency),
               "--requests", str(requests), "--warmup", "0s", "--input-tokens", "16", "--output-tokens", "16",
               "--quiet", "--out", str(out)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, env=os.environ | {"PYTHONPATH": str(ROOT)})
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        if status != 0:
            raise SystemExit(f"kvcap bench failed ({status}): {' '.join(cmd)}")
        size = (out / "requests.jsonl").stat().st_size / 1e6
        with open(out / "requests.jsonl", "rb") as f:
            lines = sum(1 for _ in f)
    return {"requests": lines, "wall_s": wall, "req_s": lines / wall, "rss_mb": usage.ru_maxrss / 1024,
            "req_mb": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000,10000,40000", help="measured requests per run, comma-separated")
    ap.add_argument("--concurrency", type=int, default=64)
    a = ap.parse_args()
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        srv = start_fake_server(ttft="0ms", itl="0ms")
        try:
            rows.append(bench_case(srv.url, n, a.concurrency))
        finally:
            srv.stop()
    print(f"kvcap bench, closed loop c={a.concurrency}, 16/16 tokens, fake server at full speed")
    print(f"{'records':>9} {'wall s':>8} {'req/s':>8} {'peak RSS MB':>12} {'requests.jsonl MB':>18}")
    for r in rows:
        print(f"{r['requests']:>9.0f} {r['wall_s']:>8.1f} {r['req_s']:>8.0f} {r['rss_mb']:>12.0f} {r['req_mb']:>18.1f}")


if __name__ == "__main__":
    main()
