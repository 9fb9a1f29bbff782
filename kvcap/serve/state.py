"""One app's shared state — API config, engine, fault plan, counters — and the ``/stats`` body built from it.

Why: the handlers of one server share exactly this; keeping it apart from the routes lets the per-request
runner (:mod:`kvcap.serve.generation`) and the app (:mod:`kvcap.serve.app`) both use it without importing each
other.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from kvcap.serve.engine import AnyEngine, PrefixCachingEngine
from kvcap.serve.faults import FaultPlan
from kvcap.serve.loop import TIMERS
from kvcap.serve.metrics import RequestCounters
from kvcap.serve.protocol import ApiConfig


class ServerState:
    """Config, counters, engine and fault plan, shared by all handlers of one app.

    ``config`` is what ``/stats`` reports under ``config`` (default: the API config). ``prefix_block_tokens``
    is the engine's cache block size when it keeps a prefix cache (prompts are then hashed), else None;
    ``prompt_tokens_details``: report a request's cached tokens in its usage, as vLLM's
    ``--enable-prompt-tokens-details`` does."""

    def __init__(self, api: ApiConfig, engine: AnyEngine, faults: FaultPlan | None = None,
                 config: Mapping[str, Any] | None = None, prompt_tokens_details: bool = False) -> None:
        self.api = api
        self.engine = engine
        self.prefix_block_tokens = (engine.prefix_block_tokens if isinstance(engine, PrefixCachingEngine)
                                    else None)
        self.prompt_tokens_details = prompt_tokens_details
        self.faults = faults
        self.config = dict(config) if config is not None else asdict(api)
        self.counters = RequestCounters(faults_injected=dict.fromkeys(faults.kinds, 0) if faults else {})
        self.next_index = 0
        self.started_wall = time.time()

    def snapshot(self) -> dict[str, Any]:
        """The /stats body: the front end's counters (see :class:`RequestCounters`); ``running``/``waiting`` now
        and ``max_*`` high-water marks, from the engine; ``engine_steps``/``engine_resyncs`` (None for an engine
        without steps); ``timer`` says how late timed sends woke (the timing truths hold only while
        ``late_over_5ms`` stays 0); ``config``."""
        s, load = self.counters, self.engine.load()
        return {
            "requests_started": s.requests_started, "requests_finished": s.requests_finished,
            "requests_aborted": s.requests_aborted, "requests_rejected": s.requests_rejected,
            "finished_by_reason": dict(s.finished_by_reason),
            "prompt_tokens_total": s.prompt_tokens_total, "completion_tokens_total": s.completion_tokens_total,
            "running": load.running, "waiting": load.waiting, "max_running": load.max_running,
            "max_waiting": load.max_waiting, "connections_opened": s.connections_opened,
            "faults_injected": dict(s.faults_injected), "engine_steps": load.steps, "engine_resyncs": load.resyncs,
            "timer": TIMERS.as_dict(), "config": self.config,
        }
