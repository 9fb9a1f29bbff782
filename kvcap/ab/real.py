"""``kvcap ab`` on real endpoints: interleaved repeats (A B A B …) so drift on the machine falls on both arms
alike, each arm's server command started and stopped around its repeats, then the comparison.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from pathlib import Path

from kvcap import procs
from kvcap.ab.experiment import ArmSpec, Experiment
from kvcap.analysis.slo import parse_slo
from kvcap.errors import EndpointError, InputError
from kvcap.loadgen.bench import BenchConfig, run_bench
from kvcap.loadgen.client import Target
from kvcap.loadgen.runner import Progress
from kvcap.rundir import MANIFEST, write_json_atomic
from kvcap.rundir.compare import Comparison, ScheduledRepeat
from kvcap.units import parse_duration
from kvcap.workload.loadplan import LoadPlan


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
                       prefix_tokens=wl.prefix_tokens, prefix_groups=wl.prefix_groups,
                       prompts_per_group=wl.prompts_per_group, unique_prefix=wl.unique_prefix, metrics_urls=metrics,
                       slo=parse_slo(exp.slo), arm=arm.name, fixed=fixed,
                       under_test=sorted({*exp.arms[0].vary, *exp.arms[1].vary}),
                       append=repeat > 0, overwrite=repeat == 0, origin=origin, prometheus=exp.prometheus)


async def run_experiment(exp: Experiment, out: Path, progress: Progress | None = None,
                         stop: asyncio.Event | None = None) -> Comparison:
    """Interleaved repeats, then the comparison (``compare.json``) — the report is written by the caller."""
    from kvcap.analysis.verdict import compare

    out.mkdir(parents=True, exist_ok=True)
    origin = time.perf_counter()
    order: list[ScheduledRepeat] = []
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
            order.append(ScheduledRepeat(arm=arm.name, repeat=repeat, started_at=t0, ended_at=time.time()))
            if summary.failed:  # a broken arm makes no comparison: stop here, its records kept
                raise EndpointError(f"arm {arm.name}, repeat {repeat}: {summary.failed}")
    for arm in exp.arms:
        mpath = out / arm.name / MANIFEST
        if mpath.exists():
            m = json.loads(mpath.read_text())
            m["fixed"]["load.repeats"] = exp.load.repeats
            m["experiment"] = exp.name
            write_json_atomic(mpath, m)
    result = compare(str(out / exp.arms[0].name), str(out / exp.arms[1].name), slo=parse_slo(exp.slo))
    result.schedule = order
    write_json_atomic(out / "compare.json", result.to_json())
    return result
