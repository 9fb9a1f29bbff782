"""`kvcap search`: what-if sweeps — one `kvcap sim` per grid point, the cheapest point meeting a target, the
Pareto front of effective capacity vs cost. Local processes by default, Ray tasks with --ray."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from kvcap.cli import common
from kvcap.cli.sim import add_load_overrides, sim_overrides

SEARCH_EXAMPLES = """
examples:
  kvcap search scenarios/seed-reference.yaml --grid model.kv_dtype=fp16,fp8 --grid serving.kv_offload=none,remote \\
               --grid cluster.gpu.memory=24GiB,48GiB --concurrency 16,32,48,64,96,128,192 --duration 30s \\
               --repeats 1 --target effective>=96 --summary-only --out runs/search
  kvcap search scenarios/seed-reference.yaml --grid cluster.nodes=4,8 --grid cluster.gpu.preset=rtx4090,l40s \\
               --price gpu=1 --price cluster.gpu.preset=l40s=3 --target goodput>=2000 --out runs/search-gpus
  kvcap search scenarios/seed-reference.yaml --grid model.kv_dtype=fp16,fp8 --ray 10.0.0.1:6379 --out runs/s
"""


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser(
        "search", help="what-if sweep: one simulation per grid point, the cheapest point meeting a target",
        description=common.doc("""
            Every combination of the --grid values is one `kvcap sim` of the scenario with those keys set (plus
            --set and the load flags). Writes DIR/points.jsonl (one row per point: effective, resident, stress
            limit, best goodput, cost, meets_target), DIR/search.json (recommended, pareto, per-knob effects),
            DIR/search.html and each point's run directory under DIR/points/. Cost = GPU count × the GPU price
            (--price gpu=COST, default 1) + every --price KEY=VALUE=COST the point matches. Recommended: the
            points meeting --target (all of them; default: the best effective capacity found) at the lowest
            cost, fewest changes from the baseline (each key's first value) among equal costs. Ctrl-C keeps the
            points that finished; --resume (the same command) runs only the others.
        """), epilog=SEARCH_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("scenario", metavar="SCENARIO.yaml")
    p.add_argument("--grid", action="append", metavar="KEY=V1,V2", help="a scenario key and its values (repeatable)")
    p.add_argument("--target", action="append", metavar="effective>=N|goodput>=X",
                   help="what a point must reach (repeatable: all must hold); goodput in tok/s")
    p.add_argument("--price", action="append", metavar="KEY=VALUE=COST",
                   help="cost added when KEY takes VALUE; gpu=COST sets the per-GPU cost (repeatable)")
    p.add_argument("--jobs", type=common.positive_int, default=os.cpu_count() or 1,
                   help="local worker processes (default: the CPU count)")
    p.add_argument("--ray", metavar="ADDRESS", help="run the points as tasks on this Ray cluster (ray.init address)")
    p.add_argument("--summary-only", action="store_true", help="keep only each point's summary.json")
    p.add_argument("--no-itl", action="store_true", help="do not store per-token gaps (smaller run directories)")
    p.add_argument("--out", required=True, metavar="DIR", help="search directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace a search already in --out")
    p.add_argument("--resume", action="store_true",
                   help="run only the points the same search in --out has not finished (after Ctrl-C or a crash)")
    common.add_json_flag(p, help="print search.json at the end")
    common.add_quiet_flag(p, help="no progress")
    add_load_overrides(p)
    p.set_defaults(func=cmd_search)


def _spec(a: argparse.Namespace) -> Any:
    from pathlib import Path

    from kvcap.search.grid import parse_grid, parse_prices, parse_targets
    from kvcap.search.run import SearchSpec
    from kvcap.specs.scenario import read_yaml
    from kvcap.workload.trace import read_trace

    grid = parse_grid(a.grid)
    return SearchSpec(scenario=a.scenario, data=read_yaml(a.scenario), grid=grid, out=Path(a.out),
                      overrides=sim_overrides(a), targets=parse_targets(a.target), prices=parse_prices(a.price, grid),
                      jobs=a.jobs, ray=a.ray, summary_only=a.summary_only, overwrite=a.overwrite, resume=a.resume,
                      trace=tuple(read_trace(a.trace)) if a.trace else (), trace_file=a.trace,
                      trace_speed=a.trace_speed, slo=a.slo, record_itl=not a.no_itl)


def cmd_search(a: argparse.Namespace) -> int:
    from kvcap.report.search import render_search
    from kvcap.search.run import run_search

    spec = _spec(a)
    if a.quiet or a.json:
        search = run_search(spec)
    elif sys.stderr.isatty():
        search = _with_bar(spec)
    else:
        search = run_search(spec, progress=_point_line)
    if a.json:
        common.print_json(search)
    else:
        from kvcap.rundir import read_jsonl

        render_search(search, read_jsonl(spec.out / "points.jsonl"))
        print(f"wrote {spec.out / 'points.jsonl'}, {spec.out / 'search.json'}, {spec.out / 'search.html'} "
              f"({search['points_per_min']} points/min, {search['executor']})")
    common.print_build_note("search")
    return 130 if search.get("interrupted") else 0


def _point_line(row: dict[str, Any], done: int, total: int) -> None:
    point = " ".join(f"{k}={v}" for k, v in row["point"].items())
    print(f"point {done}/{total}: {point}: effective {row['effective']}, resident {row['resident']}",
          file=sys.stderr, flush=True)


def _with_bar(spec: Any) -> dict[str, Any]:
    """A progress bar over points on the terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvcap.search.grid import expand
    from kvcap.search.run import run_search

    with Progress(TextColumn("[bold]points"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[last]}"), console=Console(stderr=True)) as bar:
        task = bar.add_task("points", total=len(expand(spec.grid)), last="")

        def show(row: dict[str, Any], done: int, total: int) -> None:
            last = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in row["point"].items())
            bar.update(task, completed=done, total=total, last=f"{last}: effective {row['effective']}")
        return run_search(spec, progress=show)
