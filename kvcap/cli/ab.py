"""`kvcap ab`: run both arms of an experiment file, compare them and write the report.

An experiment is either real (two servers, interleaved repeats) or simulated (two arms of one scenario); both
end the same way: DIR/<arm>/ run directories, DIR/compare.json, DIR/report.html and DIR/report.md. `run_sim_ab`
is also what `kvcap demo` runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcap.cli import common
from kvcap.cli.sim import level_line
from kvcap.errors import InputError

if TYPE_CHECKING:
    from kvcap.rundir.compare import Comparison

AB_EXAMPLES = """
examples:
  kvcap ab experiments/offload.yaml --out runs/offload-ab
  kvcap ab scenarios/seed-reference.yaml --treatment serving.kv_offload=remote --out runs/what-if

experiment file:
  name: kv-offload
  fixed: {model.name: llama-3.1-8b, cluster.gpus: 4}
  arms:
    - {name: control, url: "http://127.0.0.1:8000", command: "vllm serve … --port 8000",
       vary: {serving.kv_offload: none}}
    - {name: treatment, url: "http://127.0.0.1:8000", command: "vllm serve … --kv-offloading-size 64",
       vary: {serving.kv_offload: host}}
  load: {concurrency: [8, 16, 24], warmup: 10s, duration: 60s, repeats: 3}
  workload: {input_tokens: 1024, output_tokens: 256}
  slo: {ttft_p95: 500ms, tpot_p95: 80ms}
"""


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser("ab", help="run a same-caliber A/B (interleaved repeats), compare and report",
                       description=common.doc("""
                           Runs both arms of an experiment with interleaved repeats (A B A B …) so drift on the
                           machine cancels, starting and stopping each arm's server command if it has one, then
                           writes DIR/<arm>/ run directories, DIR/compare.json and DIR/report.html.
                       """), epilog=AB_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("experiment", metavar="EXPERIMENT.yaml",
                   help="an experiment file; or, with --treatment, a scenario file (e.g. one `kvcap calibrate` wrote)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--treatment", action="append", metavar="KEY=VALUE",
                   help="what-if on a scenario: the control is the scenario as it is, the treatment the scenario "
                        "with these keys set (repeatable), e.g. --treatment serving.kv_tokens=16384")
    common.add_set_flag(p, help="override an experiment field (repeatable)")
    common.add_quiet_flag(p)
    common.add_json_flag(p, help="print compare.json")
    p.set_defaults(func=cmd_ab)


def cmd_ab(a: argparse.Namespace) -> int:
    import asyncio

    from kvcap.ab.experiment import SimExperiment, load_any_experiment

    exp = what_if(a.experiment, a.treatment) if a.treatment else load_any_experiment(a.experiment)
    if isinstance(exp, SimExperiment):
        return run_sim_ab(exp, a.out, a.set, a.json, a.quiet)
    exp = _real_experiment(a.experiment, a.set)
    out = Path(a.out)
    result = asyncio.run(_run_real_ab(exp, out, quiet=a.quiet or a.json))
    _write_and_show(result, out, a.json, footer=lambda: f"report: {out / 'report.html'}")
    return 0


def what_if(scenario: str, treatment: list[str]) -> Any:
    """One scenario as two simulated arms: ``control`` as written, ``treatment`` with the given keys set."""
    from kvcap.ab.experiment import SimArm, SimExperiment
    from kvcap.specs.scenario import load_scenario, parse_set

    sets = parse_set(treatment)
    load_scenario(scenario, sets)  # a bad key or value fails here, naming it, before anything runs
    return SimExperiment(name=f"what-if {Path(scenario).stem}", scenario=str(Path(scenario).resolve()),
                         arms=[SimArm(name="control"), SimArm(name="treatment", set=sets)])


def _real_experiment(path: str, sets: list[str] | None) -> Any:
    """The experiment file of two real arms, with --set applied and validated again."""
    from kvcap.ab.experiment import Experiment, load_experiment
    from kvcap.specs.scenario import apply_overrides, parse_set, with_displaced

    exp = load_experiment(path)
    if sets:
        from pydantic import ValidationError

        from kvcap.specs.fields import validation_message

        data = exp.model_dump()
        overrides, notes = with_displaced(data, parse_set(sets))
        for note in notes:
            print(f"kvcap ab: note: {note}", file=sys.stderr)
        try:
            exp = Experiment.model_validate(apply_overrides(data, overrides))
        except ValidationError as exc:
            raise InputError(validation_message(exc, "--set")) from None
    return exp


async def _run_real_ab(exp: Any, out: Path, quiet: bool) -> Comparison:
    import asyncio

    from kvcap.ab.real import run_experiment

    stop = asyncio.Event()
    common.on_stop_signals(stop.set)
    return await common.with_live_progress(quiet, lambda progress: run_experiment(exp, out, progress, stop))


def run_sim_ab(exp: Any, out_dir: str, sets: list[str] | None, as_json: bool, quiet: bool, prog: str | None = "ab",
               show: bool = True) -> int:
    """Simulates both arms of a scenario experiment (`--set` applies to both), compares, reports and prints
    (``show`` False: writes only; ``prog`` None: the caller says whether the compiled simulator ran)."""
    from kvcap.ab.simulated import run_sim_experiment
    from kvcap.specs.scenario import parse_set

    out = Path(out_dir)
    t0 = time.perf_counter()
    progress = None if (quiet or as_json or not show) else (lambda arm, info: level_line(f"{arm}: ")(info))
    result = run_sim_experiment(exp, out, parse_set(sets), progress=progress)
    if not show:
        _write_report(result, out)
        return 0
    _write_and_show(result, out, as_json, footer=lambda: f"simulated both arms in {time.perf_counter() - t0:.1f} s; "
                                                         f"report: {out / 'report.html'}")
    if prog is not None:
        common.print_build_note(prog)
    return 0


def _write_and_show(result: Comparison, out: Path, as_json: bool, footer: Callable[[], str]) -> None:
    """Writes the report, then prints compare.json, or the side-by-side table and `footer()` under it."""
    from kvcap.report.console import render_compare

    _write_report(result, out)
    if as_json:
        common.print_json(common.comparison_json(result))
    else:
        render_compare(result)
        print(footer())


def _write_report(result: Comparison, out: Path) -> None:
    from kvcap.report.html import write_html
    from kvcap.report.markdown import render_markdown
    from kvcap.rundir import RunDir

    arms = [result.control.arm, result.treatment.arm]
    runs = {"control": RunDir(out / arms[0]), "treatment": RunDir(out / arms[1])}
    write_html(out / "report.html", result, runs)
    (out / "report.md").write_text(render_markdown(result))
