"""A deterministic OpenAI-compatible fake LLM server, so client measurements can be checked against known truth.

Run it as ``python -m kvcap.testing.server --port 0 [options]``: it binds 127.0.0.1 (another address only when
``--host`` is given) and prints exactly one line, ``listening on http://HOST:PORT``, once it accepts connections.

The HTTP side is the production front end (:mod:`kvcap.serve`); behind it sits a fixed-timing or a batching
engine (:mod:`kvcap.testing.engines`, which states their timing truths), optionally with injected faults
(:mod:`kvcap.testing.faults`). ``--close-after-response`` says ``Connection: keep-alive`` but closes after every
response (llama.cpp), which breaks clients that reuse pooled connections without retrying.

``--prefix-cache-blocks N [--block-size T]`` gives either engine an exact prefix cache of ``N`` blocks of ``T``
tokens (:mod:`kvcap.testing.prefix_cache`; off by default, so nothing is hashed and no time changes);
``--enable-prompt-tokens-details`` adds a request's cached tokens to its usage, as vLLM's flag of that name does.

One process sustains thousands of concurrent streams: no threads, chunk bytes are pre-serialized per request
(only the token text is spliced in), and the batching engine wakes a stream only when its next chunk is ready.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

from kvcap.errors import InputError
from kvcap.serve.app import Handler, make_app, start_server
from kvcap.serve.engine import AnyEngine
from kvcap.serve.loop import new_event_loop, raise_fd_limit
from kvcap.serve.protocol import TOKENIZERS, ApiConfig
from kvcap.testing.engines import BatchingEngine, FixedTimingEngine
from kvcap.testing.faults import FAULT_KINDS, FaultRules, FaultSpec
from kvcap.testing.prefix_cache import PrefixCache
from kvcap.units import parse_duration


@dataclass(frozen=True)
class ServerConfig:
    """Everything that decides the test server's behaviour; durations in seconds."""

    model_name: str = "fake-model"
    ttft_s: float = 0.050
    itl_s: float = 0.020
    tokens_per_chunk: int = 1
    eos_after: int | None = None
    slots: int | None = None
    step_a_s: float = 0.010
    step_b_s: float = 0.0
    prefill_per_token_s: float = 0.0
    faults: tuple[FaultSpec, ...] = ()
    close_after_response: bool = False
    max_model_len: int = 131072
    stall_max_s: float = 600.0
    tokenizer: str = "words"
    prompt_overhead: int = 0
    tokenize: bool = True
    prefix_cache_blocks: int | None = None
    """Capacity of the prefix cache in blocks; None: no prefix cache."""
    block_size: int = 16
    """Tokens per prefix-cache block (vLLM's default block size)."""
    prompt_tokens_details: bool = False
    """Usage reports cached prompt tokens (vLLM's ``--enable-prompt-tokens-details``)."""

    _PREFIX_KEYS = ("prefix_cache_blocks", "block_size", "prompt_tokens_details")

    @property
    def batching(self) -> bool:
        return self.slots is not None

    @property
    def api(self) -> ApiConfig:
        return ApiConfig(model_name=self.model_name, tokens_per_chunk=self.tokens_per_chunk,
                         eos_after=self.eos_after, max_model_len=self.max_model_len, tokenizer=self.tokenizer,
                         prompt_overhead=self.prompt_overhead, tokenize=self.tokenize)

    def engine(self) -> AnyEngine:
        """A new engine for this config: batching with ``slots``, else fixed timing; with a prefix cache if
        ``prefix_cache_blocks`` is set."""
        cache = (PrefixCache(self.prefix_cache_blocks, self.block_size) if self.prefix_cache_blocks is not None
                 else None)
        if self.slots is not None:
            return BatchingEngine(self.slots, self.step_a_s, self.step_b_s, self.prefill_per_token_s, cache)
        return FixedTimingEngine(self.ttft_s, self.itl_s, cache)

    def as_json(self) -> dict[str, Any]:
        """What /stats reports under ``config``; the prefix-cache keys only when it is on (or usage details
        are), so a server without one reports what it always did."""
        d = asdict(self)
        if self.prefix_cache_blocks is None and not self.prompt_tokens_details:
            for key in self._PREFIX_KEYS:
                del d[key]
        d["faults"] = [asdict(f) for f in self.faults]
        d["mode"] = "batching" if self.batching else "fixed"
        return d


# ------------------------------------------------------------------------------------------ llama.cpp closing

@web.middleware
async def _close_after_response(request: web.Request, handler: Handler) -> web.StreamResponse:
    """llama.cpp behaviour: advertise keep-alive, then close the connection once the response is out."""
    resp = await handler(request)
    if not resp.prepared:
        resp.headers["Connection"] = "keep-alive"
        await resp.prepare(request)
        await resp.write_eof()
    if request.transport is not None:
        request.transport.close()
    return resp


