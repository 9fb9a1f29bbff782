"""The A/B verdict on hand-made arm pairs: performance-scaling, capacity-only, no-gain, regression.

docs/run-directory.md's definitions (compare.json's verdict): more effective capacity *and* a goodput gain beyond
noise (the 95% interval of the difference excludes 0) is performance scaling; the same stable concurrency but more
resident requests is capacity only; less effective capacity, or a goodput loss beyond noise, is a regression; else no
gain.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcap.analysis.effect import treatment_took_effect
from kvcap.analysis.verdict import BOOT_EXACT_MAX, _boot, decide, same_caliber
from kvcap.rundir.compare import ArmResult
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import LevelSummary


def arm(effective: float | None, resident: int | None) -> ArmResult:
    return ArmResult(effective=effective, resident=resident, resident_source=None, stress_limit=None,
                     goodput_tok_s=0.0, goodput_level=None, limited_by=None, arm="a")


@pytest.mark.parametrize(("control", "treatment", "ci", "verdict"), [
    (arm(48, 60), arm(64, 80), (10.0, 50.0), "performance-scaling"),
    (arm(48, 60), arm(48, 96), (-5.0, 5.0), "capacity-only"),        # the seed demo's outcome
    (arm(48, 60), arm(64, 96), (-5.0, 5.0), "capacity-only"),        # more effective, but goodput within noise
    (arm(48, 60), arm(64, 60), (0.0, 5.0), "no-gain"),               # an interval touching 0 is not a gain
    (arm(48, 60), arm(48, 60), (-5.0, 5.0), "no-gain"),
    (arm(48, 60), arm(48, 60), (10.0, 50.0), "no-gain"),             # a gain without more capacity of either kind
    (arm(48, 60), arm(32, 96), (10.0, 50.0), "regression"),          # less effective capacity
    (arm(48, 60), arm(48, 96), (-50.0, -10.0), "regression"),        # a goodput loss beyond noise
    (arm(None, None), arm(8, None), (1.0, 2.0), "performance-scaling"),  # None counts as 0
    (arm(8, None), arm(None, 12), (-1.0, 1.0), "regression"),
])
def test_decide(control, treatment, ci, verdict):
    assert decide(control, treatment, *ci) == verdict


def test_same_caliber():
    control = Manifest(source="bench", run_id="c", started_at=0.0, under_test=["serving.kv_offload"],
                       fixed={"model.name": "llama-3.1-8b", "cluster.gpus": 4, "serving.kv_offload": "none",
                              "target.url": "http://a:8000", "workload.input_tokens": 1024})
    treatment = Manifest(source="bench", run_id="t", started_at=0.0,
                         fixed={"model.name": "llama-3.1-8b", "cluster.gpus": 4, "serving.kv_offload": "host",
                                "target.url": "http://b:8000", "workload.input_tokens": 2048, "load.repeats": 3})
    c = same_caliber(control, treatment, allow=set())
    assert c.equal is False
    assert [d.to_json() for d in c.differences] == [
        {"key": "load.repeats", "control": None, "treatment": 3},
        {"key": "workload.input_tokens", "control": 1024, "treatment": 2048}]
    assert [d.to_json() for d in c.allowed_differences] == [
        {"key": "serving.kv_offload", "control": "none", "treatment": "host"}]
    assert c.under_test == ["serving.kv_offload"]                 # target.url is expected to differ: not listed
    allowed = same_caliber(control, treatment, allow={"workload.input_tokens", "load.repeats"})
    assert allowed.equal is True and len(allowed.allowed_differences) == 3
    assert same_caliber(None, None, set()).to_json() == {"equal": True, "differences": [], "allowed_differences": [],
                                                         "under_test": []}


_EMPTY = {"p50": None, "p90": None, "p95": None, "p99": None, "mean": None}


def _summary(*levels: tuple[float, float | None, float | None]) -> list[LevelSummary]:
    """Summary levels with the server's running and parked maxima; the rest neutral."""
    return [LevelSummary.model_validate({
        "mode": "concurrency", "level": c, "requests": 1, "ok": 1, "errors": 0, "cancelled": 0, "error_classes": {},
        "output_tok_s": 0.0, "request_s": 0.0, "output_tok_s_repeats": [], "goodput_tok_s": 0.0,
        "goodput_tok_s_repeats": [], "in_flight_mean": None, "error_rate": 0.0, "truncated": 0,
        "output_tokens_mean": None, "input_tokens_mean": None, "ttft_ms": _EMPTY, "tpot_ms": _EMPTY, "e2e_ms": _EMPTY,
        "itl_ms": _EMPTY, "queue_ms": _EMPTY, "send_delay_ms": _EMPTY, "ci95": {}, "slo_ok": True,
        "failed_checks": [], "server_running_max": run, "server_parked_max": parked}) for c, run, parked in levels]


def test_treatment_took_effect():
    control = _summary((48, 48.0, None), (96, 60.0, None))
    assert treatment_took_effect(control, _summary((48, 48.0, None), (96, 60.0, 36.0))) is True  # parked
    assert treatment_took_effect(control, _summary((48, 48.0, None), (96, 72.0, None))) is True  # running
    assert treatment_took_effect(control, _summary((48, 48.0, 0.0), (96, 60.0, 0.0))) is False
    assert treatment_took_effect(control, _summary((48, None, None), (96, None, None))) is None  # no telemetry
    assert treatment_took_effect(control, _summary((64, 90.0, None))) is None                    # no shared level


def test_bootstrap_of_goodput_is_a_median_of_sums():
    rng = np.random.default_rng(0)
    same = _boot([np.full(10, 2.0)], rng)               # every resample of ten requests at 2 tok/s sums to 20
    assert same.shape == (400,) and np.all(same == 20.0)
    # three repeats of constant requests sum to 4, 6 and 8; the median of three resampled repeats is one of them
    three = _boot([np.full(2, 2.0), np.full(2, 3.0), np.full(2, 4.0)], rng)
    assert set(np.unique(three)) == {4.0, 6.0, 8.0} and np.median(three) == 6.0
    assert np.all(_boot([np.zeros(0)], rng) == 0.0)     # no requests: no goodput
    again = _boot([np.arange(5.0)], np.random.default_rng(7))
    assert np.array_equal(again, _boot([np.arange(5.0)], np.random.default_rng(7)))   # a fixed seed repeats


def test_a_big_repeats_bootstrap_is_the_resampled_sums_normal_limit():
    """Past ``BOOT_EXACT_MAX`` requests the resampled sum is drawn from its normal limit: its 95% interval is the
    exact bootstrap's (computed here in batches) within a few percent of the interval's width, on skewed data —
    a third of the requests missing the SLO (0 tokens), the rest gamma-distributed."""
    rng = np.random.default_rng(3)
    n = BOOT_EXACT_MAX + 5_000
    arr = np.where(rng.random(n) < 0.33, 0.0, rng.gamma(2.0, 3.0, n))
    limit = _boot([arr], np.random.default_rng(1))
    exact = np.concatenate([arr[rng.integers(0, n, size=(100, n))].sum(axis=1) for _ in range(40)])
    lo, hi = np.percentile(exact, [2.5, 97.5])
    width = hi - lo
    got = np.percentile(limit, [2.5, 97.5])
    assert abs(got[0] - lo) < 0.06 * width and abs(got[1] - hi) < 0.06 * width
    assert abs(np.median(limit) - arr.sum()) < 0.1 * width
