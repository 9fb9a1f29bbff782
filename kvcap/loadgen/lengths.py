"""Prompt lengths as the server counts them: before the run, learn how the server tokenizes the prompt words and
what it adds to every prompt, build the prompts to that count, and check it on a sample of the run's own prompts.

Why: N words are not N tokens to a real tokenizer (it splits many words into several), so
``workload.input_tokens`` was the client's guess, and two arms behind different tokenizers were of
the same caliber on paper only. Records count by ``usage.prompt_tokens``; this makes the prompts match it.

How the server is asked — the first way that answers, each counting what the generation endpoint would (special
tokens and the chat template included):

* ``POST /tokenize`` in vLLM's (and SGLang's) shape: ``{"model", "prompt" | "messages"}`` → ``count``/``tokens``;
* ``POST /tokenize`` in llama.cpp's: ``{"content", "add_special"}`` → ``tokens`` (chat: ``/apply-template`` first);
* a ``max_tokens=1`` request of the run's own shape, reading ``usage.prompt_tokens``.

Each prompt word's cost comes from group tests (a group of words costs its size iff each is one token; otherwise it
is halved), so a tokenizer that keeps common words whole costs a handful of calls. The overhead is the median of
(server count − built count) over a sample of the run's prompts; the prompts are then rebuilt to the target minus
it and counted again: that second sample's error is what the manifest reports. With a local ``--tokenizer`` the
prompts keep being built by it, and the server still checks them.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from kvcap.loadgen.client import Outcome, Target, request_body, stream_request
from kvcap.loadgen.preflight import server_base
from kvcap.workload.loadplan import LoadPlan
from kvcap.workload.prompts import LEAD, PromptFactory, RequestSpec
from kvcap.workload.words import WORDS

SAMPLE = 8
"""Prompts of the run counted by the server to set the overhead, and as many again to check the result."""
WARN_ERROR_PCT = 2.0
"""A check sample this far (mean, %) from the asked lengths is reported on stderr before the run."""
TOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=5)
PROBES_AT_ONCE = 4
"""Concurrent ``max_tokens=1`` probes, where the server has no /tokenize."""

log = logging.getLogger(__name__)

Count = Callable[[RequestSpec], Awaitable[int | None]]
"""The server's ``usage.prompt_tokens`` for a request, or None when it cannot tell."""


@dataclass
class InputLengths:
    """How this run sizes its prompts; it travels in the BenchConfig to worker processes."""

    costs: tuple[int, ...] | None = None
    """Server tokens of each word of :data:`WORDS` inside a prompt; None: a local tokenizer or one word one token."""
    overhead: int = 0
    """Tokens the server adds to every prompt (BOS, chat template, the lead word's start-of-text form)."""
    report: dict[str, Any] = field(default_factory=dict)
    """For the manifest: how the lengths were counted and the error on the check sample."""

    @property
    def measured_mean(self) -> float | None:
        return self.report.get("measured_mean")


def sample_requests(factory: PromptFactory, plan: LoadPlan, n: int = SAMPLE) -> list[RequestSpec]:
    """The run's first ``n`` prompts (trace rows in a replay), under a nonce of their own (level and repeat −1)."""
    if plan.mode == "trace":
        return [factory.trace_request(k, r.input_tokens, r.output_tokens, r.hash_ids, level=-1, repeat=-1)
                for k, r in enumerate(plan.trace[:n])]
    return [factory.request(i, level=-1, repeat=-1) for i in range(n)]


def _words_request(words: Sequence[str]) -> RequestSpec:
    return RequestSpec(index=-1, prompt=" ".join((LEAD, *words)), input_tokens=0, output_tokens=1)


