"""`kvcap demo`: the source article's reference A/B, simulated — the first thing a new user runs.

It is `kvcap ab` on the packaged scenario experiment seed-reference-ab.yaml, with a default output folder.
"""

from __future__ import annotations

import argparse

from kvcap.cli import common
from kvcap.cli.ab import run_sim_ab

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
            Simulates the article's reference cluster (4 nodes x one 24 GB GPU, 100 Gbps, a 7B model, ~1024 in /
            256 out) twice — KV in VRAM only, and KV allowed to spill to a distributed memory pool — at every
            level with repeats, then prints the side-by-side table and the verdict and writes DIR/control/,
            DIR/treatment/, DIR/compare.json and DIR/report.html. The scenario is seed-reference-ab.yaml.
        """), epilog=DEMO_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("--out", default="kvcap-demo", metavar="DIR", help="where to write (kvcap-demo; replaced)")
    common.add_set_flag(p, help="override a scenario key for both arms")
    common.add_json_flag(p, help="print compare.json")
    common.add_quiet_flag(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(a: argparse.Namespace) -> int:
    from kvcap.ab.experiment import load_any_experiment, packaged_scenario

    exp = load_any_experiment(str(packaged_scenario("seed-reference-ab.yaml")))
    return run_sim_ab(exp, a.out, a.set, a.json, a.quiet, prog="demo")
