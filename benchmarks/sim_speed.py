"""How fast the simulator runs: simulated requests per second of wall time and the real-time factor.

The goal (issue 5): 100,000 requests of 1,024 in / 256 out on the reference cluster (4 × RTX 4090, Llama-2-7B)
in ≤ 10 s of wall time on one core. Baseline on the same machine: the same simulator with decode spans turned
off (one event per engine step, the way step-level simulators such as Vidur advance), so the ratio is what the
closed-form spans buy. Each case runs in this process, one core, records kept in memory or written to disk.

The simulator is compiled with mypyc when installed (``setup.py``); the engine-only cases are also run from its
sources (``KVCAP_PURE=1``, a subprocess) as the named baseline of that build.

The whole command as a user runs it (issue 14) — simulate, write the run directory, analyse, print — is measured
too: ``kvcap sim`` in a subprocess (wall seconds and peak RSS of the child), with and without ``--no-itl``.

    .venv/bin/python benchmarks/sim_speed.py [--requests 100000]
    .venv/bin/python benchmarks/sim_speed.py --cli-only --cli-sizes 10000,100000
    KVCAP_PURE=1 .venv/bin/python benchmarks/sim_speed.py   # everything from the sources
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kvcap.sim  # noqa: E402
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
        cm = dataclasses.replace(cm, max_span=1)
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


def engine_rows(requests: int) -> list[dict[str, Any]]:
    """The engine-only cases the goals name: control c=48 (≥ 10,000× real time), treatment c=96 (≥ 3,000×)."""
    return [case("control c=48, engine only", {}, 48, requests),
            case("treatment (remote) c=96, engine only", {"serving.kv_offload": "remote"}, 96, requests)]


PROBE = """
import os, resource, sys, time
import kvcap.sim.run as run
from kvcap.cli import main
inner = run.build_summary
def probe(*a, **k):
    print(f"probe {time.monotonic():.4f} {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}", file=sys.stderr)
    if os.environ.get("SIM_SPEED_STOP_AT_SUMMARY"):
        os._exit(0)
    return inner(*a, **k)
run.build_summary = probe
sys.exit(main(sys.argv[1:]))
"""
"""``kvcap sim`` with one probe: the time and peak RSS when the summary starts, i.e. the simulator's part (simulate
and write the run directory) apart from the analysis."""


def timed_analyze(out: Path) -> tuple[float, float, bytes]:
    """``kvcap analyze OUT --json`` in a fresh process: wall s, peak RSS MiB (its own, from wait4), its output."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvcap", "analyze", str(out), "--json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    text = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"kvcap analyze {out} failed ({status})")
    return time.monotonic() - t0, usage.ru_maxrss / 1024, text


def analyze_both_ways(out: Path) -> dict[str, Any]:
    """``kvcap analyze`` on the run as written (its column copies read), then with the copies moved away (the JSONL
    parsed, and the copies written again as ``analyze`` does for a run that lacks them): both timings, and whether
    the two summaries are the same. The run's own copies are put back afterwards."""
    fast_s, fast_mb, fast = timed_analyze(out)
    moved = [p for p in out.iterdir() if p.name.endswith((".columns", ".columns.json"))]
    for p in moved:
        p.rename(p.with_name(p.name + ".off"))
    try:
        slow_s, slow_mb, slow = timed_analyze(out)
    finally:
        for p in moved:
            p.with_name(p.name + ".off").replace(p)
    return {"analyze_s": fast_s, "analyze_mb": fast_mb, "analyze_jsonl_s": slow_s, "analyze_jsonl_mb": slow_mb,
            "analyze_same": fast == slow, "copies": len(moved)}


