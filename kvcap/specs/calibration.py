"""A scenario's ``calibration:`` section: what ``kvcap calibrate`` fitted the scenario from — the runs, the step
cost's coefficients, the fit and its table — and the span the profile covered. The simulator runs the scenario's
other sections; of this one ``kvcap sim`` reads only the ``profiled_*`` spans, to say when a prediction
extrapolates.

Every key is optional: a section written by hand (or by an older kvcap) may hold only some of them. A section is
written back with the keys it was given, in the order below (the order ``kvcap calibrate`` writes them).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

Number = float | int
"""A YAML number kept as it was written (an integer stays an integer)."""
Span = Annotated[list[Number], Field(min_length=2, max_length=2)]
"""``[least, most]``."""


class SectionPart(BaseModel):
    """Unknown keys refused, values frozen, and only the keys given written back (no nulls added)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_serializer(mode="wrap")
    def _as_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if k in self.model_fields_set}


class Coefficient(SectionPart):
    """One coefficient of the fitted step cost."""

    value_s: Number = Field(description="its value (s)")
    stderr_s: Number | None = Field(default=None, description="its standard error (s) from the closed-form fit; "
                                                             "None where that fit did not estimate it")


class FittedSlots(SectionPart):
    """The server's concurrent sequences (decode slots) the fit used."""

    value: int = Field(description="the slots")
    source: str = Field(description="where the number came from")


class FitMethod(SectionPart):
    """How the coefficients were fitted."""

    method: str = Field(description="the method, in words")
    converged: bool = Field(description="the refinement converged")
    simulator_runs: int = Field(description="simulator runs the refinement took")
    rms_relative_error: Number = Field(description="RMS relative error of the simulated levels (a fraction)")
    notes: list[str] = Field(default_factory=list, description="decisions the fit took (coefficients left out, "
                                                               "the step budget)")


class FitRow(SectionPart):
    """One measured level: measured against simulated (throughput in tok/s, times in ms) and the error (%)."""

    run: str = Field(description="the run directory it was measured in")
    mode: str = Field(description="load model: 'concurrency', 'rate' or 'trace'")
    level: Number = Field(description="the load")
    held_out: bool = Field(description="kept out of the fit, to test it")
    measured: dict[str, Number] = Field(description="throughput, ttft_p50, ttft_p95, tpot_p50, tpot_p95")
    simulated: dict[str, Number | None] = Field(description="the same keys as the calibrated scenario simulates "
                                                            "them (None: not simulated)")
    error_pct: dict[str, Number | None] = Field(description="simulated against measured (%)")


class CalibrationSection(SectionPart):
    """``calibration:``."""

    source_runs: list[str] | None = Field(default=None, description="the run directories fitted")
    engine: str | None = Field(default=None, description="the scheduling profile: 'vllm' or 'llamacpp'")
    coefficients: dict[str, Coefficient] | None = Field(default=None, description="the step cost's coefficients by key "
                                                                                  "(serving.step_cost)")
    stderr_of: str | None = Field(default=None, description="what the standard errors are of")
    slots: FittedSlots | None = Field(default=None, description="the slots fitted")
    kv_tokens_source: str | None = Field(default=None, description="where serving.kv_tokens came from")
    fit: FitMethod | None = Field(default=None, description="how the coefficients were fitted")
    fit_error_pct: dict[str, Number | None] | None = Field(default=None, description="mean absolute error per "
                                                                                     "metric over the fitted levels "
                                                                                     "(%)")
    holdout_error_pct: dict[str, Number | None] | None = Field(default=None, description="the same over the held-out "
                                                                                         "levels (None: none held out)")
    table: list[FitRow] | None = Field(default=None, description="every measured level, measured against simulated")
    warnings: list[str] | None = Field(default=None, description="fitted levels the scenario misses by far")
    limits: list[str] | None = Field(default=None, description="what the profile could not show: a what-if along that "
                                                               "axis extrapolates")
    profiled_input_tokens: Span | None = Field(default=None, description="[least, most] mean prompt tokens of the "
                                                                         "fitted levels")
    profiled_waiting: Span | None = Field(default=None, description="llama.cpp: [least, most] requests waiting for "
                                                                    "a slot over the fitted levels")
    profiled_batch: Span | None = Field(default=None, description="[least, most] sequences in a step over the "
                                                                  "fitted levels")
