"""``kvcap ab``: run a same-caliber A/B from one experiment file, with interleaved repeats (A B A B …) so drift on
the machine falls on both arms alike, then compare and report.

An arm is an endpoint URL, or a server command kvcap starts, health-checks and stops around each of its repeats.
Everything but the arm's ``vary`` values is shared: the load plan, the workload, the decoding parameters, the SLO.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvcap import procs
from kvcap.analysis.slo import parse_slo
from kvcap.errors import EndpointError, InputError
from kvcap.loadgen.bench import BenchConfig, run_bench
from kvcap.loadgen.client import Target
from kvcap.loadgen.runner import Progress
from kvcap.rundir import MANIFEST, write_json_atomic
from kvcap.specs.fields import validate, validation_message
from kvcap.specs.load import LoadSpec, WorkloadSpec
from kvcap.specs.scenario import read_yaml
from kvcap.units import parse_duration
from kvcap.workload.loadplan import LoadPlan


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


class ManagedServer:
    """An arm's server command run in its own process group, up once its health URL answers 200."""

    def __init__(self, arm: ArmSpec, log: Path):
        self.arm = arm
        self.log = log
        self.process: procs.Process | None = None

    def __enter__(self) -> ManagedServer:
        assert self.arm.command
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.process = procs.start(shlex.split(self.arm.command), name=f"arm {self.arm.name}", log=self.log,
                                   append=True, grace_s=20.0)
        url = self.arm.url.rstrip("/").removesuffix("/v1") + self.arm.health
        try:
            self.process.wait_for_http(url, self.arm.start_timeout, interval_s=0.2)
        except procs.StartError as exc:
            if exc.returncode is not None:
                raise InputError(f"arm {self.arm.name}: server command exited with {exc.returncode} "
                                 f"(log: {self.log})") from None
            raise InputError(f"arm {self.arm.name}: {url} not healthy after {self.arm.start_timeout:g} s "
                             f"(log: {self.log})") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.stop()


def _bench_config(exp: Experiment, arm: ArmSpec, out: Path, repeat: int, origin: float) -> BenchConfig:
    """One repeat of one arm as a bench run (``ab`` runs repeats one at a time, alternating arms)."""
    timeout = parse_duration(exp.timeout, "timeout")
    plan = LoadPlan.from_spec(exp.load, repeats=1, first_repeat=repeat, drain_timeout_s=timeout)
    target = Target(url=arm.url, api=exp.api, model=exp.model, timeout_s=timeout)
    metrics = [arm.url.rstrip("/").removesuffix("/v1") + "/metrics"] if exp.metrics else []
    fixed = {**exp.fixed, **arm.vary}
    wl = exp.workload
    return BenchConfig(target=target, plan=plan, out=out, input_dist=wl.input_dist, output_dist=wl.output_dist,
                       prefix_tokens=wl.prefix_tokens, prefix_groups=wl.prefix_groups, metrics_urls=metrics,
                       slo=parse_slo(exp.slo), arm=arm.name, fixed=fixed,
                       under_test=sorted({*exp.arms[0].vary, *exp.arms[1].vary}),
                       append=repeat > 0, overwrite=repeat == 0, origin=origin, prometheus=exp.prometheus)


async def run_experiment(exp: Experiment, out: Path, progress: Progress | None = None,
                         stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Interleaved repeats, then the comparison (``compare.json``) — the report is written by the caller."""
    from kvcap.analysis.verdict import compare

    out.mkdir(parents=True, exist_ok=True)
    origin = time.perf_counter()
    order: list[dict[str, Any]] = []
    for repeat in range(exp.load.repeats):
        for arm in exp.arms:
            if stop is not None and stop.is_set():
                break
            cfg = _bench_config(exp, arm, out / arm.name, repeat, origin)
            t0 = time.time()
            if arm.command:
                with ManagedServer(arm, out / f"{arm.name}.server.log"):
                    summary = await run_bench(cfg, progress, stop)
            else:
                summary = await run_bench(cfg, progress, stop)
            order.append({"arm": arm.name, "repeat": repeat, "started_at": t0, "ended_at": time.time()})
            if summary.get("failed"):  # a broken arm makes no comparison: stop here, its records kept
                raise EndpointError(f"arm {arm.name}, repeat {repeat}: {summary['failed']}")
    for arm in exp.arms:
        mpath = out / arm.name / MANIFEST
        if mpath.exists():
            m = json.loads(mpath.read_text())
            m["fixed"]["load.repeats"] = exp.load.repeats
            m["experiment"] = exp.name
            write_json_atomic(mpath, m)
    result = compare(str(out / exp.arms[0].name), str(out / exp.arms[1].name), slo=parse_slo(exp.slo))
    result["schedule"] = order
    write_json_atomic(out / "compare.json", {k: v for k, v in result.items() if k != "summaries"})
    return result


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


def run_sim_experiment(exp: SimExperiment, out: Path, overrides: dict[str, Any] | None = None,
                       progress: Any = None) -> dict[str, Any]:
    """Both arms through the simulator (each from an empty cluster, so interleaving has nothing to cancel),
    then the comparison (``compare.json``)."""
    from kvcap.analysis.verdict import compare
    from kvcap.sim.run import SimConfig, run_sim
    from kvcap.specs.scenario import load_scenario_noting

    out.mkdir(parents=True, exist_ok=True)
    under_test = sorted({*exp.arms[0].set, *exp.arms[1].set})
    shared = {**exp.set, **(overrides or {})}
    scenarios = {arm.name: load_scenario_noting(exp.scenario, {**shared, **arm.set}) for arm in exp.arms}
    slo = parse_slo(scenarios[exp.arms[0].name][0].slo)
    for arm in exp.arms:
        sc, notes = scenarios[arm.name]
        cfg = SimConfig(scenario=sc, plan=LoadPlan.from_spec(sc.load), out=out / arm.name, slo=slo, arm=arm.name,
                        under_test=under_test, overwrite=True, notes=notes)
        run_sim(cfg, progress=(lambda info, name=arm.name: progress(name, info)) if progress else None)
    result = compare(str(out / exp.arms[0].name), str(out / exp.arms[1].name), slo=slo)
    write_json_atomic(out / "compare.json", {k: v for k, v in result.items() if k != "summaries"})
    return result


def packaged_scenario(name: str) -> Path:
    """A scenario or experiment file shipped inside the package (``kvcap/scenarios/``)."""
    from importlib import resources

    path = Path(str(resources.files("kvcap") / "scenarios" / name))
    if not path.is_file():
        raise InputError(f"packaged scenario {name!r} not found")
    return path
