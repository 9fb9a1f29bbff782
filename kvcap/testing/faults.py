"""Fault injection for the test server: ``--fault KIND:every=K[,offset=J][,after=T]`` rules and what each kind does.

Rules are repeatable and the first match wins; a rule hits generation requests whose arrival index (0-based,
counting valid generation requests) satisfies ``index % K == J``. ``http_500`` / ``http_429`` answer an error
before streaming; at the moment token ``T`` (default 2) is due, ``reset`` aborts the TCP connection (RST),
``stall`` stops sending but keeps the connection open until the client leaves, ``malformed`` sends one event of
invalid JSON and then continues normally, and ``error_in_200`` sends a llama.cpp-style ``{"error": ...}`` event
and ends the response without ``[DONE]``. Non-streaming requests get the same faults (a truncated or
``{"error": ...}`` JSON body for the last two). In batching mode a stalled request keeps its slot until its
tokens would have been done; a reset one (or one whose client left) frees it at the next step start.

Why: a load generator's error accounting is only trustworthy once it has met each way a server can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass

from aiohttp import web

from kvcap.errors import InputError
from kvcap.serve.protocol import error_body

FAULT_KINDS = ("http_500", "http_429", "reset", "stall", "malformed", "error_in_200")
DEFAULT_FAULT_AFTER = 2

MALFORMED_EVENT = b'data: {"choices": [{"text": \n\n'
ERROR_EVENT = (b'data: {"error": {"code": 500, "message": "injected fault: error_in_200 (llama.cpp style)", '
               b'"type": "server_error"}}\n\n')


@dataclass(frozen=True)
class FaultSpec:
    """One ``--fault`` rule: which requests (by arrival index) it hits and when (after how many tokens)."""

    kind: str
    every: int
    offset: int = 0
    after: int = DEFAULT_FAULT_AFTER

    def matches(self, index: int) -> bool:
        return index % self.every == self.offset

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``'reset:every=5,offset=1,after=3'`` → FaultSpec; raises InputError on anything unclear."""
        kind, _, rest = text.partition(":")
        kind = kind.strip()
        if kind not in FAULT_KINDS:
            raise InputError(f"unknown fault kind {kind!r} in {text!r} (use one of {', '.join(FAULT_KINDS)})")
        params: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key not in ("every", "offset", "after"):
                raise InputError(f"bad fault parameter {part!r} in {text!r} (use every=K, offset=J, after=T)")
            try:
                params[key] = int(value)
            except ValueError:
                raise InputError(f"fault parameter {key} must be an integer, got {value!r} in {text!r}") from None
        if "every" not in params:
            raise InputError(f"fault {text!r} needs every=K")
        spec = cls(kind=kind, **params)
        if spec.every < 1 or not 0 <= spec.offset < spec.every or spec.after < 0:
            raise InputError(f"fault {text!r} needs every >= 1, 0 <= offset < every, after >= 0")
        return spec


def abort_with_rst(request: web.Request) -> None:
    """Reset the TCP connection (SO_LINGER 0 makes close send RST, as a crashed server's kernel would)."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def wait_client_gone(request: web.Request, limit_s: float) -> None:
    """For ``stall``: hold the connection open until the client goes away (or ``limit_s`` passes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while loop.time() < deadline:
        t = request.transport
        if t is None or t.is_closing():
            return
        await asyncio.sleep(0.05)


@dataclass(frozen=True)
class InjectedFault:
    """A :class:`FaultSpec` applied to one request (the front end's :class:`kvcap.serve.faults.Fault`)."""

    spec: FaultSpec
    stall_max_s: float

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def after(self) -> int:
        return self.spec.after

    def refusal(self) -> web.StreamResponse | None:
        if self.kind == "http_500":
            return web.json_response(error_body(500, "injected fault: http_500", "InternalServerError"), status=500)
        if self.kind == "http_429":
            return web.json_response(error_body(429, "injected fault: http_429 (too many requests)",
                                                "TooManyRequestsError"), status=429, headers={"Retry-After": "1"})
        return None

    async def _cut(self, request: web.Request) -> bool:
        """``reset`` aborts the connection, ``stall`` holds it silent until the client leaves; True if this fault
        is one of those two (the response is over either way)."""
        if self.kind == "reset":
            abort_with_rst(request)
            return True
        if self.kind == "stall":
            await wait_client_gone(request, self.stall_max_s)
            return True
        return False

    async def strike_stream(self, request: web.Request, resp: web.StreamResponse) -> bool:
        if await self._cut(request):
            return False
        if self.kind == "error_in_200":
            await resp.write(ERROR_EVENT)
            await resp.write_eof()
            return False
        await resp.write(MALFORMED_EVENT)  # malformed: then carry on normally
        return True

    async def strike_whole(self, request: web.Request) -> web.StreamResponse | None:
        if await self._cut(request):
            return None
        body = ERROR_EVENT[6:-2] if self.kind == "error_in_200" else MALFORMED_EVENT[6:-2]
        return web.Response(status=200, body=body, content_type="application/json")


@dataclass(frozen=True)
class FaultRules:
    """The ``--fault`` rules of one server (the front end's :class:`kvcap.serve.faults.FaultPlan`); a stall holds
    its connection at most ``stall_max_s``."""

    rules: tuple[FaultSpec, ...]
    stall_max_s: float = 600.0
    kinds: tuple[str, ...] = FAULT_KINDS

    def fault_for(self, index: int) -> InjectedFault | None:
        for spec in self.rules:
            if spec.matches(index):
                return InjectedFault(spec, self.stall_max_s)
        return None
