"""How long `kvcap analyze` takes on a big run directory: N synthetic records (default 1,000,000).

    python benchmarks/analysis_speed.py [--records 1000000] [--itl 0|16]

Prints the time to read requests.jsonl and to summarise it, per million records. Records look like `sim`'s
(no per-token ITL list) unless --itl gives one per request.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from kvcap.analysis.summary import build_summary
from kvcap.rundir import Manifest, RunDir, RunWriter


def write_run(out: Path, n: int, itl: int) -> None:
    rng = np.random.default_rng(0)
    w = RunWriter(out)
    w.manifest(Manifest(source="sim", run_id="analysis-speed", started_at=0.0, fixed={},
                        slo={"ttft_p95": 500.0, "tpot_p95": 80.0}))
    levels = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96]
    per = n // len(levels)
    t = 0.0
    with open(out / "requests.jsonl", "w") as f:
        for lv in levels:
            dur = per / lv * 0.5
            starts = t + np.sort(rng.uniform(0, dur, per))
            ttft = rng.gamma(4, 20 + lv, per)
            tpot = 20 + lv * 0.5 + rng.normal(0, 1, per)
            for i in range(per):
                e2e = ttft[i] + tpot[i] * 255
                rec = {"mode": "concurrency", "level": lv, "repeat": 0, "phase": "measure", "start_s": starts[i],
                       "ok": True, "error": None, "input_tokens": 1024, "output_tokens": 256, "ttft_ms": ttft[i],
                       "tpot_ms": tpot[i], "e2e_ms": e2e, "queue_ms": None}
                if itl:
                    rec["itl_ms"] = [round(float(tpot[i]), 3)] * itl
                f.write(json.dumps(rec) + "\n")
            w.level({"mode": "concurrency", "level": lv, "repeat": 0, "measure_start_s": t, "measure_end_s": t + dur})
            t += dur + 1
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--itl", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        t0 = time.perf_counter()
        write_run(out, a.records, a.itl)
        t1 = time.perf_counter()
        recs = RunDir(out).records()
        t2 = time.perf_counter()
        summary = build_summary(RunDir(out))
        t3 = time.perf_counter()
    print(f"records: {len(recs):,} (ITL list of {a.itl} per request); generating took {t1 - t0:.1f} s")
    print(f"read requests.jsonl: {t2 - t1:.2f} s; build_summary (read + statistics + checks): {t3 - t2:.2f} s")
    print(f"per million records: {(t3 - t2) / len(recs) * 1e6:.2f} s; levels: {len(summary['levels'])}, "
          f"effective {summary['capacity']['effective']}")


if __name__ == "__main__":
    main()
