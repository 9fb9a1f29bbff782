"""A ``summary.json`` model around hand-built levels, for tests of what reads summaries (diagnosis, reports)."""

from __future__ import annotations

from kvcap.rundir.summary import LevelSummary, Summary


def summary_of(*levels: LevelSummary) -> Summary:
    """A simulated run's summary holding ``levels``, with no SLO, limits or capacity figures of its own."""
    return Summary.model_validate({"source": "sim", "arm": None, "slo": {}, "levels": [x.to_json() for x in levels],
                                   "limits": {"duration_s": None, "requests": None, "rule": "", "notes": []},
                                   "capacity": {"slo": {}, "effective": None, "stress_limit": None, "resident": None,
                                                "resident_source": None, "resident_lower_bound": False,
                                                "limited_by": None, "scaling": []}})