def cli_case(requests: int, itl: bool, concurrency: int = 32, remote: bool = True,
             stop_at_summary: bool = False, analyze: bool = False) -> dict[str, Any]:
    """``kvcap sim`` end to end in a fresh process: its wall time, peak RSS (the child's own, from wait4), the same
    two at the moment the summary starts (the simulator's part), and run-directory size per file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-c", PROBE, "sim", str(ROOT / "scenarios" / "seed-reference.yaml"),
               "--concurrency", str(concurrency), "--requests", str(requests), "--warmup", "0s", "--repeats", "1",
               "--quiet", "--out", str(out)]
        if remote:
            cmd[5:5] = ["--set", "serving.kv_offload=remote"]
        if not itl:
            cmd.append("--no-itl")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=os.environ | {"PYTHONPATH": str(ROOT)}
                                | ({"SIM_SPEED_STOP_AT_SUMMARY": "1"} if stop_at_summary else {}))
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        if status != 0:
            raise SystemExit(f"kvcap sim failed ({status}): {' '.join(cmd)}\n{err}")
        probe = next(line.split() for line in err.splitlines() if line.startswith("probe "))
        sizes = {f.name: f.stat().st_size / 1e6 for f in out.iterdir()}
        levels = [json.loads(line) for line in (out / "levels.jsonl").read_text().splitlines()]
        analysed = analyze_both_ways(out) if analyze and not stop_at_summary else {}
    engine = sum(lv["sim"]["wall_s"] for lv in levels)
    simulated = sum(lv["sim"]["simulated_s"] for lv in levels)
    return {"case": f"CLI c={concurrency}{' remote' if remote else ''}{'' if itl else ' --no-itl'}",
            "requests": requests, "wall_s": wall, "engine_s": engine, "rss_mb": usage.ru_maxrss / 1024,
            "to_summary_s": float(probe[1]) - t0, "rss_to_summary_mb": int(probe[2]) / 1024,
            "req_mb": sizes.get("requests.jsonl", 0.0), "tel_mb": sizes.get("telemetry.jsonl", 0.0),
            "realtime": simulated / wall, **analysed}


def cli_table(sizes: list[int], itl_cases: tuple[bool, ...] = (True, False), stop_at_summary: bool = False,
              concurrencies: tuple[int, ...] = (32,), analyze: bool = False) -> None:
    rows = [cli_case(n, itl, concurrency=c, stop_at_summary=stop_at_summary, analyze=analyze)
            for n in sizes for c in concurrencies for itl in itl_cases]
    print(f"{'case':36} {'requests':>9} {'wall s':>7} {'engine s':>8} {'to sum s':>8} {'rest s':>7} "
          f"{'MiB@sum':>8} {'peak MiB':>9} {'req MB':>7} {'tel MB':>7} {'× real':>7}")
    for r in rows:
        print(f"{r['case']:36} {r['requests']:>9,} {r['wall_s']:>7.2f} {r['engine_s']:>8.2f} "
              f"{r['to_summary_s']:>8.2f} {r['wall_s'] - r['to_summary_s']:>7.2f} {r['rss_to_summary_mb']:>8.0f} "
              f"{r['rss_mb']:>9.0f} {r['req_mb']:>7.1f} {r['tel_mb']:>7.1f} {r['realtime']:>7,.0f}")
    print("to sum s / MiB@sum: from the start to the summary (process start, simulate, write the run directory) and\n"
          "the peak RSS by then; rest s: the analysis (build_summary) and printing.")
    print("goal (issue 14): 100,000 requests, ITLs kept, c=32 remote: ≤ 10 s wall, ≤ 500 MB peak RSS; c=96 ≤ 15 s\n")
    if analyze:
        print(f"{'kvcap analyze on that run':36} {'requests':>9} {'copies s':>9} {'MiB':>6} {'JSONL s':>8} {'MiB':>6} "
              f"{'same':>5}")
        for r in rows:
            if "analyze_s" in r:
                print(f"{r['case']:36} {r['requests']:>9,} {r['analyze_s']:>9.2f} {r['analyze_mb']:>6.0f} "
                      f"{r['analyze_jsonl_s']:>8.2f} {r['analyze_jsonl_mb']:>6.0f} {r['analyze_same']!s:>5}")
        print("copies: sim's binary column copies read; JSONL: the copies moved away, requests.jsonl and\n"
              "telemetry.jsonl parsed (and the copies written again, as analyze does where they are missing). "
              "goal (issue 14): 1,000,000 records analysed in ≤ 5 s, ≤ 1.5 GB\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--baseline-requests", type=int, default=10_000,
                    help="requests for the per-step baseline (it is slow; rates are per request)")
    ap.add_argument("--cli-sizes", default="10000,100000",
                    help="request counts for the whole-command runs (comma-separated; empty: skip them)")
    ap.add_argument("--cli-only", action="store_true", help="only the whole-command runs")
    ap.add_argument("--cli-itl", choices=("both", "kept", "no-itl"), default="both",
                    help="whole-command runs with ITLs kept, with --no-itl, or both (default)")
    ap.add_argument("--cli-stop-at-summary", action="store_true",
                    help="end each whole-command run where the summary starts (the simulator's part only)")
    ap.add_argument("--cli-concurrency", default="32", help="users of the whole-command runs (comma-separated; "
                    "96 is the treatment's parking case)")
    ap.add_argument("--cli-analyze", action="store_true",
                    help="after each whole-command run, time `kvcap analyze` on it with and without its column copies")
    ap.add_argument("--engine-json", action="store_true", help=argparse.SUPPRESS)  # the baseline's subprocess
    a = ap.parse_args()
    if a.engine_json:
        print(json.dumps(engine_rows(a.requests)))
        return
    sizes = [int(x) for x in a.cli_sizes.split(",") if x.strip()]
    if sizes:
        cli_table(sizes, {"both": (True, False), "kept": (True,), "no-itl": (False,)}[a.cli_itl],
                  a.cli_stop_at_summary, tuple(int(c) for c in a.cli_concurrency.split(",")), a.cli_analyze)
    if a.cli_only:
        return
    build = "compiled" if kvcap.sim.NATIVE else "sources"
    engine = engine_rows(a.requests)
    for r in engine:
        r["case"] += f" ({build})"
    sources: list[dict[str, Any]] = []
    if kvcap.sim.NATIVE:  # the same cases from the sources, in a fresh process (the build is chosen at import)
        proc = subprocess.run([sys.executable, __file__, "--engine-json", "--requests", str(a.requests)],
                              capture_output=True, text=True, check=True, env=os.environ | {"KVCAP_PURE": "1"})
        sources = json.loads(proc.stdout)
        for r in sources:
            r["case"] += " (sources)"
    rows = [
        *engine, *sources,
        case("control c=48, records + ITLs to disk", {}, 48, a.requests, to_disk=True),
        case("baseline: one event per step, c=48", {}, 48, a.baseline_requests, per_step=True),
    ]
    print(f"{'case':50} {'requests':>9} {'wall s':>7} {'req/s':>9} {'× real time':>12} {'events':>9} {'MB':>6}")
    for r in rows:
        print(f"{r['case']:50} {r['requests']:>9,} {r['wall_s']:>7.2f} {r['req_per_s']:>9,.0f} {r['realtime']:>12,.0f} "
              f"{r['events']:>9,} {r['mb_written']:>6.0f}")
    if sources:
        print("\ncompiled vs sources (KVCAP_PURE=1): " + ", ".join(
            f"{c['case'].split(',')[0]} {c['req_per_s'] / p['req_per_s']:.2f}×" for c, p in zip(engine, sources)))
    base = rows[-1]["req_per_s"]
    print(f"\nspans vs one event per step: {rows[0]['req_per_s'] / base:.1f}× the simulated requests per second")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    goal = rows[0]["wall_s"] * 100_000 / max(rows[0]["requests"], 1)
    print(f"100,000 requests (control, engine only): {goal:.1f} s wall (goal ≤ 10 s)")


if __name__ == "__main__":
    main()
