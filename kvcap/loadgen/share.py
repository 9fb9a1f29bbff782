"""One worker's inputs and its Runner for one level: shared by every way ``bench`` spreads load (worker processes
on this host, Ray actors over a cluster), so each builds the same prompts and splits a level the same way."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from kvcap.loadgen.lengths import InputLengths
from kvcap.loadgen.runner import Runner, Sink
from kvcap.workload.prompts import PromptFactory, TokenCounter, load_dataset


def make_factory(cfg: Any, counter: TokenCounter, lengths: InputLengths | None = None) -> PromptFactory:
    """The run's prompts: sized by the server's word costs and overhead when ``lengths`` (else ``cfg.lengths``)
    has them, else by ``counter`` (a local tokenizer, or one word one token). ``cfg`` is a BenchConfig."""
    dataset = load_dataset(cfg.dataset) if cfg.dataset else None
    lengths = lengths or cfg.lengths or InputLengths()
    if lengths.costs is not None:
        counter = TokenCounter(costs=lengths.costs)
    return PromptFactory(seed=cfg.plan.seed, input_dist=cfg.input_dist, output_dist=cfg.output_dist,
                         counter=counter, prefix_tokens=cfg.prefix_tokens, prefix_groups=cfg.prefix_groups,
                         prompts_per_group=cfg.prompts_per_group, unique_prefix=cfg.unique_prefix,
                         run_id=cfg.run_id, dataset=dataset,
                         overhead=lengths.overhead, turns=cfg.turns, think_time_s=cfg.think_time_s)


def share_runner(cfg: Any, w: int, level: float, origin: float, sink: Sink, counter: TokenCounter,
                 factory: PromptFactory, stop: asyncio.Event, halt: asyncio.Event,
                 runner_cls: type[Runner] = Runner) -> Runner:
    """Worker ``w``'s Runner for one level of ``cfg.plan`` (its share of ``cfg.workers``), timed from ``origin``
    on this process's own perf_counter."""
    one = replace(cfg.plan, levels=(level,), repeats=1)
    return runner_cls(target=cfg.target, plan=one, factory=factory, sink=sink, counter=counter, worker=w,
                      workers=cfg.workers, origin=origin, stop=stop, keep_texts=cfg.record_text,
                      rule=cfg.error_rule, halt=halt)


def merge_level_infos(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One level line from the workers' lines: the widest window, summed counts, each worker's client stats."""
    first = dict(infos[0])
    first["measure_start_s"] = min(i["measure_start_s"] for i in infos)
    first["measure_end_s"] = max(i["measure_end_s"] for i in infos)
    first["t_start_s"] = min(i["t_start_s"] for i in infos)
    first["t_end_s"] = max(i["t_end_s"] for i in infos)
    first["sent_measured"] = sum(i.get("sent_measured", 0) for i in infos)
    if all(i.get("achieved_rate") is not None for i in infos):
        first["achieved_rate"] = round(sum(i["achieved_rate"] for i in infos), 4)
    first["late_sends"] = sum(i.get("late_sends", 0) for i in infos)
    first["backoff_s"] = round(sum(i.get("backoff_s", 0.0) for i in infos), 3)
    first["stopped"] = next((i["stopped"] for i in infos if i.get("stopped")), None)
    first["workers"] = len(infos)
    first["client"] = {"per_worker": [i["client"] for i in infos],
                       "warnings": sorted({w for i in infos for w in i["client"].get("warnings", [])})}
    first.pop("worker", None)
    first.pop("concurrency_this_worker", None)
    first["interrupted"] = any(i.get("interrupted") for i in infos)
    return first
