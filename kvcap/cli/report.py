"""`kvcap report`: the self-contained HTML report (and its Markdown summary) of one run or an A/B pair.

One directory gets the single-run report from a fresh summary; two get the comparison report. Unlike compare,
report does not refuse runs whose fixed variables differ: the report shows the differences.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvcap.cli import common
from kvcap.errors import InputError

REPORT_EXAMPLES = """
examples:
  kvcap report runs/control --out control.html
  kvcap report runs/control runs/treatment --slo ttft_p95=500ms,tpot_p95=80ms --out ab.html
"""


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser("report", help="self-contained HTML report (and Markdown) for one run or an A/B pair",
                       description=common.doc("""
                           One run: per-level plots and server time series. Two runs (control, treatment): the
                           verdict box first, then the plots with SLO lines and capacity markers, the fixed
                           variables, the diagnosis and the raw tables. Works offline; a .md summary is written
                           beside it.
                       """), epilog=REPORT_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("dirs", nargs="+", metavar="DIR",
                   help="one run directory, or CONTROL TREATMENT, or a `kvcap search` directory")
    common.add_slo_flag(p)
    p.add_argument("--allow-diff", metavar="KEY,...", help="as for compare")
    p.add_argument("--out", default="report.html", metavar="FILE")
    p.set_defaults(func=cmd_report)


def cmd_report(a: argparse.Namespace) -> int:
    slo = common.optional_slo(a.slo)
    out = Path(a.out)
    if len(a.dirs) == 1 and _is_search(a.dirs[0]):
        _report_search(a.dirs[0], out)
        print(f"wrote {out}")
        return 0
    if len(a.dirs) == 1:
        _report_one(a.dirs[0], slo, out)
    elif len(a.dirs) == 2:
        _report_pair(a.dirs[0], a.dirs[1], slo, common.allowed_differences(a.allow_diff), out)
    else:
        raise InputError("report takes one run directory or two (control, treatment)")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def _is_search(path: str) -> bool:
    from kvcap.search.run import is_search_dir

    return is_search_dir(path)


def _report_search(search_dir: str, out: Path) -> None:
    """A `kvcap search` directory: its search page (the one the search wrote, rebuilt from search.json)."""
    from kvcap.report.search import write_search_html
    from kvcap.search.run import load_search

    write_search_html(out, *load_search(search_dir))


def _report_one(run_dir: str, slo: Any, out: Path) -> None:
    from kvcap.analysis.summary import build_summary
    from kvcap.report.html import write_html_single
    from kvcap.report.markdown import render_markdown_single
    from kvcap.rundir import RunDir

    run = RunDir(run_dir)
    summary = build_summary(run, slo)
    common.carry_outcome(summary, run)
    common.print_notes("report", summary, interrupted=True)
    write_html_single(out, summary, run, title=f"kvcap report: {run_dir}")
    out.with_suffix(".md").write_text(render_markdown_single(summary))


def _report_pair(control: str, treatment: str, slo: Any, allow: set[str], out: Path) -> None:
    from kvcap.analysis.verdict import compare
    from kvcap.report.html import write_html
    from kvcap.report.markdown import render_markdown
    from kvcap.rundir import RunDir

    result = compare(control, treatment, slo=slo, allow=allow)
    for warning in result.warnings:
        print(f"kvcap report: warning: {warning}", file=sys.stderr)
    assert result.summaries is not None  # compare keeps the summaries it built
    for arm, run_dir in (("control", control), ("treatment", treatment)):
        summary = getattr(result.summaries, arm)
        common.carry_outcome(summary, RunDir(run_dir))
        common.print_notes("report", summary, arm=arm, interrupted=True)
    write_html(out, result, {"control": RunDir(control), "treatment": RunDir(treatment)},
               title=f"kvcap: {control} vs {treatment}")
    out.with_suffix(".md").write_text(render_markdown(result))
