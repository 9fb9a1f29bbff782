"""The A/B verdict's goodput samples on a real ``kvcap sim`` run (the CLI in a subprocess). Split from
``tests/unit/test_analysis_verdict.py``, whose hand-made arm pairs need no run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import ROOT, run_cli


@pytest.mark.parametrize("args", [["--warmup", "5s"], ["--warmup", "5s", "--no-itl"]])
def test_goodput_samples_are_each_requests_in_window_tokens(args, tmp_path):
    """The bootstrap's samples, taken from the summary's columns, are the plain per-record definition: every
    request of the level and repeat (warm-up ones too) that met each per-request SLO, its tokens inside the
    window, per second of it."""
    from kvcap.analysis.stats import meets_request_slo, tokens_in_window
    from kvcap.analysis.summary import build_summary
    from kvcap.analysis.verdict import _good_tokens, _KeptColumns
    from kvcap.rundir import RunDir

    out = tmp_path / "run"
    p = run_cli("sim", str(ROOT / "scenarios" / "seed-reference.yaml"), "--concurrency", "8,32", "--requests", "120",
                "--repeats", "2", *args, "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    run, slo = RunDir(out), {"ttft_p95": 300.0, "tpot_p95": 30.0}
    kept = _KeptColumns()
    build_summary(run, slo, reader=kept)
    got = _good_tokens(kept, slo)
    windows = {(lv.level, lv.repeat): (lv.measure_start_s, lv.measure_end_s) for lv in run.levels()}
    for level in (8.0, 32.0):
        for rep in (0, 1):
            t0, t1 = windows[(level, rep)]
            recs = [r for r in run.records() if float(r["level"]) == level and r["repeat"] == rep]
            want = [tokens_in_window(r, t0, t1) / (t1 - t0) if meets_request_slo(r, slo) else 0.0 for r in recs]
            assert np.array_equal(got[level][rep], np.array(want))
            assert 0 < np.count_nonzero(want) < len(want)  # the SLO passes some requests and fails others
