"""`kvcap demo`: the source article's two answers, simulated — the first thing a new user runs.

It is `kvcap ab` on two packaged experiments of one cluster: seed-reference-ab.yaml (the article's reference
workload, where decode KV must live in HBM: a memory tier only parks requests) written to DIR, then
seed-reference-prefix-ab.yaml (prompts sharing system prompts: the same tier saves prefill) written to
DIR/prefix-reuse; then both verdicts side by side.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvcap.cli import common
from kvcap.cli.ab import run_sim_ab

PREFIX_DIR = "prefix-reuse"
"""Where, inside the demo's folder, the prefix-reuse A/B is written."""

DEMO_EXAMPLES = """
examples:
  kvcap demo
  kvcap demo --out runs/demo --set cluster.interconnect.bandwidth=400Gbps
  kvcap demo --set load.repeats=1 --set load.duration=30s
"""


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser(
        "demo", help="the article's reference A/B, simulated (no GPU): verdict, table and report.html",
        description=common.doc("""
            Simulates the article's reference cluster (4 nodes x one 24 GB GPU, 100 Gbps, a 7B model) twice — KV in
            VRAM only, and KV allowed to spill to a distributed memory pool — at every level with repeats, on two
            workloads: the article's (~1024 in / 256 out, seed-reference-ab.yaml: DIR/control/, DIR/treatment/,
            DIR/compare.json, DIR/report.html) and one whose prompts share system prompts
            (seed-reference-prefix-ab.yaml: the same under DIR/prefix-reuse/). Prints each side-by-side table and
            verdict, then both verdicts together: where the tier only parks requests and where it saves work.
        """), epilog=DEMO_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("--out", default="kvcap-demo", metavar="DIR", help="where to write (kvcap-demo; replaced)")
    common.add_set_flag(p, help="override a scenario key for both arms")
    common.add_json_flag(p, help='print {"reference": compare.json, "prefix_reuse": compare.json}')
    common.add_quiet_flag(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(a: argparse.Namespace) -> int:
    from kvcap.ab.experiment import load_any_experiment, packaged_scenario
    from kvcap.rundir import read_comparison

    prefix_out = Path(a.out) / PREFIX_DIR
    for name, out in (("seed-reference-ab.yaml", Path(a.out)), ("seed-reference-prefix-ab.yaml", prefix_out)):
        exp = load_any_experiment(str(packaged_scenario(name)))
        run_sim_ab(exp, str(out), a.set, False, a.quiet, prog=None, show=not a.json)
    common.print_build_note("demo")
    reference, prefix = read_comparison(Path(a.out) / "compare.json"), read_comparison(prefix_out / "compare.json")
    if a.json:
        common.print_json({"reference": common.comparison_json(reference),
                           "prefix_reuse": common.comparison_json(prefix)})
        return 0
    print()
    print("The article's two answers, on one cluster and one memory pool:")
    for label, result in (("decode-bound requests (the article's workload)", reference),
                          ("prompts sharing system prompts (prefix reuse)", prefix)):
        c, t = result.control, result.treatment
        print(f"  {label}: {result.verdict} — effective {_level(c.effective)} → {_level(t.effective)}, "
              f"resident {_level(c.resident)} → {_level(t.resident)}")
    return 0


def _level(value: object) -> str:
    """A capacity figure, or 'none' where no level passed."""
    return "none" if value is None else f"{value}"
