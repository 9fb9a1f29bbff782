"""The seam through which a test server injects faults into the front end's responses.

Why: a load generator must be checked against servers that fail — errors before streaming, connections reset or
stalled mid-stream, broken events. The front end knows only *when* a fault strikes (after ``after`` tokens) and
asks the fault what to do; the kinds themselves live with the test server (``kvcap.testing.faults``).
Production passes no plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from aiohttp import web


class Fault(Protocol):
    """One request's fault."""

    @property
    def kind(self) -> str:
        """The name ``/stats`` counts it under (``faults_injected``)."""
        ...

    @property
    def after(self) -> int:
        """How many tokens the client gets first; it strikes when the next one is due."""
        ...

    def refusal(self) -> web.StreamResponse | None:
        """An error response sent instead of generating, or None to generate and strike later."""
        ...

    async def strike_stream(self, request: web.Request, resp: web.StreamResponse) -> bool:
        """Strike an SSE stream in progress; True if the stream then carries on normally."""
        ...

    async def strike_whole(self, request: web.Request) -> web.StreamResponse | None:
        """Strike a non-streaming request: the broken response, or None when the connection is gone."""
        ...


class FaultPlan(Protocol):
    """Which requests get which fault, by arrival index (0-based, counting valid generation requests)."""

    @property
    def kinds(self) -> Sequence[str]:
        """Every kind it may inject; ``/stats`` counts each from 0."""
        ...

    def fault_for(self, index: int) -> Fault | None: ...
