"""Peers with known behaviour, for tests and benchmarks only: the deterministic OpenAI-compatible test server.

Why: a client's measurements can only be trusted once they match a server whose timing is known exactly.
:mod:`~kvcap.testing.engines` holds the fixed-timing and batching engines (their timing truths),
:mod:`~kvcap.testing.truth` the closed-form truths of the batching engine, :mod:`~kvcap.testing.prefix_cache`
their optional exact prefix cache, :mod:`~kvcap.testing.faults` the injected faults, and
:mod:`~kvcap.testing.server` the config and the CLI (``python -m kvcap.testing.server``) that puts them behind the
production front end.

Imports allowed: :mod:`kvcap.serve` plus what it may import (aiohttp, the standard library, :mod:`kvcap.units`,
:mod:`kvcap.errors`, :mod:`kvcap.aio`, kvcap's version). Production code — anything in kvcap outside this
package — must never import it.
"""
