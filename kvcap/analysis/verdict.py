"""``compare``: the same-caliber check, then the verdict — performance scaling, performance only, capacity only,
no gain or regression — with the evidence and its noise, and which of capacity, goodput and latency moved.

Noise is a bootstrap over requests (and over repeats when there are several): a difference whose 95%
interval includes zero is not a gain. Latency moves where the two arms' 95% intervals of a p95 (each arm's
summary's, over its requests) lie apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvcap.analysis.diagnosis import diagnose, level_at
from kvcap.analysis.effect import TierHits, effect_signs, idle_tier_warning
from kvcap.analysis.engine_limits import engine_limits
from kvcap.analysis.lengths import TOLERANCE, asked_mean, levels_input_mean, relative_gap
from kvcap.analysis.prefix_reuse import (
    records_hit_nothing,
    reusable_share,
    shares_prefixes,
    users_think,
)
from kvcap.analysis.summary import best_goodput_level, build_summary
from kvcap.rundir import RunDir
from kvcap.rundir.compare import (
    ArmInputLengths,
    ArmResult,
    ArmSummaries,
    Comparison,
    Difference,
    FixedVariables,
    GoodputGain,
    InputLengths,
    LevelPair,
    Moved,
)
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.store.column_reader import read_columns
from kvcap.rundir.store.columns import Key
from kvcap.rundir.store.level_blocks import Level
from kvcap.rundir.summary import Summary

Window = tuple[float, float]
"""A measured window (run seconds)."""
NOT_FIXED = {"target.url"}
"""Keys that are expected to differ between arms (two servers) and are not fixed variables."""
BOOTSTRAP = 400
BOOT_EXACT_MAX = 20_000
"""Requests in a repeat past which its bootstrap sum is drawn from the normal limit of a resampled sum (central
limit theorem) instead of resampling: ``BOOTSTRAP`` × n resampled indices grow with the run, in memory and time
(see benchmarks/README.md, ``sim_speed.py``)."""

MEASURED_INPUT = "requests.input_tokens_mean"
"""Not a manifest key: each arm's mean input tokens as its records (the server's usage) say."""
_LENGTH_SOURCES = ("workload.input_tokens", "workload.dataset", "workload.tokenizer", "load.seed", "load.mode",
                   "load.trace_rows", "workload.prefix_tokens", "workload.turns")
DERIVED: dict[str, tuple[str, ...]] = {
    "workload.prompt_set": ("workload.input_tokens", "workload.dataset", "workload.prefix_tokens",
                            "workload.prefix_groups", "workload.prompts_per_group", "workload.turns", "load.seed"),
    "workload.prompt": ("workload.prefix_tokens", "workload.dataset", "workload.turns"),  # what a prompt is made of
    "workload.prompts_per_group": ("workload.dataset",),  # stated only for generated shared-prefix prompts
    "workload.input_tokens_measured": _LENGTH_SOURCES,
    MEASURED_INPUT: _LENGTH_SOURCES,
    "workload.input_tokens": ("workload.dataset",),  # a dataset's prompts have no asked length
    "load.concurrency": ("load.mode",), "load.rate": ("load.mode",), "load.arrival": ("load.mode",),
    "load.trace": ("load.mode", "load.trace_speed"),  # the trace mode's one level is its speed
    "load.trace_speed": ("load.mode",), "load.trace_rows": ("load.mode",),
    "load.trace_requests": ("load.mode", "load.trace_rows"),
    "workload.dataset_sha256": ("workload.dataset",),
}
"""Keys that follow others: a difference in one is accepted when a key it derives from differs and is accepted
(allowed or under test), so ``--allow-diff workload.input_tokens`` also accepts the prompt set and the measured
lengths that come with it."""
WITHIN_TOLERANCE = {"workload.input_tokens_measured", MEASURED_INPUT}
"""Measured figures: equal within :data:`kvcap.analysis.lengths.TOLERANCE`, unknown (None) on either side is no
difference (the other measured key still speaks)."""


CONTENT_DIGEST = {"workload.dataset": "workload.dataset_sha256"}
"""A file's key and the key of its content's SHA-256: where both runs recorded the digest, it decides (the same file
at two paths is no difference; another file at the same path is, under the digest's key). A run without it (older
kvcap) is compared by the path."""


def _same(key: str, a: Any, b: Any) -> bool:
    if key in CONTENT_DIGEST.values():  # unknown on one side: the path decides
        return a is None or b is None or a == b
    if key in WITHIN_TOLERANCE:
        return a is None or b is None or relative_gap(float(a), float(b)) <= TOLERANCE
    return bool(a == b)


def same_caliber(control: Manifest | None, treatment: Manifest | None, allow: set[str],
                 measured: Mapping[str, tuple[Any, Any]] | None = None) -> FixedVariables:
    """Every fixed variable must match except those under test or explicitly allowed, and the keys derived from
    those (:data:`DERIVED`); ``measured`` adds figures from the records, ``{key: (control, treatment)}``."""
    fc = dict(control.fixed) if control is not None else {}
    ft = dict(treatment.fixed) if treatment is not None else {}
    for key, (a, b) in (measured or {}).items():
        fc[key], ft[key] = a, b
    under_test = (set(control.under_test if control is not None else [])
                  | set(treatment.under_test if treatment is not None else []))
    accepted = allow | under_test

    def by_digest(key: str) -> bool:
        digest = CONTENT_DIGEST.get(key)
        return digest is not None and fc.get(digest) is not None and ft.get(digest) is not None

    def differs(key: str) -> bool:
        if by_digest(key):
            return bool(fc[CONTENT_DIGEST[key]] != ft[CONTENT_DIGEST[key]])
        return not _same(key, fc.get(key), ft.get(key))

    def tolerated(key: str) -> bool:
        return key in accepted or any(differs(src) and tolerated(src) for src in DERIVED.get(key, ()))

    diffs: list[Difference] = []
    allowed: list[Difference] = []
    for key in sorted(set(fc) | set(ft)):
        if key in NOT_FIXED or by_digest(key):  # a file with digests on both sides: its digest key says it
            continue
        a, b = fc.get(key), ft.get(key)
        if differs(key):
            item = Difference(key=key, control=a, treatment=b)
            if key in WITHIN_TOLERANCE:
                item.tolerance = TOLERANCE
            (allowed if tolerated(key) else diffs).append(item)
    return FixedVariables(equal=not diffs, differences=diffs, allowed_differences=allowed,
                          under_test=sorted(under_test))


def input_lengths(manifest: Manifest | None, summary: Summary) -> InputLengths:
    """One arm's input lengths: asked (mean of the spec), measured before the run (manifest) and by its records."""
    fixed = manifest.fixed if manifest is not None else {}
    server = manifest.server if manifest is not None else {}
    return InputLengths(asked_mean=asked_mean(manifest), calibrated_mean=fixed.get("workload.input_tokens_measured"),
                        records_mean=levels_input_mean(summary.levels),
                        method=(server.get("input_lengths") or {}).get("method"))


