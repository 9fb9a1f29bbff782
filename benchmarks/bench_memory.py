#!/usr/bin/env python3
"""Peak memory of `kvcap bench` against the run's length: does it stay flat as the request count grows?

    .venv/bin/python benchmarks/bench_memory.py [--sizes 2000,10000,40000] [--concurrency 64 | --rate 1500]

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

PROBE = """
import resource, sys
import kvcap.loadgen.bench as b
from kvcap.cli import main
inner = b.build_summary
def probe(*a, **k):
    print(f"probe {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
    return inner(*a, **k)
b.build_summary = probe
sys.exit(main(sys.argv[1:]))
"""
"""``kvcap bench`` with one probe: its peak RSS when the closing summary starts (the run alone)."""


def bench_case(url: str, requests: int, concurrency: int, rate: float | None = None) -> dict[str, float]:
    """One run: closed loop at ``concurrency`` for ``requests``, or (``rate``) open loop for as long as that many
    requests take at that rate."""
    load = (["--concurrency", str(concurrency), "--requests", str(requests)] if rate is None else
            ["--rate", f"{rate:g}", "--duration", f"{requests / rate:.3f}s"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-c", PROBE, "bench", "--url", url, *load, "--warmup", "0s", "--input-tokens", "16",
               "--output-tokens", "16", "--quiet", "--out", str(out)]
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=os.environ | {"PYTHONPATH": str(ROOT)})
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        if status != 0:
            raise SystemExit(f"kvcap bench failed ({status}): {' '.join(cmd)}\n{err}")
        at_summary = next(int(line.split()[1]) for line in err.splitlines() if line.startswith("probe "))
        size = (out / "requests.jsonl").stat().st_size / 1e6
        with open(out / "requests.jsonl", "rb") as f:
            lines = sum(1 for _ in f)
    return {"requests": lines, "wall_s": wall, "req_s": lines / wall, "rss_mb": usage.ru_maxrss / 1024,
            "req_mb": size, "at_summary_mb": at_summary / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2000,10000,40000", help="measured requests per run, comma-separated")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rate", type=float, default=None,
                    help="open loop at this many requests/s instead (each size: as long as it takes at that rate)")
    a = ap.parse_args()
    rows = []
    for n in (int(x) for x in a.sizes.split(",")):
        srv = start_fake_server(ttft="0ms", itl="0ms")
        try:
            rows.append(bench_case(srv.url, n, a.concurrency, a.rate))
        finally:
            srv.stop()
    how = f"closed loop c={a.concurrency}" if a.rate is None else f"open loop {a.rate:g} req/s"
    print(f"kvcap bench, {how}, 16/16 tokens, fake server at full speed")
    print(f"{'records':>9} {'wall s':>8} {'req/s':>8} {'peak RSS MB':>12} {'MB at summary':>14} "
          f"{'requests.jsonl MB':>18}")
    for r in rows:
        print(f"{r['requests']:>9.0f} {r['wall_s']:>8.1f} {r['req_s']:>8.0f} {r['rss_mb']:>12.0f} "
              f"{r['at_summary_mb']:>14.0f} {r['req_mb']:>18.1f}")


if __name__ == "__main__":
    main()
