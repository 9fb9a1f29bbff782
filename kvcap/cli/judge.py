"""`kvcap analyze` and `kvcap compare`: judge a recorded run, or two, by the article's method.

analyze re-reads one run directory (bench or sim) and rewrites its summary; compare refuses two runs whose fixed
variables differ (exit 3) and otherwise gives the A/B verdict.
"""

from __future__ import annotations

import argparse

from kvcap.cli import common
from kvcap.errors import RefusedComparison

ANALYZE_EXAMPLES = """
examples:
  kvcap analyze runs/control
  kvcap analyze runs/control --slo ttft_p95=500ms,tpot_p95=80ms --json
"""

COMPARE_EXAMPLES = """
examples:
  kvcap compare runs/control runs/treatment --slo ttft_p95=500ms,tpot_p95=80ms
  kvcap compare runs/vram-only runs/offload --allow-diff serving.kv_offload --json
"""

KEPT_SUMMARY_KEYS = ("client", "interrupted", "stopped", "failed", "telemetry_samples", "sim", "prometheus")
"""What only the recording command knew: analyze carries these over from the run's old summary."""


def register(sub: common.Subparsers) -> None:
    _add_analyze(sub)
    _add_compare(sub)


def _add_analyze(sub: common.Subparsers) -> None:
    p = sub.add_parser("analyze", help="per-level statistics, the three conditions and capacities of a run directory",
                       description=common.doc("""
                           Reads a run directory (from bench or sim), judges every level by the article's three
                           conditions — throughput still grows, p95/p99 within the SLO, no sustained queueing,
                           timeouts or preemptions — and writes DIR/summary.json with the effective, resident
                           and stress-limit capacities.
                       """), epilog=ANALYZE_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("dir", metavar="DIR", help="run directory")
    common.add_slo_flag(p, help="override the run's SLO, e.g. ttft_p95=500ms,tpot_p95=80ms")
    common.add_json_flag(p, help="print summary.json")
    p.set_defaults(func=cmd_analyze)


def cmd_analyze(a: argparse.Namespace) -> int:
    from kvcap.analysis.summary import build_summary
    from kvcap.report.console import render_levels
    from kvcap.rundir import SUMMARY, RunDir, write_json_atomic

    run = RunDir(a.dir)
    recorded = run.summary
    # the column copies written where missing or stale (a run of an older version, copies deleted): the next
    # analyze, report or compare of a big run skips the JSON parse
    summary = build_summary(run, slo=common.optional_slo(a.slo), write_copies=True)
    if recorded is not None:
        for key in KEPT_SUMMARY_KEYS:
            if key in recorded.model_fields_set:
                setattr(summary, key, getattr(recorded, key))
    common.carry_outcome(summary, run)  # a killed run (no old summary): its level lines say how it ended
    fresh = summary.warnings  # the run's own (e.g. Ray clock offsets) stay beside the recomputed
    summary.warnings = [*fresh, *(w for w in (recorded.warnings if recorded is not None else []) if w not in fresh)]
    write_json_atomic(run.dir / SUMMARY, summary.to_json())
    if a.json:
        common.print_json(summary.to_json())
    else:
        render_levels(summary, title=f"kvcap analyze {a.dir}")
    common.print_notes("analyze", summary)
    return 0


def _add_compare(sub: common.Subparsers) -> None:
    p = sub.add_parser("compare", help="A/B verdict: performance scaling, capacity only, no gain or regression",
                       description=common.doc("""
                           Checks that the two runs are of the same caliber (every fixed variable equal but the
                           one under test; exit 3 listing the differences otherwise), then compares resident and
                           effective capacity and goodput, with bootstrap confidence, and gives the verdict.
                       """), epilog=COMPARE_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("control", metavar="CONTROL_DIR")
    p.add_argument("treatment", metavar="TREATMENT_DIR")
    common.add_slo_flag(p, help="SLO (default: the control run's)")
    p.add_argument("--allow-diff", metavar="KEY,...", help="fixed variables allowed to differ")
    common.add_json_flag(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(a: argparse.Namespace) -> int:
    from kvcap.analysis.verdict import compare
    from kvcap.report.console import render_compare

    result = compare(a.control, a.treatment, slo=common.optional_slo(a.slo),
                     allow=common.allowed_differences(a.allow_diff))
    if not result.fixed_variables.equal:
        diffs = "; ".join(f"{d.key}: {d.control!r} vs {d.treatment!r}" for d in result.fixed_variables.differences)
        raise RefusedComparison(f"fixed variables differ — {diffs} (pass --allow-diff KEY to accept)")
    if a.json:
        common.print_json(common.comparison_json(result))
    else:
        render_compare(result)
    return 0
