"""``compare.json``: the A/B verdict (``analysis.verdict.compare``), as ``kvcap compare --json`` prints it and
``kvcap ab`` writes it beside the two arms' run directories.

The verdicts: ``performance-scaling`` (more effective capacity *and* a goodput gain beyond noise: the 95% interval
of the difference excludes 0), ``performance-only`` (the same effective capacity, a goodput gain beyond noise and
lower latency beyond noise: faster, not more), ``capacity-only`` (more resident requests, not more stable
concurrency), ``regression`` (less effective capacity, or a goodput loss beyond noise), ``no-gain`` (anything
else). ``moved`` says which of the three — capacity, goodput, latency — moved.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvcap.rundir.model import Number, RunModel
from kvcap.rundir.summary import Finding, Summary


class ArmResult(RunModel):
    """One arm's capacities and its best goodput (``summary.json``'s, judged against the comparison's SLO)."""

    effective: Number | None = Field(description="effective capacity (the summary's capacity.effective)")
    resident: int | None = Field(description="resident requests (capacity.resident)")
    resident_source: str | None = Field(description="where resident came from (capacity.resident_source)")
    stress_limit: Number | None = Field(description="capacity.stress_limit")
    goodput_tok_s: float = Field(description="the best level's goodput (tokens/s); 0.0 without levels")
    goodput_level: Number | None = Field(description="that level (the first of equals)")
    limited_by: str | None = Field(description="capacity.limited_by")
    arm: str = Field(description="the arm's name (the summary's arm, else 'control'/'treatment')")


class GoodputGain(RunModel):
    """Treatment − control at each arm's best level, with its bootstrap interval."""

    delta_tok_s: float = Field(description="goodput difference (tokens/s)")
    ci95: list[float] = Field(description="its 95% interval [low, high] (tokens/s)")
    beyond_noise: bool = Field(description="the interval excludes 0")


class Difference(RunModel):
    """A fixed variable whose values differ between the arms."""

    key: str = Field(description="the dotted key")
    control: Any = Field(description="its value in the control run (None: not set)")
    treatment: Any = Field(description="its value in the treatment run")
    tolerance: float | None = Field(default=None,
                                    description="measured figures: the relative gap within which they count "
                                                "as equal")


class FixedVariables(RunModel):
    """The same-caliber check: every fixed variable equal but those under test or allowed."""

    equal: bool = Field(description="no difference outside those accepted")
    differences: list[Difference] = Field(description="differences not accepted (compare exits 3)")
    allowed_differences: list[Difference] = Field(description="differences accepted: under test, --allow-diff, or "
                                                              "derived from those")
    under_test: list[str] = Field(description="the keys either arm has under test")


class InputLengths(RunModel):
    """One arm's mean input length (tokens): asked, measured before the run, and as the records say."""

    asked_mean: float | None = Field(description="the mean of the asked distribution (workload.input_tokens)")
    calibrated_mean: float | None = Field(description="measured before the run (workload.input_tokens_measured)")
    records_mean: float | None = Field(description="the server's count over the successful requests")
    method: str | None = Field(description="how the pre-run measurement was taken")


class LevelPair(RunModel):
    """A level both arms ran: each figure as [control, treatment]."""

    level: Number = Field(description="the level")
    mode: str = Field(description="its load model")
    output_tok_s: list[float] = Field(min_length=2, max_length=2, description="output tokens/s")
    goodput_tok_s: list[float] = Field(min_length=2, max_length=2, description="goodput tokens/s")
    goodput_delta_ci95: list[float] = Field(min_length=2, max_length=2, description="95% interval of the goodput "
                                                                                    "difference (tokens/s)")
    ttft_p95_ms: list[float | None] = Field(min_length=2, max_length=2, description="TTFT p95 (ms)")
    tpot_p95_ms: list[float | None] = Field(min_length=2, max_length=2, description="TPOT p95 (ms)")
    slo_ok: list[bool] = Field(min_length=2, max_length=2, description="the level passed")
    server_running_max: list[Number | None] = Field(min_length=2, max_length=2, description="requests running, "
                                                                                            "max (telemetry)")
    server_parked_max: list[Number | None] = Field(min_length=2, max_length=2, description="requests parked in a "
                                                                                           "lower tier, max "
                                                                                           "(telemetry)")


