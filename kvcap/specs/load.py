"""The load to offer and the requests to send, as one spec for every source: ``bench`` flags, scenario files
(``sim``, ``serve-sim``, ``plan``) and experiment files (``ab``) all validate into these two models, so one key
means one thing with one default everywhere (``workload.LoadPlan.from_spec`` turns a ``LoadSpec`` into a run)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    BeforeValidator,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from kvcap.errors import InputError
from kvcap.specs.fields import Duration, OptionalDuration, Strict, without_defaults
from kvcap.specs.lengths import LengthDist, parse_length

MOONCAKE_BLOCK_TOKENS = 512
"""Prompt tokens per hash id in Mooncake's traces (their ``hash_ids``): the default of
``serving.hash_block_tokens`` and the size of a synthesised prefix block's text."""

DEFAULT_DURATION_S = 60.0
LIMIT_RULE = "a level's measured window ends at whichever limit it reaches first: load.duration or load.requests"
"""The one precedence between the two limits when both are set (the summary states it)."""
COUNTERPARTS = {"requests": "duration", "duration": "requests", "concurrency": "rate", "rate": "concurrency"}
"""Load keys that answer the same question (how long a level lasts; which load model): set on the command line,
one replaces the other from the file, rather than both applying unseen."""


def _length(v: Any) -> int | str:
    """A fixed token count, or a distribution spec as bench takes it (``uniform:128,256``, ``normal:1024,64``)."""
    dist = parse_length(v, "token length")
    return int(dist.a) if dist.kind == "fixed" else dist.spec


Length = Annotated[int | str, BeforeValidator(_length)]


def _mean(v: int | str) -> int:
    return v if isinstance(v, int) else max(1, round(parse_length(v).mean))


WORKLOAD_DEFAULTS: dict[str, Any] = {"prompts_per_group": None, "unique_prefix": True, "turns": 1, "think_time": 0.0}
"""WorkloadSpec keys left out of its serialisation at these values (``specs.fields.without_defaults``)."""


class WorkloadSpec(Strict):
    """Which requests: input/output lengths (fixed or a distribution) and optional shared-prefix groups."""

    input_tokens: Length = 1024
    output_tokens: Length = 256
    prefix_tokens: int = Field(default=0, ge=0)
    """Tokens of a system prompt shared by every request of a group (with ``prefix_groups``); a prompt is this
    prefix followed by ``input_tokens`` of its own (:mod:`kvcap.workload.reuse`)."""
    prefix_groups: int = Field(default=0, ge=0)
    """Number of shared-prefix groups requests are spread over (with ``prefix_tokens``)."""
    prompts_per_group: int | None = Field(default=None, ge=1)
    """Distinct questions per group, sent shuffled and cycled as inference-perf's ``shared_prefix`` does (so a
    whole prompt recurs every ``prefix_groups × prompts_per_group`` requests); unset: every request its own."""
    unique_prefix: bool = True
    """Prompts differ from one level (and repeat) to the next, so no cache carries work across them (``bench``'s
    default). False: the same prompts at every level, sent back to back to one server, as inference-perf's
    stages do — ``bench`` sends them so (``--no-unique-prefix``) and ``sim`` starts each level with the
    prefixes the previous one left cached (:mod:`kvcap.sim.warm`)."""

    turns: int = Field(default=1, ge=1)
    """Turns per multi-turn session (:mod:`kvcap.workload.sessions`): 2 or more makes each user (closed loop) or
    each arrival (open loop) a conversation whose turn ``k`` sends every earlier question and answer plus
    ``input_tokens`` of its own; 1: single requests."""
    think_time: Duration = 0.0
    """Seconds a session's user waits after a turn's last token before sending the next turn."""

    @model_validator(mode="after")
    def _prefix_pair(self) -> WorkloadSpec:
        if (self.prefix_tokens > 0) != (self.prefix_groups > 0):
            raise InputError("prefix_tokens and prefix_groups go together and must be positive")
        if self.prompts_per_group and not self.prefix_groups:
            raise InputError("prompts_per_group needs prefix_tokens and prefix_groups")
        if self.think_time < 0:
            raise InputError("think_time must be 0 or more")
        if self.turns > 1 and self.prompts_per_group:
            raise InputError("prompts_per_group repeats whole prompts; a session's turns never repeat: "
                             "drop one of turns and prompts_per_group")
        if self.turns == 1 and self.think_time:
            raise InputError("think_time is the wait between a session's turns: it needs turns of 2 or more")
        return self

    @model_serializer(mode="wrap")
    def _quiet_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Session, shared-prefix and cache-carrying keys appear (in manifests, A/B fixed variables) only where
        set: a workload that uses none of them serialises as it did before they existed."""
        return without_defaults(handler(self), WORKLOAD_DEFAULTS)

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

    @model_validator(mode="after")
    def _one_load_model(self) -> LoadSpec:
        if self.concurrency and self.rate:
            raise InputError("load.concurrency and load.rate are both set: give one (closed loop or open loop)")
        return self

    @property
    def measured_duration(self) -> float | None:
        """The measured window per level: as given; unset, none with a request count, else 60 s."""
        if self.duration is not None:
            return self.duration
        return None if self.requests else DEFAULT_DURATION_S


def displaced_by_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, str]:
    """The file's load keys that command-line overrides replace (``COUNTERPARTS``), each with a line saying so.

    ``--set load.requests=100000`` on a scenario with ``load.duration: 60s`` means "run 100,000 requests", not
    "whichever comes first"; setting both on the command line (or both in the file) keeps both (``LIMIT_RULE``)."""
    section = data.get("load")
    load: Mapping[str, Any] = section if isinstance(section, Mapping) else {}
    out: dict[str, str] = {}
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        other = COUNTERPARTS.get(name)
        if section != "load" or other is None or value is None or f"load.{other}" in overrides:
            continue
        if load.get(other) is not None:
            out[f"load.{other}"] = (f"load.{other}={load[other]} from the file is replaced by load.{name}={value} "
                                    f"from the command line")
    return out
