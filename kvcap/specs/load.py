"""The load to offer and the requests to send, as one spec for every source: ``bench`` flags, scenario files
(``sim``, ``serve-sim``, ``plan``) and experiment files (``ab``) all validate into these two models, so one key
means one thing with one default everywhere (``workload.LoadPlan.from_spec`` turns a ``LoadSpec`` into a run)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator, model_validator

from kvcap.errors import InputError
from kvcap.specs.fields import Duration, OptionalDuration, Strict
from kvcap.specs.lengths import LengthDist, parse_length

DEFAULT_DURATION_S = 60.0


def _length(v: Any) -> int | str:
    """A fixed token count, or a distribution spec as bench takes it (``uniform:128,256``, ``normal:1024,64``)."""
    dist = parse_length(v, "token length")
    return int(dist.a) if dist.kind == "fixed" else dist.spec


Length = Annotated[int | str, BeforeValidator(_length)]


def _mean(v: int | str) -> int:
    return v if isinstance(v, int) else max(1, round(parse_length(v).mean))


class WorkloadSpec(Strict):
    """Which requests: input/output lengths (fixed or a distribution) and optional shared-prefix groups."""

    input_tokens: Length = 1024
    output_tokens: Length = 256
    prefix_tokens: int = Field(default=0, ge=0)
    """Tokens of a prefix shared by every request of a group (with ``prefix_groups``)."""
    prefix_groups: int = Field(default=0, ge=0)
    """Number of shared-prefix groups requests are spread over (with ``prefix_tokens``)."""

    @model_validator(mode="after")
    def _prefix_pair(self) -> WorkloadSpec:
        if (self.prefix_tokens > 0) != (self.prefix_groups > 0):
            raise InputError("prefix_tokens and prefix_groups go together and must be positive")
        return self

    @property
    def input_mean(self) -> int:
        return _mean(self.input_tokens)

    @property
    def output_mean(self) -> int:
        return _mean(self.output_tokens)

    @property
    def input_dist(self) -> LengthDist:
        return parse_length(self.input_tokens, "workload.input_tokens")

    @property
    def output_dist(self) -> LengthDist:
        return parse_length(self.output_tokens, "workload.output_tokens")


class LoadSpec(Strict):
    """What load: closed-loop levels (``concurrency``) or open-loop rates (``rate`` with an ``arrival`` process),
    warm-up and measured window per level (a duration, a request count, or both), repeats and the seed."""

    concurrency: list[int] | None = None
    rate: list[float] | None = None
    arrival: str = "poisson"
    duration: OptionalDuration = None
    """Measured time per level; unset: 60 s, or none when ``requests`` is given (the count alone ends a level)."""
    requests: int | None = Field(default=None, ge=1)
    warmup: Duration = 10.0
    repeats: int = Field(default=1, ge=1)
    seed: int = 0
    """Seeds prompts, lengths and arrivals (the same seed gives the same requests in both arms)."""
    response_time: Duration | None = None
    """Mean response time assumed by `plan` for Little's law (not a load setting)."""

    @field_validator("concurrency", "rate", mode="before")
    @classmethod
    def _listify(cls, v: Any) -> Any:
        if v is None or isinstance(v, list):
            return v
        if isinstance(v, str):
            return [float(x) if "." in x else int(x) for x in v.replace(" ", "").split(",") if x]
        return [v]

    @field_validator("duration")
    @classmethod
    def _positive(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise InputError("load.duration must be positive")
        return v

    @property
    def measured_duration(self) -> float | None:
        """The measured window per level: as given; unset, none with a request count, else 60 s."""
        if self.duration is not None:
            return self.duration
        return None if self.requests else DEFAULT_DURATION_S