class Moved(RunModel):
    """Which of effective capacity, goodput and latency moved, treatment against control: what the verdict
    weighs, stated each on its own."""

    capacity: str = Field(description="effective capacity: 'higher', 'same' or 'lower'")
    goodput: str = Field(description="the best-goodput difference: 'higher' or 'lower' beyond noise, else 'same'")
    latency: str = Field(description="TTFT and TPOT p95 at the levels both arms ran up to the higher effective "
                                     "capacity (every level both ran where neither arm has one), moved where the "
                                     "95% intervals lie apart and the p95 changed by 5% or more: 'lower', "
                                     "'higher', 'mixed' (some each way), 'same' (none) or 'unknown' (no intervals)")
    latency_evidence: list[str] = Field(default_factory=list, description="each latency whose intervals are apart, "
                                                                          "with its numbers")
    text: str = Field(description="the three in one sentence, as compare prints it")


class ArmInputLengths(RunModel):
    """Both arms' input lengths."""

    control: InputLengths = Field(description="the control arm")
    treatment: InputLengths = Field(description="the treatment arm")


class ScheduledRepeat(RunModel):
    """One arm's repeat in the order ``kvcap ab`` ran them against real endpoints (the arms interleaved)."""

    arm: str = Field(description="the arm")
    repeat: int = Field(description="the repeat (0-based)")
    started_at: float = Field(description="when it started (Unix time, s)")
    ended_at: float = Field(description="when it ended (Unix time, s)")


class ArmSummaries(RunModel):
    """The two arms' summaries the comparison was built from (each is its arm's ``summary.json``)."""

    control: Summary = Field(description="the control arm's")
    treatment: Summary = Field(description="the treatment arm's")


class Comparison(RunModel):
    """``compare.json``."""

    verdict: str = Field(description="'performance-scaling', 'performance-only', 'capacity-only', 'no-gain' or "
                                     "'regression'")
    control: ArmResult = Field(description="the control arm")
    treatment: ArmResult = Field(description="the treatment arm")
    goodput_gain: GoodputGain = Field(description="the best-goodput difference and its noise")
    moved: Moved | None = Field(default=None, description="which of capacity, goodput and latency moved (absent "
                                                          "from a compare.json of an older kvcap)")
    efficiency: float | None = Field(description="relative goodput gain over relative effective-capacity gain")
    fixed_variables: FixedVariables = Field(description="the same-caliber check")
    input_lengths: ArmInputLengths = Field(description="each arm's input lengths")
    slo: dict[str, float] = Field(description="the SLO both arms were judged against")
    per_level: list[LevelPair] = Field(description="the levels both arms ran")
    treatment_took_effect: bool | None = Field(description="server telemetry shows more requests held by the "
                                                           "treatment at some level, or more prompt tokens served "
                                                           "from a lower tier, or the server's per-request "
                                                           "cached_tokens a larger share of the prompt tokens; None "
                                                           "without any")
    effect_evidence: list[str] | None = Field(default=None, description="what shows the treatment took effect, "
                                                                        "with its numbers (absent: only the "
                                                                        "held-requests sign, or none)")
    warnings: list[str] = Field(description="what the reader must know")
    diagnosis: list[Finding] = Field(description="both arms' findings")
    schedule: list[ScheduledRepeat] | None = Field(default=None, description="ab against real endpoints: the arms' "
                                                                             "repeats in the order they ran")
    summaries: ArmSummaries | None = Field(default=None, exclude=True, description="not written: the two summaries "
                                                                                   "compare built (None when read from "
                                                                                   "compare.json)")
