"""The OpenAI-compatible HTTP/SSE front end that any token engine can sit behind.

Why: ``kvcap serve-sim`` (the simulator in real time) and the deterministic test server (``kvcap.testing``)
must look exactly like a vLLM server to a client, so both share this one front end and differ only in the
:class:`~kvcap.serve.engine.Engine` behind it.

Modules: :mod:`~kvcap.serve.protocol` (request validation, SSE frames, usage, error bodies),
:mod:`~kvcap.serve.engine` (the Engine protocol), :mod:`~kvcap.serve.generation` (one request's run),
:mod:`~kvcap.serve.faults` (the fault-injection seam), :mod:`~kvcap.serve.state` (shared state and /stats),
:mod:`~kvcap.serve.metrics` (counters and /metrics text), :mod:`~kvcap.serve.app` (routes and startup),
:mod:`~kvcap.serve.loop` (precise timers and event-loop helpers).

Imports allowed: aiohttp, the standard library, :mod:`kvcap.units`, :mod:`kvcap.errors`, :mod:`kvcap.aio`,
kvcap's version and :mod:`kvcap.workload.blocks` (standard library only: an engine with a prefix cache is fed the
same block hashes the load generator and the simulator compute) — never ``kvcap.sim``, ``kvcap.loadgen``,
``kvcap.testing`` or ``kvcap.cli``.
"""