async def _keep_alive_header(request: web.Request, resp: web.StreamResponse) -> None:
    resp.headers["Connection"] = "keep-alive"


def make_test_app(cfg: ServerConfig) -> web.Application:
    """The front end over this config's engine and fault rules."""
    app = make_app(cfg.api, cfg.engine(), FaultRules(cfg.faults, cfg.stall_max_s), cfg.as_json(),
                   middlewares=[_close_after_response] if cfg.close_after_response else [],
                   prompt_tokens_details=cfg.prompt_tokens_details)
    if cfg.close_after_response:
        app.on_response_prepare.append(_keep_alive_header)
    return app


# ------------------------------------------------------------------------------------------------------ CLI

def _duration(text: str) -> float:
    try:
        return parse_duration(text, "duration", bare_unit="s")
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fault(text: str) -> FaultSpec:
    try:
        return FaultSpec.parse(text)
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvcap.testing.server",
                                description="Deterministic OpenAI-compatible fake LLM server with known timing.")
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1; others only when given)")
    p.add_argument("--port", type=int, default=0, help="port (0 = pick a free one)")
    p.add_argument("--model-name", default="fake-model")
    p.add_argument("--ttft", type=_duration, default=0.050, help="fixed mode: time to first token (50ms)")
    p.add_argument("--itl", type=_duration, default=0.020, help="fixed mode: inter-token latency (20ms)")
    p.add_argument("--tokens-per-chunk", type=_positive_int, default=1, help="tokens packed into one SSE event")
    p.add_argument("--eos-after", type=_positive_int, default=None,
                   help="stop after N tokens (finish_reason stop) unless the request sets ignore_eos")
    p.add_argument("--slots", type=_positive_int, default=None, help="batching mode: max running requests")
    p.add_argument("--step-a", type=_duration, default=0.010, help="batching: fixed cost per step")
    p.add_argument("--step-b", type=_duration, default=0.0, help="batching: cost per running request per step")
    p.add_argument("--prefill-per-token", type=_duration, default=0.0,
                   help="batching: extra step cost per prompt token of requests admitted at that step")
    p.add_argument("--fault", type=_fault, action="append", default=[],
                   help="KIND:every=K[,offset=J][,after=T], KIND in " + ", ".join(FAULT_KINDS))
    p.add_argument("--close-after-response", action="store_true",
                   help="say keep-alive but close after each response (llama.cpp)")
    p.add_argument("--max-model-len", type=_positive_int, default=131072)
    p.add_argument("--stall-max", type=_duration, default=600.0, help="longest a stall fault holds a connection")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="words",
                   help="prompt counting: one token per word, or chars4 (a word of n characters is ceil(n/4) tokens)")
    p.add_argument("--prompt-overhead", type=int, default=0,
                   help="tokens added to every prompt's count (as a BOS token or a chat template adds them)")
    p.add_argument("--no-tokenize", action="store_true", help="do not serve POST /tokenize")
    p.add_argument("--prefix-cache-blocks", type=_positive_int, default=None,
                   help="keep an exact prefix cache of N full prompt blocks, LRU (default: no prefix cache)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="tokens per prefix-cache block (16); needs --prefix-cache-blocks")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens when a request found cached tokens")
    return p


def config_from_args(ns: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> ServerConfig:
    if ns.block_size is not None and ns.prefix_cache_blocks is None:
        (parser or build_parser()).error("--block-size needs --prefix-cache-blocks")
    return ServerConfig(model_name=ns.model_name, ttft_s=ns.ttft, itl_s=ns.itl, tokens_per_chunk=ns.tokens_per_chunk,
                        eos_after=ns.eos_after, slots=ns.slots, step_a_s=ns.step_a, step_b_s=ns.step_b,
                        prefill_per_token_s=ns.prefill_per_token, faults=tuple(ns.fault),
                        close_after_response=ns.close_after_response, max_model_len=ns.max_model_len,
                        stall_max_s=ns.stall_max, tokenizer=ns.tokenizer, prompt_overhead=ns.prompt_overhead,
                        tokenize=not ns.no_tokenize, prefix_cache_blocks=ns.prefix_cache_blocks,
                        block_size=ns.block_size if ns.block_size is not None else 16,
                        prompt_tokens_details=ns.enable_prompt_tokens_details)


async def _serve(cfg: ServerConfig, host: str, port: int) -> None:
    srv = await start_server(make_test_app(cfg), host, port)
    print(f"listening on {srv.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await srv.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    cfg = config_from_args(ns, parser)
    host = ns.host if ns.host is not None else "127.0.0.1"
    raise_fd_limit()
    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(cfg, host, ns.port))
    except OSError as exc:
        print(f"error: cannot listen on {host}:{ns.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
