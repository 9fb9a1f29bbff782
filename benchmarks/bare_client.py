#!/usr/bin/env python3
"""A minimal streaming client, the yardstick for kvcap's own overhead: stdlib asyncio only.

Closed loop, ``--streams`` users, each with one HTTP/1.1 keep-alive connection (``asyncio.open_connection``),
sending ``POST /v1/completions`` and reading the SSE stream line by line. The clock is read once per line: the
first ``data:`` line that is not ``[DONE]`` ends TTFT, the last content line before ``[DONE]`` ends the decode.
No JSON is parsed (the fake server sends one token per event, so a ``data:`` line is a token); chunked transfer
framing lines are skipped. Latency counts from just before the request is written, like kvcap's closed loop.

It prints (or writes to ``--out``) one JSON object: ``measure_start_s``/``measure_end_s`` (on ``time.time()``),
``ttft_ms`` and ``tpot_ms`` of the requests *started* inside the window, the token times inside the window,
``cpu_s`` over the window (``time.process_time``), ``errors``.

    python benchmarks/bare_client.py --url http://127.0.0.1:PORT --streams 32 --warmup 2 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class Tally:
    """What the users measured; times on perf_counter, converted at the end."""

    measure_start: float
    measure_end: float
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    errors: int = 0


def request_bytes(host: str, port: int, input_words: int, output_tokens: int) -> bytes:
    prompt = " ".join(f"w{i}" for i in range(input_words))
    body = json.dumps({"prompt": prompt, "max_tokens": output_tokens, "stream": True, "ignore_eos": True,
                       "min_tokens": output_tokens, "stream_options": {"include_usage": True},
                       "temperature": 0.0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n")
    return head.encode() + body


async def one_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes,
                      tally: Tally) -> bool:
    """One request on an open connection; False if the connection is no longer usable."""
    t0 = time.perf_counter()
    writer.write(raw)
    status = await reader.readline()
    if not status.startswith(b"HTTP/1.1 200"):
        tally.errors += 1
        return False
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # headers (the fake server always streams chunked)
    first = last = None
    n = 0
    in_window = tally.measure_start <= t0 < tally.measure_end
    while True:
        line = await reader.readline()
        now = time.perf_counter()
        if not line:
            tally.errors += 1
            return False
        if not line.startswith(b"data:"):
            continue
        if line.startswith(b"data: [DONE]"):
            break
        if b'"choices":[]' in line:
            continue  # the usage event: no token
        if first is None:
            first = now
        last = now
        n += 1
        if tally.measure_start <= now <= tally.measure_end:
            tally.token_times.append(now)
    while (await reader.readline()) not in (b"0\r\n", b""):
        pass  # the rest of the chunked body: "\r\n" after the last chunk, then the zero-length chunk
    await reader.readline()
    if in_window and first is not None:
        tally.ttft_ms.append((first - t0) * 1e3)
        if n > 1:
            tally.tpot_ms.append((last - first) * 1e3 / (n - 1))
    return True


async def user(host: str, port: int, raw: bytes, tally: Tally) -> None:
    while time.perf_counter() < tally.measure_end:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        try:
            while time.perf_counter() < tally.measure_end and await one_request(reader, writer, raw, tally):
                pass
        finally:
            writer.close()


async def run(url: str, streams: int, warmup_s: float, duration_s: float, input_words: int,
              output_tokens: int) -> dict:
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    raw = request_bytes(host, port, input_words, output_tokens)
    t0 = time.perf_counter()
    tally = Tally(t0 + warmup_s, t0 + warmup_s + duration_s)
    wall_at = time.time() - time.perf_counter()
    cpu = {}

    async def mark() -> None:
        await asyncio.sleep(max(0.0, tally.measure_start - time.perf_counter()))
        cpu["a"] = time.process_time()
        await asyncio.sleep(max(0.0, tally.measure_end - time.perf_counter()))
        cpu["b"] = time.process_time()

    await asyncio.gather(mark(), *(user(host, port, raw, tally) for _ in range(streams)))
    return {"measure_start_s": tally.measure_start + wall_at, "measure_end_s": tally.measure_end + wall_at,
            "ttft_ms": [round(x, 3) for x in tally.ttft_ms], "tpot_ms": [round(x, 4) for x in tally.tpot_ms],
            "token_times": [round(t + wall_at, 6) for t in tally.token_times], "cpu_s": cpu["b"] - cpu["a"],
            "errors": tally.errors}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--out", default=None, help="write the JSON here instead of to stdout")
    a = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < a.streams + 64 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = asyncio.run(run(a.url, a.streams, a.warmup, a.duration, a.input_tokens, a.output_tokens))
    text = json.dumps(out) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
