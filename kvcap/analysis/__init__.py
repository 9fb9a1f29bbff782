"""From records to judgement: the article's method, applied the same way to every source of numbers.

A run directory from ``bench`` or ``sim`` holds what happened (its records read into per-level numpy columns by
`kvcap.rundir.store`); this package decides what it means — per-level statistics and goodput (`stats`), server
telemetry aligned with the level windows (`telemetry`), the SLO (`slo`), the three conditions and the effective /
resident / stress-limit capacities (`capacity`), the ``summary.json`` of one run (`summary`), what bounds it and
which way to scale (`diagnosis`), and the A/B verdict with its noise (`verdict`). A table someone publishes is
judged by the same rules in `kvcap.audit`, a layer above.

Judgement must not depend on how the numbers were produced, so this package may import only kvcap.rundir,
kvcap.plan, kvcap.specs, kvcap.units and kvcap.errors — never kvcap.loadgen, kvcap.sim, kvcap.report,
kvcap.cli or kvcap.ab.
"""
