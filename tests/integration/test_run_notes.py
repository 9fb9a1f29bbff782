"""`kvcap analyze` and `kvcap report` say a run's warnings and why it stopped — on stderr, in the Markdown and in the
HTML report — read from its summary.json, or from its level lines when a killed run left none. Real bench runs over
loopback against the project's test server: one that counts prompts its own way (the input-length warning), one
that fails every request (stopped by the error rule)."""

from __future__ import annotations

import html
import json

from tests.conftest import run_cli
from tests.servers import start_fake_server

SMALL = ("--output-tokens", "3", "--warmup", "0s", "--quiet", "--json", "--concurrency", "2")


def bench(url: str, out, *args: str) -> tuple[int, dict]:
    p = run_cli("bench", "--url", url, "--out", str(out), *SMALL, *args, timeout=120)
    return p.returncode, json.loads(p.stdout)


def report(run, tmp_path, name: str) -> tuple[str, str, str]:
    """(stderr, Markdown, HTML) of ``kvcap report RUN``."""
    out = tmp_path / f"{name}.html"
    p = run_cli("report", str(run), "--out", str(out), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stderr, out.with_suffix(".md").read_text(), html.unescape(out.read_text())


def test_a_warning_is_printed_by_analyze_and_report(tmp_path):
    # the server counts a word of n characters as ceil(n/4) tokens plus 3: kvcap's word-sized prompts are off
    with start_fake_server(ttft="1ms", itl="1ms", tokenizer="chars4", prompt_overhead=3) as srv:
        rc, summary = bench(srv.url, tmp_path / "run", "--input-tokens", "40", "--requests", "6",
                            "--input-lengths", "local")
    assert rc == 0
    (warning,) = summary["warnings"]
    assert warning.startswith("input length: the server counted")
    analyzed = run_cli("analyze", str(tmp_path / "run"))
    assert analyzed.returncode == 0 and f"kvcap analyze: warning: {warning}" in analyzed.stderr.splitlines()
    err, md, page = report(tmp_path / "run", tmp_path, "warned")
    assert f"kvcap report: warning: {warning}" in err.splitlines()
    assert f"- {warning}" in md.splitlines()
    assert warning in page


def test_a_stopped_run_says_why_in_analyze_and_report_even_without_its_summary(tmp_path):
    with start_fake_server(ttft="1ms", itl="1ms", fault=["http_500:every=1"]) as srv:
        rc, summary = bench(srv.url, tmp_path / "run", "--duration", "30s", "--error-window", "10")
    assert rc == 1 and summary["stopped"]["level"] == 2
    failed = summary["failed"]
    assert failed.startswith("stopped at concurrency 2 (repeat 0): ") and "http_5xx" in failed
    for without_summary in (False, True):
        if without_summary:  # as a killed bench leaves it: the level lines still say it stopped
            (tmp_path / "run" / "summary.json").unlink()
        err, md, page = report(tmp_path / "run", tmp_path, f"stopped-{without_summary}")
        assert f"kvcap report: {failed}" in err.splitlines(), err
        assert f"- run failed: {failed}" in md.splitlines(), md
        assert f"run failed: {failed}" in page
    analyzed = run_cli("analyze", str(tmp_path / "run"))  # no summary.json left: from the level lines
    assert analyzed.returncode == 0 and f"kvcap analyze: {failed}" in analyzed.stderr.splitlines()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["failed"] == failed


def test_a_run_that_ended_well_has_no_notes(tmp_path):
    with start_fake_server(ttft="1ms", itl="1ms") as srv:
        rc, summary = bench(srv.url, tmp_path / "run", "--requests", "4", "--input-tokens", "8")
    assert rc == 0 and summary["warnings"] == [] and summary["failed"] is None
    err, md, _ = report(tmp_path / "run", tmp_path, "fine")
    assert err == "" and "**Warnings**" not in md
