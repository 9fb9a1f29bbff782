"""``manifest.json``: the fixed variables (dotted keys, as scenario files spell them), what is under test, where
and when the run ran, the server and the clock. ``bench`` and ``sim`` both write this one shape."""

from __future__ import annotations

import os
import platform
import socket
from typing import Any, Literal

from pydantic import Field

from kvcap import __version__
from kvcap.rundir.model import RunModel


def host_facts() -> dict[str, Any]:
    """Where a run ran (in every manifest)."""
    return {"hostname": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": os.cpu_count()}


class Manifest(RunModel):
    """``manifest.json``."""

    tool: str = Field(default="kvcap", description="the tool that wrote the run")
    tool_version: str = Field(default=__version__, description="its version")
    source: Literal["bench", "sim"] = Field(description="'bench' (a real endpoint) or 'sim' (the simulator)")
    arm: str | None = Field(default=None, description="the arm's name (ab: 'control' or 'treatment'), or None")
    run_id: str = Field(description="the run's id (hex)")
    scenario: str | None = Field(default=None, description="sim: the scenario's name")
    started_at: float = Field(description="when the run started (Unix epoch seconds)")
    host: dict[str, Any] = Field(default_factory=host_facts, description="where it ran: hostname, platform, "
                                                                         "python, cpus")
    server: dict[str, Any] = Field(default_factory=dict, description="the server under test: engine, version, "
                                                                     "models, replicas, KV capacity (sim)...")
    slo: dict[str, float] = Field(default_factory=dict, description="the SLO: latency keys in ms, 'error_rate' "
                                                                    "a fraction")
    fixed: dict[str, Any] = Field(description="the fixed variables, dotted keys as scenario files spell them "
                                              "(values in base units: bytes, bytes/s, seconds)")
    under_test: list[str] = Field(default_factory=list, description="the keys an experiment varies")
    header_names: list[str] | None = Field(default=None,
                                           description="bench: request header names (values, API keys, are "
                                                       "never written)")
    clock: dict[str, Any] | None = Field(default=None,
                                         description="the run's time axis in wall-clock terms (t_s = epoch − "
                                                     "epoch_at_origin), to align Prometheus samples; bench "
                                                     "workers' clock offsets")
    experiment: str | None = Field(default=None, description="the ab experiment this arm belongs to")
    notes: list[str] = Field(default_factory=list, description="precedence decisions taken on the inputs (a file "
                                                               "key an override replaced); absent when none")

    def to_json(self) -> dict[str, Any]:
        """The file's keys in their order: the optional ones only when set (``notes`` only when not empty)."""
        d: dict[str, Any] = {"tool": self.tool, "tool_version": self.tool_version, "source": self.source,
                             "arm": self.arm, "run_id": self.run_id}
        if self.scenario is not None:
            d["scenario"] = self.scenario
        d.update({"started_at": self.started_at, "host": self.host, "server": self.server, "slo": self.slo,
                  "fixed": self.fixed, "under_test": self.under_test})
        for key in ("header_names", "clock", "experiment"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.notes:
            d["notes"] = self.notes
        return d