async def word_costs(count: Count, words: Sequence[str] = WORDS) -> tuple[int, ...] | None:
    """Each word's server tokens after the lead word (costs there are what the prompts see), by halving groups that
    cost more than their size; None if the server stopped answering."""
    base = await count(_words_request(()))
    if base is None:
        return None
    costs = [1] * len(words)
    groups = [list(range(len(words)))]
    while groups:
        totals = await asyncio.gather(*(count(_words_request([words[i] for i in g])) for g in groups))
        split: list[list[int]] = []
        for g, total in zip(groups, totals, strict=True):
            if total is None:
                return None
            extra = total - base
            if extra == len(g):
                continue  # every word of the group is one token
            if len(g) == 1:
                costs[g[0]] = max(1, extra)
            else:
                split += [g[: len(g) // 2], g[len(g) // 2:]]
        groups = split
    return tuple(costs)


def check_report(targets: Sequence[int], counted: Sequence[int]) -> dict[str, Any]:
    """The check sample's figures: asked and server-counted means, mean error (%) and the largest miss (tokens)."""
    asked, got = statistics.fmean(targets), statistics.fmean(counted)
    return {"sample": len(targets), "asked_mean": round(asked, 2), "measured_mean": round(got, 2),
            "mean_error_pct": round(100 * (got / asked - 1), 2) if asked else None,
            "max_abs_error_tokens": max(abs(c - t) for c, t in zip(counted, targets, strict=True))}


async def calibrate(target: Target, server: dict[str, Any], build: Callable[[InputLengths], PromptFactory],
                    plan: LoadPlan, local_tokenizer: bool) -> InputLengths:
    """Learn how the server counts, size the prompts by it and check them; never fails the run (a server that
    cannot tell gives the unchecked word rule, said so in the report)."""
    counter = "tokenizer" if local_tokenizer else "server"
    async with ServerCounts(target) as ask:
        method, count = await ask.find(prefer_llamacpp=server.get("engine") == "llama.cpp")
        if count is None:
            return InputLengths(report={"method": None, "counter": "tokenizer" if local_tokenizer else "words",
                                        "checked": False})
        costs = None if local_tokenizer else await word_costs(count)
        if costs is None and not local_tokenizer:
            return InputLengths(report={"method": method, "counter": "words", "checked": False,
                                        "note": "the server stopped answering while its word costs were measured"})
        lengths = InputLengths(costs=costs)
        factory = build(lengths)
        first = sample_requests(factory, plan)
        counted = await asyncio.gather(*(count(r) for r in first))
        if any(c is None for c in counted):
            return replace(lengths, report={"method": method, "counter": counter, "checked": False})
        fitted = factory.dataset is None  # a dataset's prompts are sent as they are: counted, not sized
        if fitted:  # what the server adds to every prompt, then the prompts rebuilt without it and counted again
            lengths.overhead = round(statistics.median(c - r.input_tokens for c, r in zip(counted, first)))
            first = sample_requests(build(lengths), plan)
            counted = await asyncio.gather(*(count(r) for r in first))
    if any(c is None for c in counted):
        return replace(lengths, report={"method": method, "counter": counter, "checked": False})
    lengths.report = {"method": method, "counter": counter, "checked": True, "overhead_tokens": lengths.overhead,
                      **check_report([r.input_tokens for r in first], [int(c) for c in counted if c is not None])}
    if costs:
        lengths.report["multi_token_words"] = sum(1 for c in costs if c > 1)
    err = lengths.report["mean_error_pct"]
    if fitted and err is not None and abs(err) > WARN_ERROR_PCT:
        print(f"kvcap bench: warning: the server counts this run's prompts as {lengths.report['measured_mean']:g} "
              f"tokens on average, {err:+.1f}% from the asked {lengths.report['asked_mean']:g} ({method})",
              file=sys.stderr)
    return lengths


class ServerCounts:
    """Small sessions of its own for the calibration's questions: one connection for /tokenize, a few for real
    probes (kept apart from the run's pool, so what the run's connections show stays the run's)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.base = server_base(target.url)
        self.session: aiohttp.ClientSession | None = None
        self.probes: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> ServerCounts:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), headers=self.target.headers,
                                             timeout=TOKENIZE_TIMEOUT)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for s in (self.session, self.probes):
            if s is not None:
                await s.close()

    async def find(self, prefer_llamacpp: bool) -> tuple[str | None, Count | None]:
        """The first way of counting that gives a plausible count for the lead word."""
        ways: list[tuple[str, Count]] = [("tokenize", self.vllm_tokenize), ("tokenize:llama.cpp", self.llama_tokenize)]
        if prefer_llamacpp:
            ways.reverse()
        ways.append(("usage", self.usage))
        for name, count in ways:
            n = await count(_words_request(()))
            if n is not None and n >= 1:
                return name, count
        return None, None

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        assert self.session is not None
        try:
            async with self.session.post(self.base + path, json=body) as r:
                if r.status != 200:  # no such endpoint here: the next way of counting is tried
                    log.debug("%s%s answered HTTP %s: not this way of counting", self.base, path, r.status)
                    return None
                return await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # as for a refusal: the next way
            log.debug("%s%s did not count: %s: %s", self.base, path, type(exc).__name__, exc)
            return None

    def _input(self, req: RequestSpec) -> tuple[str | None, list[dict[str, Any]] | None]:
        """The prompt or the chat messages exactly as the run's requests carry them."""
        body = request_body(self.target, req)
        return body.get("prompt"), body.get("messages")

    async def vllm_tokenize(self, req: RequestSpec) -> int | None:
        prompt, messages = self._input(req)
        body: dict[str, Any] = ({"messages": messages, "add_generation_prompt": True} if messages is not None
                                else {"prompt": prompt, "add_special_tokens": True})
        if self.target.model:
            body["model"] = self.target.model
        data = await self._post("/tokenize", body)
        if not isinstance(data, dict):
            return None
        if isinstance(data.get("count"), int):
            return data["count"]
        return len(data["tokens"]) if isinstance(data.get("tokens"), list) else None

    async def llama_tokenize(self, req: RequestSpec) -> int | None:
        prompt, messages = self._input(req)
        parse_special = False
        if messages is not None:
            templated = await self._post("/apply-template", {"messages": messages})
            if not isinstance(templated, dict) or not isinstance(templated.get("prompt"), str):
                return None
            prompt, parse_special = templated["prompt"], True
        data = await self._post("/tokenize", {"content": prompt, "add_special": True, "parse_special": parse_special})
        if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
            return None
        return len(data["tokens"])

    async def usage(self, req: RequestSpec) -> int | None:
        """A real ``max_tokens=1`` request: what the run's records will say (costs one prefill)."""
        if self.probes is None:
            self.probes = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=PROBES_AT_ONCE),
                                                timeout=aiohttp.ClientTimeout(total=None))
        o = Outcome(t_sched=0.0)
        await stream_request(self.probes, self.target, replace(req, output_tokens=1), o, time.perf_counter)
        n = (o.usage or {}).get("prompt_tokens")
        return int(n) if isinstance(n, int) and o.error is None else None
