"""``kvcap ab`` in the simulator (``scenario:`` experiments, ``kvcap demo``): both arms simulated, then the
comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcap.ab.experiment import SimExperiment
from kvcap.analysis.slo import parse_slo
from kvcap.rundir import write_json_atomic
from kvcap.rundir.compare import Comparison
from kvcap.workload.loadplan import LoadPlan


def run_sim_experiment(exp: SimExperiment, out: Path, overrides: dict[str, Any] | None = None,
                       progress: Any = None) -> Comparison:
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
    write_json_atomic(out / "compare.json", result.to_json())
    return result
