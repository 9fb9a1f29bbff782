"""`kvcap search`: what-if sweeps over a scenario — `grid` (what is asked: grid, target, prices), `run` (every
point as one `kvcap sim`, in local processes or as Ray tasks; the search directory), `pareto` (the answers:
recommendation, Pareto front, ranking, per-knob effects)."""
