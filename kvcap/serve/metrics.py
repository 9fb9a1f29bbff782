"""What the front end counts, and the Prometheus text exposition of ``/metrics``.

Why: clients (``kvcap bench --metrics-url``, Prometheus) read the engine's load from vLLM-named series; this
module turns metric families — gauges, and counters with optional ``*_created`` companions — into that text,
whichever engine supplied them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class RequestCounters:
    """The front end's counters behind ``/stats`` (and the test engines' ``/metrics``); mutated only on the loop.

    ``requests_started`` counts valid generation requests (each takes an arrival index); ``requests_finished``
    those that reached their normal end; ``requests_aborted`` the rest (faults, clients that left);
    ``requests_rejected`` 4xx validation failures (no index). ``connections_opened`` counts every accepted TCP
    connection; ``faults_injected`` is per kind (the kinds a fault plan may inject, each from 0)."""

    requests_started: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_rejected: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0
    connections_opened: int = 0
    faults_injected: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Gauge:
    """One gauge series; ``labels`` as a counter's ``extra`` (``'key="value",'``), for info gauges such as vLLM's
    ``cache_config_info`` whose facts are in the labels and whose value is 1."""

    name: str
    help: str
    value: float
    labels: str = ""


@dataclass(frozen=True)
class Counter:
    """A counter family ``{name}_total``: one series per ``(extra labels, value)``; ``extra`` is either empty or
    ``'key="value",'``. With ``created`` (Unix seconds) each series gets a ``{name}_created`` gauge too.
    ``suffix`` "": the series are named ``{name}`` itself, as exporters that predate the suffix name theirs (Dynamo's
    KVBM)."""

    name: str
    help: str
    series: Sequence[tuple[str, float]]
    created: float | None = None
    suffix: str = "_total"


MetricFamily = Gauge | Counter


def render_metrics(families: Sequence[MetricFamily], model_name: str) -> str:
    """Prometheus text exposition, every series labelled with ``model_name`` as vLLM does."""
    label = f'model_name="{model_name}"'
    out: list[str] = []
    described: set[str] = set()
    for fam in families:
        if isinstance(fam, Gauge):
            if fam.name not in described:  # several series of one family (labels) share one HELP and TYPE
                described.add(fam.name)
                out.extend((f"# HELP {fam.name} {fam.help}", f"# TYPE {fam.name} gauge"))
            out.append(f"{fam.name}{{{fam.labels}{label}}} {float(fam.value)!r}")
            continue
        total = fam.name + fam.suffix
        out.extend((f"# HELP {total} {fam.help}", f"# TYPE {total} counter"))
        out.extend(f"{total}{{{extra}{label}}} {float(v)!r}" for extra, v in fam.series)
        if fam.created is not None:
            out.extend((f"# HELP {fam.name}_created {fam.help}", f"# TYPE {fam.name}_created gauge"))
            out.extend(f"{fam.name}_created{{{extra}{label}}} {fam.created!r}" for extra, _ in fam.series)
    return "\n".join(out) + "\n"