class _KeptColumns:
    """A ``build_summary`` reader that keeps the per-level columns it read (and the windows asked for), so the
    bootstrap of goodput reuses them instead of reading every record again."""

    def __init__(self) -> None:
        self.by_level: dict[Key, Level] = {}
        self.windows: dict[Key, dict[int, Window]] = {}

    def __call__(self, path: Path, windows: dict[Key, dict[int, Window]]) -> dict[Key, Level]:
        self.by_level, self.windows = read_columns(path, windows), windows
        return self.by_level


def _good_tokens(kept: _KeptColumns, slo: dict[str, float]) -> dict[float, list[np.ndarray]]:
    """Per level, per repeat: each request's in-window output tokens counted toward goodput, per second of the
    measured window (every request of the level and repeat: one sent in warm-up may deliver inside it)."""
    out: dict[float, list[np.ndarray]] = {}
    for key in sorted(kept.windows):
        level = kept.by_level.get(key)
        if level is None:
            continue
        reps = sorted(kept.windows[key].items())
        parts: dict[int, list[np.ndarray]] = {rep: [] for rep, _ in reps}
        for arrays in level.blocks():
            good = arrays.meets(slo)
            for rep, (t0, t1) in reps:
                mine = arrays.repeat == rep
                if mine.any():
                    parts[rep].append(np.where(good, arrays.request_tokens(t0, t1), 0)[mine] / max(t1 - t0, 1e-9))
        for rep, _ in reps:
            if parts[rep]:
                out.setdefault(key[1], []).append(np.concatenate(parts[rep]))
    return out


