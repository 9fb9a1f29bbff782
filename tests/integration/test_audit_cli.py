"""``kvcap audit`` as a user runs it (the CLI in a subprocess): the JSON it prints and its one-line input errors.
Split from ``tests/unit/test_audit.py``, which checks ``audit_table`` itself."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT, run_cli


def test_audit_cli_json_and_errors(tmp_path):
    table = ROOT / "tests" / "data" / "article_table.csv"
    p = run_cli("audit", str(table), "--output-tokens", "256", "--slo", "ttft_p95=500ms,tpot_p95=80ms", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    tpot = next(f for f in d["findings"] if f["check"] == "implied_tpot" and f["level"] == 8)
    assert tpot["implied_tpot_ms"] == pytest.approx((256 / (97 / 8) - 0.25) / 255 * 1e3, rel=1e-3)
    bad = tmp_path / "t.csv"
    bad.write_text("concurrency,ttft_ms\n8,250\n")
    p = run_cli("audit", str(bad), "--output-tokens", "256")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "output_tok_s" in p.stderr
