"""HTML and Markdown reports from a compare of two small synthetic run directories.

The runs are written with ``RunWriter`` from a closed-form server model (fast and deterministic; the HTTP path
is tested in test_bench/test_compare): ``slots`` requests decode at once, the rest wait; TPOT grows a little
with the batch. Control has 4 slots, treatment 8, so the verdict is performance-scaling. Manifest values, the
arm name and a warning carry hostile strings that must come out escaped. The report is then rendered in headless
Chromium (``/usr/bin/chromium``, installed by CI): the screenshot must be produced, the DOM must hold the SVG plots
and the console must stay silent.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
from pathlib import Path

import pytest

from kvcap.analysis.summary import build_summary
from kvcap.analysis.verdict import compare
from kvcap.errors import InputError
from kvcap.report.data import level_windows, levels_from_per_level
from kvcap.report.format import esc, fmt, fmtm, level_name, pair, signed, value_text
from kvcap.report.html import render_html, render_html_single, write_html
from kvcap.report.markdown import render_markdown, render_markdown_single
from kvcap.rundir import MANIFEST, RunDir, RunWriter, read_comparison, write_json_atomic
from kvcap.rundir.compare import Comparison
from kvcap.rundir.levels import LevelRow
from kvcap.rundir.summary import Finding

CHROMIUM = os.environ.get("KVCAP_CHROMIUM", "/usr/bin/chromium")
LEVELS = (4, 8, 12)
OUTPUT_TOKENS = 20
WARMUP, DURATION = 0.5, 3.0
SLO = {"ttft_p95": 500.0, "tpot_p95": 80.0}
XSS_MODEL = "<script>alert(1)</script>"
XSS_ARM = "ctl|<svg onload=alert(2)>"
XSS_WARNING = "<img src=x onerror=alert(3)>"
PLOTS_VS_LEVEL = 6  # tok/s, goodput, TTFT p95/p99, TPOT p95/p99
PLOTS_OVER_TIME = 2  # per arm: running/waiting, KV usage


def synth_run(out: Path, slots: int, arm: str, seed: int) -> Path:
    """A closed-loop run against a model server with ``slots`` decode slots, written as kvcap writes runs."""
    rng = random.Random(seed)
    w = RunWriter(out)
    manifest = {"tool": "kvcap", "source": "bench", "arm": arm, "run_id": f"synth{seed}", "started_at": 0.0, "slo": SLO,
                "server": {"models": [XSS_MODEL], "engine": "vllm"},
                "fixed": {"target.url": f"http://127.0.0.1:{9000 + seed}/v1/completions",
                          "model.name": XSS_MODEL, "workload.prompt_set": "a|b", "workload.output_tokens": "20",
                          "load.concurrency": list(LEVELS), "serving.slots": slots},
                "under_test": ["serving.slots"]}
    write_json_atomic(out / MANIFEST, manifest)  # as JSON, so the hostile values land exactly as given
    t = 0.0
    for c in LEVELS:
        running, waiting = min(c, slots), max(c - slots, 0)
        tpot = 20.0 + 1.5 * running
        service = 30.0 + (OUTPUT_TOKENS - 1) * tpot
        queue = waiting / running * service
        t0, m0 = t, t + WARMUP
        m1 = m0 + DURATION
        end = m1
        for worker in range(c):
            s, i = t0 + 1e-4 * worker, 0
            while s < m1:
                itl = [round(tpot * rng.uniform(0.97, 1.03), 3) for _ in range(OUTPUT_TOKENS - 1)]
                ttft = round((30.0 + queue) * rng.uniform(0.95, 1.05), 3)
                e2e = round(ttft + sum(itl), 3)
                w.record({"mode": "concurrency", "level": c, "repeat": 0, "worker": 0,
                          "phase": "measure" if s >= m0 else "warmup", "index": i, "start_s": round(s, 6),
                          "send_delay_ms": 0.05, "ok": True, "error": None, "status": 200, "input_tokens": 16,
                          "output_tokens": OUTPUT_TOKENS, "requested_output_tokens": OUTPUT_TOKENS,
                          "tokens_source": "usage", "ttft_ms": ttft, "tpot_ms": round(sum(itl) / len(itl), 3),
                          "e2e_ms": e2e, "itl_ms": itl, "queue_ms": None, "finish_reason": "length",
                          "truncated": False, "early_stop": False, "retries": 0, "group": None})
                s += e2e / 1e3
                i += 1
            end = max(end, s)
        w.level({"target": c, "measure_start_s": m0, "measure_end_s": m1, "sent_measured": 0, "mode": "concurrency",
                 "level": c, "repeat": 0, "worker": 0, "t_start_s": t0, "t_end_s": end,
                 "client": {"warnings": []}, "interrupted": False})
        rows = []
        ts = t0
        while ts <= end:
            for name, value in (("server.requests_running", running), ("server.requests_waiting", waiting),
                                ("server.kv_usage", running / slots)):
                rows.append({"t_s": round(ts, 3), "source": "metrics:synthetic", "name": name,
                             "labels": {"model_name": XSS_MODEL}, "value": float(value)})
            ts += 0.25
        w.telemetry(rows)
        t = end + 0.2
    w.close()
    w.summary(build_summary(RunDir(out), SLO))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, RunDir]:
    base = tmp_path_factory.mktemp("report")
    return {"control": RunDir(synth_run(base / "control", 4, XSS_ARM, 1)),
            "treatment": RunDir(synth_run(base / "treatment", 8, "treatment", 2))}


@pytest.fixture(scope="module")
def result(runs) -> Comparison:
    r = compare(str(runs["control"].dir), str(runs["treatment"].dir))
    r.warnings = [*r.warnings, XSS_WARNING]
    r.diagnosis = [*r.diagnosis, Finding(arm="run", bound="compute", evidence="finding | " + XSS_WARNING,
                                         direction="scale up")]
    return r


@pytest.fixture(scope="module")
def report(result, runs, tmp_path_factory) -> Path:
    return write_html(tmp_path_factory.mktemp("html") / "report.html", result, runs, title="kvcap <b>A/B</b>")


def test_synthetic_compare_is_performance_scaling(result):
    # the fixture itself: 4 → 8 slots doubles SLO-bounded concurrency and raises goodput beyond noise
    assert result.verdict == "performance-scaling", result
    assert (result.control.effective, result.treatment.effective) == (4, 8)
    assert (result.control.resident, result.treatment.resident) == (4, 8)
    assert result.fixed_variables.equal and result.goodput_gain.beyond_noise


def test_html_content_plots_slo_lines_and_escaping(report, result):
    html = report.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    # verdict box first, with the verdict word and its meaning
    assert html.index('class="verdict v-performance-scaling"') < html.index("<svg")
    assert "verdict: performance-scaling" in html
    assert "More memory bought more SLO-bounded concurrency and more goodput, beyond the noise." in html
    assert "goodput Δ <b>+" in html and "95% CI [" in html
    # plots: 6 vs level (two series each) + 2 over time per arm, each with a <title> right after <svg>
    svgs = re.findall(r'<svg class="plot[^"]*"[^>]*>\s*<title>[^<]+</title>', html)
    assert len(svgs) == PLOTS_VS_LEVEL + 2 * PLOTS_OVER_TIME == html.count("<svg"), len(svgs)
    assert html.count('class="plot timeseries"') == 2 * PLOTS_OVER_TIME
    assert html.count('<polyline class="series"') == 2 * PLOTS_VS_LEVEL + 2 * 3  # running, waiting, kv per arm
    # SLO lines exactly where the SLO has the key (TTFT p95, TPOT p95), capacity markers for both arms
    assert html.count('class="slo-line"') == 2
    assert "SLO ttft_p95 ≤ 500 ms" in html and "SLO tpot_p95 ≤ 80 ms" in html
    for label in ("C eff", "T eff", "C res", "T res", "C stress", "T stress"):
        assert f">{label}</text>" in html, label
    # level boundaries from levels.jsonl: a shaded measured window per level per arm
    assert html.count('fill-opacity="0.06"') == 2 * len(LEVELS) * PLOTS_OVER_TIME
    # fixed variables: the variable under test highlighted
    assert re.search(r'<tr class="under-test"><td><code>serving\.slots</code></td><td>4</td><td>8</td>', html)
    assert "kv_capacity" in html  # diagnosis from compare
    # untrusted text is escaped everywhere (title, manifest values, SVG legend, warnings); no script, no fetches
    for raw in (XSS_MODEL, "<svg onload", "<img src", "<b>A/B</b>"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert 'class="legend" x="' in html and "ctl|&lt;svg onload=alert(2)&gt;" in html
    assert "&lt;img src=x onerror=alert(3)&gt;" in html
    assert "<script" not in html.lower()
    assert not re.search(r"<[^>]*\s(src|href)\s*=", html), "the report must not load anything"
    assert not re.search(r"url\(|@import|@font-face", html)


def test_html_without_run_dirs_and_single_run(result, runs, tmp_path):
    # a saved compare --json (no summaries, no run dirs): still a report, p99 plots empty, only differing keys
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(result.to_json()))
    saved = read_comparison(path)
    assert saved.summaries is None and saved.to_json() == result.to_json()
    html = render_html(saved)
    assert "verdict: performance-scaling" in html and html.count('<svg class="plot"') == PLOTS_VS_LEVEL
    assert "no data" in html and "No server telemetry" in html and "serving.slots" in html
    single = render_html_single(runs["treatment"].summary, runs["treatment"], title="one run")
    assert 'class="verdict' not in single
    assert single.count("<svg") == PLOTS_VS_LEVEL + PLOTS_OVER_TIME
    assert single.count('<polyline class="series"') == PLOTS_VS_LEVEL + 3 and single.count('class="slo-line"') == 2
    assert XSS_MODEL not in single
    assert "| c=12 |" in render_markdown_single(runs["treatment"].summary)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()[:24]
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def _chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"headless Chromium not found at {CHROMIUM}: install it (Debian: apt-get install -y chromium) "
                    "or point KVCAP_CHROMIUM at it — the HTML report is checked in a real browser")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp / 'profile'}",
           "--enable-logging=stderr", "--v=0", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _console(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]


@pytest.mark.chromium
def test_renders_in_headless_chromium(report, tmp_path):
    shot = tmp_path / "shot.png"
    proc = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,2400", report.as_uri())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _png_size(shot) == (1280, 2400) and shot.stat().st_size > 20_000
    assert not _console(proc.stderr), _console(proc.stderr)
    dom = _chromium(tmp_path, "--dump-dom", report.as_uri())
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert not _console(dom.stderr), _console(dom.stderr)
    # the browser parsed the inline SVG as SVG: every plot with its title, lines and text survived
    assert len(re.findall(r'<svg class="plot[^"]*"', dom.stdout)) == PLOTS_VS_LEVEL + 2 * PLOTS_OVER_TIME
    assert dom.stdout.count('class="slo-line"') == 2 and "<polyline" in dom.stdout and "<circle" in dom.stdout
    assert "verdict: performance-scaling" in dom.stdout
    assert "<script" not in dom.stdout.lower() and "&lt;script&gt;alert(1)&lt;/script&gt;" in dom.stdout
    # the console check is not vacuous: a page with a script error is caught by it
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><p>x</p><script>throw new Error("boom")</script>')
    assert any("Uncaught" in ln for ln in _console(_chromium(tmp_path, "--dump-dom", bad.as_uri()).stderr))


def test_markdown(result):
    md = render_markdown(result)
    assert md.startswith("### kvcap compare: **performance-scaling**")
    assert "Goodput Δ **+" in md and "95% CI [" in md and "beyond noise" in md
    for c in LEVELS:
        rows = [ln for ln in md.splitlines() if ln.startswith(f"| c={c} |")]
        assert len(rows) == 1, (c, md)
        assert rows[0].count(" | ") == 11  # 12 cells: level, tok/s, goodput, CI, TTFT, TPOT, SLO per arm
    assert "| c=4 |" in md and md.count("| pass |") + md.count("| FAIL |") >= 1
    # per-arm table: the hostile arm name does not split the cell, nor inject HTML
    arm_row = next(ln for ln in md.splitlines() if ln.startswith("| control ("))
    assert "ctl\\|&lt;svg onload=alert(2)&gt;" in arm_row
    assert len(re.split(r"(?<!\\)\|", arm_row)) == 8  # 6 cells
    assert "<svg" not in md and "<img" not in md and XSS_MODEL not in md
    assert "Warnings" in md and "&lt;img src=x" in md and "Under test: `serving.slots` 4 → 8" in md


def test_formatting_helpers():
    assert [fmt(v) for v in (None, True, 1234567, 2.0, 1234.5, 12.34, 0.1234, 0.01234)] == [
        "–", "yes", "1,234,567", "2", "1,234", "12.3", "0.12", "0.0123"]
    assert fmt(0.5, 3) == "0.500" and fmt(float("inf")) == "inf"
    assert [fmtm(v) for v in (0, 2.0, 12.0, 1234.0, None)] == ["0", "2.00", "12.0", "1,234", "–"]
    assert [signed(v) for v in (3, -0.04, 1234.56, None, float("nan"))] == ["+3.0", "-0.0", "+1,234.6", "–", "–"]
    assert [level_name("concurrency", 8), level_name("rate", 2.5), level_name("x", 1)] == ["c=8", "λ=2.50", "x=1"]
    assert [value_text(v) for v in ("a b", None, [1, "x"], 2.5)] == ["a b", "null", '[1, "x"]', "2.5"]
    assert pair([1]) == [1, None] and pair(None) == [None, None] and pair([1, 2]) == [1, 2]
    assert esc('<a href="x">&</a>') == "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;" and esc(None) == ""


def test_level_windows_merge_workers_and_order_by_start():
    rows = [{"mode": "concurrency", "level": 8, "repeat": 0, "worker": 1, "t_start_s": 10.5, "measure_start_s": 11,
             "measure_end_s": 20, "t_end_s": 21},
            {"mode": "concurrency", "level": 8, "repeat": 0, "worker": 0, "t_start_s": 10.0, "measure_start_s": 11.5,
             "measure_end_s": 19.5, "t_end_s": 22},
            {"mode": "concurrency", "level": 4, "t_start_s": 0.0, "measure_start_s": float("nan"),
             "measure_end_s": float("nan")}]
    levels = [LevelRow.model_validate(row) for row in rows]
    assert level_windows(levels) == [
        {"mode": "concurrency", "level": 4, "repeat": 0, "t_start_s": 0.0},
        {"mode": "concurrency", "level": 8, "repeat": 0, "t_start_s": 10.0, "measure_start_s": 11, "measure_end_s": 20,
         "t_end_s": 22}]


def test_levels_from_per_level_pick_one_arm(result):
    levels = levels_from_per_level(result, 1)
    assert [lv.level for lv in levels] == list(LEVELS)
    for lv, row in zip(levels, result.per_level):
        assert lv.to_json() == {"mode": "concurrency", "level": row.level, "output_tok_s": row.output_tok_s[1],
                                "goodput_tok_s": row.goodput_tok_s[1], "ttft_ms": {"p95": row.ttft_p95_ms[1]},
                                "tpot_ms": {"p95": row.tpot_p95_ms[1]}, "slo_ok": row.slo_ok[1],
                                "server_running_max": row.server_running_max[1]}
        assert lv.requests is None and lv.ttft_ms.p99 is None


def test_a_saved_comparison_that_is_not_one_is_one_clear_error(result, tmp_path):
    path = tmp_path / "compare.json"
    broken = result.to_json()
    broken["per_level"][0]["slo_ok"] = [True]  # one arm's figure lost
    path.write_text(json.dumps(broken))
    with pytest.raises(InputError, match=r"not a kvcap comparison: per_level\.0\.slo_ok: List should have at least 2"):
        read_comparison(path)
    path.write_text("{")
    with pytest.raises(InputError, match="is not valid JSON"):
        read_comparison(path)
