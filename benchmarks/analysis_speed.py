"""How long `kvcap analyze` takes, and its peak memory, on big run directories of synthetic records.

    python benchmarks/analysis_speed.py [--sizes 1000000,10000000] [--itl 0|256] [--baseline DIR] [--rounds 1]

Each size's run (10 levels, sim-style records; --itl N gives each request a per-token ITL list of N, as
`kvcap sim` writes by default) is written under /tmp and deleted after. ``build_summary`` then runs in a child
process per path, so its wall time, CPU time and peak RSS (its VmHWM) are the analysis alone: "new" is this
checkout, "old" (with --baseline DIR, a folder holding an older ``kvcap`` package, e.g. ``git archive HEAD kvcap
| tar -x -C DIR``) the same command on that code, alternated --rounds times. The old path's child gets an
address-space cap (--old-cap-gb) so a run too big for it fails with MemoryError instead of swamping the host.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

from kvcap.rundir import Manifest, RunWriter

LEVELS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96]
CHILD = """
import hashlib, json, sys, time
import kvcap
assert kvcap.__file__.startswith(sys.argv[2]), (kvcap.__file__, sys.argv[2])
from kvcap.analysis.summary import build_summary
from kvcap.rundir import RunDir
t = time.perf_counter()
s = build_summary(RunDir(sys.argv[1]))
wall = time.perf_counter() - t
hwm = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
print(json.dumps({"wall": wall, "rss_mb": hwm / 1024, \
"digest": hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest(),
                  "levels": len(s["levels"]), "effective": s["capacity"]["effective"]}))
"""


def write_run(out: Path, n: int, itl: int) -> None:
    """n records over 10 closed-loop levels, each level's measured window from its line in levels.jsonl; every
    field a ``sim`` record has (``rundir.RequestRecord``'s core), rounded as ``sim`` rounds them."""
    rng = np.random.default_rng(0)
    w = RunWriter(out)
    w.manifest(Manifest(source="sim", run_id="analysis-speed", started_at=0.0, fixed={},
                        slo={"ttft_p95": 500.0, "tpot_p95": 80.0}))
    per = n // len(LEVELS)
    t = 0.0
    with open(out / "requests.jsonl", "wb") as f:
        for lv in LEVELS:
            dur = per / lv * 0.5
            starts = t + np.sort(rng.uniform(0, dur, per))
            ttft = rng.gamma(4, 20 + lv, per)
            tpot = 20 + lv * 0.5 + rng.normal(0, 1, per)
            for i0 in range(0, per, 10_000):
                lines = []
                for i in range(i0, min(i0 + 10_000, per)):
                    e2e = ttft[i] + tpot[i] * 255
                    rec = {"mode": "concurrency", "level": lv, "repeat": 0, "phase": "measure", "worker": 0,
                           "index": i, "start_s": round(float(starts[i]), 6),
                           "end_s": round(float(starts[i] + e2e / 1e3), 6), "send_delay_ms": 0.0, "ok": True,
                           "error": None, "status": 200, "input_tokens": 1024, "output_tokens": 256,
                           "requested_output_tokens": 256, "tokens_source": "sim",
                           "ttft_ms": round(float(ttft[i]), 3), "tpot_ms": round(float(tpot[i]), 3),
                           "e2e_ms": round(float(e2e), 3), "itl_ms": [], "queue_ms": None, "finish_reason": "length",
                           "truncated": False, "early_stop": False, "retries": 0, "group": None}
                    if itl:
                        rec["itl_ms"] = np.round(tpot[i] + rng.normal(0, 0.5, itl), 3).tolist()
                    lines.append(orjson.dumps(rec))
                f.write(b"\n".join(lines) + b"\n")
            w.level({"mode": "concurrency", "level": lv, "repeat": 0, "measure_start_s": t, "measure_end_s": t + dur})
            t += dur + 1
    w.close()


def analyse(run: Path, pythonpath: str, cap_gb: float | None) -> dict:
    """build_summary in a child: its own wall time, its peak RSS, and a digest of the summary it built."""
    env = dict(os.environ, PYTHONPATH=pythonpath)

    def limit() -> None:
        if cap_gb:
            cap = int(cap_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(run), pythonpath], env=env, cwd=run.parent,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit)
    _, status, usage = os.wait4(p.pid, 0)
    out, err = p.stdout.read(), p.stderr.read()  # type: ignore[union-attr]
    p.returncode = os.waitstatus_to_exitcode(status)
    # ru_maxrss would count the pages this (big) process had when it forked the child; the child's own VmHWM is
    # its peak after exec, the analysis alone (ru_maxrss stays the figure when the child dies)
    res = {"rss_mb": usage.ru_maxrss / 1024, "total": time.perf_counter() - t,
           "cpu": usage.ru_utime + usage.ru_stime}
    if p.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        return res | {"error": f"failed ({last[0][:50]})"}
    return res | orjson.loads(out.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1000000", help="comma-separated record counts")
    ap.add_argument("--itl", type=int, default=0, help="per-token ITLs per request (0: none, like --no-itl)")
    ap.add_argument("--baseline", help="a folder holding the old kvcap package, to compare against")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--old-cap-gb", type=float, default=8.0)
    ap.add_argument("--tmp", default="/tmp")
    a = ap.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    paths = ([("old", a.baseline)] if a.baseline else []) + [("new", here)]
    print("| records | ITLs/request | requests.jsonl MB | path | wall s (build_summary) | CPU s (process) "
          "| peak RSS MB | same summary |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in a.sizes.split(",")):
        tmp = Path(tempfile.mkdtemp(prefix="kvcap-analysis-speed-", dir=a.tmp))
        try:
            t0 = time.perf_counter()
            write_run(tmp / "run", n, a.itl)
            mb = (tmp / "run" / "requests.jsonl").stat().st_size / 1e6
            print(f"<!-- wrote {n:,} records ({mb:.0f} MB) in {time.perf_counter() - t0:.0f} s -->", flush=True)
            digests: dict[str, str] = {}
            for _ in range(a.rounds):
                for name, pp in paths:
                    r = analyse(tmp / "run", pp, a.old_cap_gb if name == "old" else None)
                    wall = f"{r['wall']:.2f}" if "wall" in r else r["error"]
                    same = ""
                    if "digest" in r:
                        digests.setdefault(name, r["digest"])
                        same = "" if len(digests) < 2 else ("yes" if len(set(digests.values())) == 1 else "NO")
                    print(f"| {n:,} | {a.itl} | {mb:.0f} | {name} | {wall} | {r['cpu']:.1f} | {r['rss_mb']:.0f} "
                          f"| {same} |", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