def _boot(samples: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Bootstrap distribution of the median-over-repeats goodput (requests resampled within each repeat)."""
    draws = []
    for arr in samples:
        if arr.size == 0:
            draws.append(np.zeros(BOOTSTRAP))
            continue
        if arr.size > BOOT_EXACT_MAX:  # the resampled sum's normal limit: mean n·x̄, variance n·σ̂²
            draws.append(rng.normal(float(arr.sum()), float(np.sqrt(arr.size) * arr.std()), BOOTSTRAP))
            continue
        idx = rng.integers(0, arr.size, size=(BOOTSTRAP, arr.size))
        draws.append(arr[idx].sum(axis=1))
    stacked = np.vstack(draws)
    if stacked.shape[0] > 1:  # resample repeats too
        pick = rng.integers(0, stacked.shape[0], size=(BOOTSTRAP, stacked.shape[0]))
        medians: np.ndarray = np.median(np.take_along_axis(stacked.T, pick, axis=1), axis=1)
        return medians
    first: np.ndarray = stacked[0]
    return first


def compare(control_dir: str, treatment_dir: str, slo: dict[str, float] | None = None,
            allow: set[str] | None = None, seed: int = 0) -> Comparison:
    """``compare.json``'s content (``to_json``) with, under ``summaries`` (not written), the two arms'
    :class:`~kvcap.rundir.summary.Summary` (for the reports)."""
    rc, rt = RunDir(control_dir), RunDir(treatment_dir)
    mc, mt = rc.manifest, rt.manifest
    slo = slo if slo is not None else (rc.slo or rt.slo)
    kc, kt = _KeptColumns(), _KeptColumns()
    sc, st = build_summary(rc, slo, reader=kc), build_summary(rt, slo, reader=kt)
    lengths = ArmInputLengths(control=input_lengths(mc, sc), treatment=input_lengths(mt, st))
    caliber = same_caliber(mc, mt, allow or set(), measured={
        MEASURED_INPUT: (lengths.control.records_mean, lengths.treatment.records_mean)})
    rng = np.random.default_rng(seed)
    gc, gt = _good_tokens(kc, slo), _good_tokens(kt, slo)
    control, treatment = arm_result(sc, "control"), arm_result(st, "treatment")
    # noise of the best-goodput difference
    lc, lt = control.goodput_level, treatment.goodput_level
    bc = _boot(gc.get(float(lc), [np.zeros(1)]), rng) if lc is not None else np.zeros(BOOTSTRAP)
    bt = _boot(gt.get(float(lt), [np.zeros(1)]), rng) if lt is not None else np.zeros(BOOTSTRAP)
    diff = bt - bc
    lo, hi = (float(x) for x in np.percentile(diff, [2.5, 97.5]))
    gain = GoodputGain(delta_tok_s=round(treatment.goodput_tok_s - control.goodput_tok_s, 3),
                       ci95=[round(lo, 3), round(hi, 3)], beyond_noise=lo > 0 or hi < 0)
    per_level = _per_level(sc, st, gc, gt, rng)
    verdict, moved = judge(sc, st, gain)
    ec, et = control.effective, treatment.effective
    efficiency = None
    if ec and et and ec != et and control.goodput_tok_s > 0:
        efficiency = round((treatment.goodput_tok_s / control.goodput_tok_s - 1) / (et / ec - 1), 4)
    tiers = TierHits.of(sc, records_hit_nothing(rc)), TierHits.of(st, records_hit_nothing(rt))
    took_effect, evidence, effect_warning = effect_signs(sc, st, tiers)
    warnings = [effect_warning] if effect_warning else []
    idle = idle_tier_warning(mt, tiers[1])
    if idle:
        warnings.append(idle)
    if not caliber.equal:
        warnings.append("fixed variables differ: " + ", ".join(d.key for d in caliber.differences))
    comparison = Comparison(verdict=verdict, control=control, treatment=treatment, goodput_gain=gain,
                            moved=moved, efficiency=efficiency, fixed_variables=caliber, input_lengths=lengths, slo=slo,
                            per_level=per_level, treatment_took_effect=took_effect,
                            **({"effect_evidence": evidence} if evidence else {}), warnings=warnings,
                            diagnosis=diagnose(sc.levels, "control", shared_prefixes=shares_prefixes(mc),
                                               reusable=reusable_share(mc), thinks=users_think(mc),
                                               limits=engine_limits(mc))
                            + diagnose(st.levels, "treatment", shared_prefixes=shares_prefixes(mt),
                                       reusable=reusable_share(mt), thinks=users_think(mt),
                                       limits=engine_limits(mt)))
    comparison.summaries = ArmSummaries(control=sc, treatment=st)
    return comparison


def arm_result(summary: Summary, name: str) -> ArmResult:
    """One arm's capacities and best goodput, from its summary (``name``: 'control' or 'treatment')."""
    cap = summary.capacity
    best = best_goodput_level(summary.levels)
    return ArmResult(effective=cap.effective, resident=cap.resident, resident_source=cap.resident_source,
                     stress_limit=cap.stress_limit, goodput_tok_s=best.goodput_tok_s if best else 0.0,
                     goodput_level=best.level if best else None, limited_by=cap.limited_by, arm=summary.arm or name)


def judge(control: Summary, treatment: Summary, gain: GoodputGain) -> tuple[str, Moved]:
    """The verdict (``decide``) and what moved, from the two arms' summaries and the best-goodput difference."""
    c, t = arm_result(control, "control"), arm_result(treatment, "treatment")
    lo, hi = gain.ci95
    latency, evidence = latency_moved(control, treatment)
    ec, et = c.effective or 0, t.effective or 0
    capacity = "higher" if et > ec else "lower" if et < ec else "same"
    goodput = "higher" if lo > 0 else "lower" if hi < 0 else "same"
    text = (f"effective capacity {capacity} ({c.effective if c.effective is not None else 'none'} → "
            f"{t.effective if t.effective is not None else 'none'}); goodput {goodput}"
            + (" beyond noise" if goodput != "same" else " within noise")
            + f" ({gain.delta_tok_s:+.1f} tok/s, 95% CI [{lo:+.1f}, {hi:+.1f}]); latency {latency}"
            + (f": {'; '.join(evidence)}" if evidence else ""))
    moved = Moved(capacity=capacity, goodput=goodput, latency=latency, latency_evidence=evidence, text=text)
    return decide(c, t, lo, hi, latency), moved


def decide(c: ArmResult, t: ArmResult, lo: float, hi: float, latency: str = "unknown") -> str:
    """The verdicts as docs/judging.md defines them (compare.json), with 'beyond noise' = the 95% interval
    of the goodput difference excludes 0; ``latency``: how latency moved (``latency_moved``). A gain at equal
    effective capacity is performance, not capacity: it needs both goodput and latency better beyond noise."""
    ec, et = c.effective or 0, t.effective or 0
    if et < ec or hi < 0:
        return "regression"
    if et > ec and lo > 0:
        return "performance-scaling"
    if et == ec and lo > 0 and latency == "lower":
        return "performance-only"
    if (t.resident or 0) > (c.resident or 0):
        return "capacity-only"
    return "no-gain"


LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"))
LATENCY_MOVE = 0.05
"""The least relative change of a p95 that counts as a move, beside its intervals lying apart: a deterministic
simulator's intervals can be apart for a change no user would notice."""


def latency_moved(control: Summary, treatment: Summary) -> tuple[str, list[str]]:
    """How TTFT and TPOT p95 moved at the levels both arms ran, up to the higher effective capacity (every level
    both ran where neither arm has one): a p95 moved where the arms' 95% intervals lie apart and it changed by
    ``LATENCY_MOVE`` or more. 'lower', 'higher',
    'mixed', 'same' (intervals, none apart) or 'unknown' (no intervals); with each move's numbers."""
    efficient = [e for e in (control.capacity.effective, treatment.capacity.effective) if e is not None]
    top = max(efficient) if efficient else None
    theirs = {(lv.mode, float(lv.level)): lv for lv in treatment.levels}
    ways: set[str] = set()
    known = False
    evidence: list[str] = []
    for a in control.levels:
        b = theirs.get((a.mode, float(a.level)))
        if b is None or (top is not None and a.level > top):
            continue
        for label, key in LATENCIES:
            ca, cb = getattr(a.ci95, f"{key}_p95_ms"), getattr(b.ci95, f"{key}_p95_ms")
            if not ca or not cb:
                continue
            known = True
            pa, pb = getattr(a, f"{key}_ms").p95, getattr(b, f"{key}_ms").p95
            way = "lower" if cb[1] < ca[0] else "higher" if cb[0] > ca[1] else None
            if way is None or (pa and pb and abs(pb / pa - 1) < LATENCY_MOVE):
                continue
            ways.add(way)
            digits = 0 if key == "ttft" else 1
            evidence.append(f"{label} p95 {pa:,.{digits}f} → {pb:,.{digits}f} ms at {level_at(a)}"
                            if pa is not None and pb is not None else f"{label} p95 {way} at {level_at(a)}")
    if len(ways) == 2:
        return "mixed", evidence
    if ways:
        return ways.pop(), evidence
    return ("same" if known else "unknown"), evidence


def _per_level(sc: Summary, st: Summary, gc: dict[float, list[np.ndarray]], gt: dict[float, list[np.ndarray]],
               rng: np.random.Generator) -> list[LevelPair]:
    tl = {lv.level: lv for lv in st.levels}
    out = []
    for lc in sc.levels:
        lt = tl.get(lc.level)
        if lt is None:
            continue
        level = float(lc.level)
        d = _boot(gt.get(level, [np.zeros(1)]), rng) - _boot(gc.get(level, [np.zeros(1)]), rng)
        lo, hi = np.percentile(d, [2.5, 97.5])
        out.append(LevelPair(level=lc.level, mode=lc.mode,
                             output_tok_s=[lc.output_tok_s, lt.output_tok_s],
                             goodput_tok_s=[lc.goodput_tok_s, lt.goodput_tok_s],
                             goodput_delta_ci95=[round(float(lo), 3), round(float(hi), 3)],
                             ttft_p95_ms=[lc.ttft_ms.p95, lt.ttft_ms.p95],
                             tpot_p95_ms=[lc.tpot_ms.p95, lt.tpot_ms.p95],
                             slo_ok=[lc.slo_ok, lt.slo_ok],
                             server_running_max=[lc.server_running_max, lt.server_running_max],
                             server_parked_max=[lc.server_parked_max, lt.server_parked_max]))
    return out
