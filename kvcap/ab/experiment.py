"""``kvcap ab`` experiment files: two arms and what they share, validated once.

A real experiment's arm is an endpoint URL, or a server command kvcap starts, health-checks and stops around
each of its repeats; everything but the arm's ``vary`` values is shared: the load plan, the workload, the
decoding parameters, the SLO. A simulated experiment (``scenario:``) is two arms of one scenario file, each
changing some of its keys (``set``). Running them is ``real`` and ``simulated``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcap.errors import InputError
from kvcap.specs.fields import validate, validation_message
from kvcap.specs.load import LoadSpec, WorkloadSpec
from kvcap.specs.scenario import read_yaml


def two_arms(arms: list[Any]) -> list[Any]:
    """An experiment compares exactly two arms, control first, with different names."""
    if len(arms) != 2 or arms[0].name == arms[1].name:
        raise ValueError("an experiment has exactly two arms with different names (control first)")
    return arms


class ArmSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    url: str
    command: str | None = None
    """Started before each of the arm's repeats (in its own process group) and stopped after it."""
    health: str = "/health"
    start_timeout: float = 300.0
    vary: dict[str, Any] = Field(default_factory=dict)


class Experiment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "ab"
    api: str = "completions"
    model: str | None = None
    timeout: str | float = "120s"
    fixed: dict[str, Any] = Field(default_factory=dict)
    arms: list[ArmSpec]
    load: LoadSpec
    workload: WorkloadSpec = WorkloadSpec()
    slo: dict[str, str] = Field(default_factory=dict)
    metrics: bool = True
    """Sample each arm's ``/metrics`` (server telemetry makes ``resident`` exact)."""
    prometheus: str | None = None
    """Prometheus base URL: each arm's repeats also get what it scraped (DCGM, node exporter, engines)."""

    @field_validator("arms")
    @classmethod
    def _two_arms(cls, v: list[ArmSpec]) -> list[ArmSpec]:
        return two_arms(v)

    @field_validator("slo", mode="before")
    @classmethod
    def _slo(cls, v: Any) -> Any:
        return {str(k): str(x) for k, x in (v or {}).items()}


def load_experiment(path: str) -> Experiment:
    exp = validate(Experiment, read_yaml(path, "experiment"), path)
    if bool(exp.load.concurrency) == bool(exp.load.rate):
        raise InputError(f"{path}: load needs exactly one of concurrency or rate")
    return exp


# ---------------------------------------------------------------- simulated A/B (``scenario:`` experiments, demo)


class SimArm(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    set: dict[str, Any] = Field(default_factory=dict)
    """Scenario keys this arm changes (the variables under test), e.g. ``{serving.kv_offload: remote}``."""


class SimExperiment(BaseModel):
    """Two arms of one scenario file, simulated; every key but the arms' ``set`` values is shared."""

    model_config = ConfigDict(extra="forbid")
    name: str = "ab"
    description: str = ""
    scenario: str
    """Scenario YAML, relative to the experiment file."""
    set: dict[str, Any] = Field(default_factory=dict)
    """Overrides applied to both arms."""
    arms: list[SimArm]

    @field_validator("arms")
    @classmethod
    def _two_arms(cls, v: list[SimArm]) -> list[SimArm]:
        return two_arms(v)


def load_any_experiment(path: str) -> Experiment | SimExperiment:
    """A bench experiment (arms with URLs) or a simulated one (``scenario:`` + arms with ``set``)."""
    data = read_yaml(path, "experiment")
    if "scenario" not in data:
        return load_experiment(path)
    try:
        exp = SimExperiment.model_validate(data)
    except ValidationError as exc:
        raise InputError(validation_message(exc, path)) from None
    scenario = Path(exp.scenario)
    if not scenario.is_absolute():
        scenario = Path(path).parent / scenario
    return exp.model_copy(update={"scenario": str(scenario)})


def packaged_scenario(name: str) -> Path:
    """A scenario or experiment file shipped inside the package (``kvcap/scenarios/``)."""
    from importlib import resources

    path = Path(str(resources.files("kvcap") / "scenarios" / name))
    if not path.is_file():
        raise InputError(f"packaged scenario {name!r} not found")
    return path
