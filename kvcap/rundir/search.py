"""A ``kvcap search`` directory: ``points.jsonl`` (one line per finished grid point, appended as each finishes)
and ``search.json`` (the grid, the ranking, the recommendation), beside ``points/NAME/`` (each point's run
directory, or only its ``summary.json``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kvcap.rundir.model import Number, RunModel


class PointRow(RunModel):
    """One line of ``points.jsonl``: a point's capacities and best goodput (its ``summary.json``'s), its cost."""

    index: int = Field(description="the point's index in the grid")
    point: dict[str, Any] = Field(description="the grid's values at this point (dotted keys)")
    effective: Number | None = Field(description="effective capacity (summary capacity.effective)")
    resident: int | None = Field(description="resident requests")
    stress_limit: Number | None = Field(description="stress limit")
    goodput_tok_s: float = Field(description="the best level's goodput (tokens/s), as compare reports it")
    goodput_level: Number | None = Field(description="that level")
    limited_by: str | None = Field(description="what limited effective capacity")
    resident_source: str | None = Field(description="where resident came from")
    resident_lower_bound: bool | None = Field(description="resident is a lower bound")
    plan_resident: dict[str, int] | None = Field(description="the plan's resident requests per KV tier")
    failed: bool = Field(description="the point's run failed")
    gpus: int = Field(description="GPUs the point uses")
    cost: float = Field(description="its cost (the --price rule)")
    meets_target: bool = Field(description="it meets every --target")
    run_dir: str = Field(description="its directory, relative to the search directory")


class Effect(RunModel):
    """The best point holding one value of one grid key."""

    value: Any = Field(description="the key's value")
    index: int | None = Field(default=None, description="the best such point's index")
    effective: Number | None = Field(default=None, description="its effective capacity")
    resident: int | None = Field(default=None, description="its resident requests")
    goodput_tok_s: float | None = Field(default=None, description="its best goodput (tokens/s)")


class SearchResult(RunModel):
    """``search.json``."""

    scenario: str = Field(description="the scenario file")
    grid: dict[str, list[Any]] = Field(description="each grid key's values")
    baseline: dict[str, Any] = Field(description="the scenario's own values of the grid keys")
    set: dict[str, Any] = Field(description="the load the points ran (concurrency, rate, duration, repeats)")
    target: list[str] = Field(description="the --target rules")
    target_rule: str = Field(description="the rule applied, in words")
    prices: dict[str, Any] = Field(description="the cost rule: gpu price, added prices, in words")
    points: int = Field(description="grid points")
    finished: int = Field(description="points finished")
    interrupted: bool = Field(description="the search was interrupted")
    executor: str = Field(description="where the points ran")
    wall_s: float = Field(description="wall time (s)")
    points_per_min: float = Field(description="points finished per minute of wall time")
    recommended: list[PointRow] = Field(description="the cheapest points meeting the target")
    pareto: list[PointRow] = Field(description="the points no other beats on both cost and capacity")
    ranked: list[int] = Field(description="point indexes, best first")
    effects: dict[str, list[Effect]] = Field(description="per grid key, the best point at each of its values")
