"""What an engine admits at most, read from a run's manifest: its running limit (vLLM ``max_num_seqs``, llama.cpp
slots, SGLang ``max_running_requests``) and its KV pool in blocks — what the diagnosis needs to tell a batch cap
from a full KV cache at block granularity instead of at a usage threshold.

Sources, the server's own word first: the server's facts at preflight (``server.total_slots``,
``server.max_running_requests``, ``server.num_gpu_blocks`` / ``server.block_size`` from
``vllm:cache_config_info``), then the server command where the manifest records one (``server.command``, fixed or
in ``server``: ``--max-num-seqs``, ``--parallel``/``-np``, ``--slots``, ``--max-running-requests``,
``--num-gpu-blocks-override``, ``--block-size``), then the scenario's keys (``serving.max_num_seqs``,
``serving.block_size``, the simulator's ``server.kv_blocks_per_replica``). A limit is per replica; the endpoint's
is that times its replicas (the simulator's ``server.replicas``, vLLM's data-parallel ``kv_engines``), since the
telemetry sums running requests over replicas.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from typing import Any

from kvcap.rundir.manifest import Manifest
from kvcap.specs.scenario import VLLM_NULL_BLOCKS

log = logging.getLogger(__name__)

RUNNING_FLAGS = ("--max-num-seqs", "--parallel", "-np", "--slots", "--max-running-requests")
"""Server-command flags that set how many requests run at once (vLLM, llama.cpp, the test server, SGLang)."""
POOL_FLAG = "--num-gpu-blocks-override"
BLOCK_FLAG = "--block-size"


@dataclass(frozen=True)
class EngineLimits:
    """An endpoint's admission limits; None where the manifest does not say."""

    max_running: int | None = None
    """Requests that may run at once, over every replica."""
    running_source: str | None = None
    """Where ``max_running`` came from, in words."""
    pool_blocks: int | None = None
    """KV blocks per replica (the pool the next request is placed in)."""
    block_size: int | None = None
    """Tokens per KV block."""
    pool_source: str | None = None
    replicas: int = 1
    """Replicas (or data-parallel engines) the running count and the KV usage figure are taken over."""

    @property
    def pool_known(self) -> bool:
        return self.pool_blocks is not None and self.block_size is not None


def _positive(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 1 else None


def command_flags(command: str | None) -> dict[str, int]:
    """The integer flags of a server command line that bear on admission ({} when it has none or cannot be
    split)."""
    if not command:
        return {}
    try:
        words = shlex.split(command)
    except ValueError as exc:  # an unbalanced quote: the command says nothing usable
        log.debug("server command not split (%s): %r", exc, command)
        return {}
    out: dict[str, int] = {}
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        if flag not in (*RUNNING_FLAGS, POOL_FLAG, BLOCK_FLAG):
            continue
        if not value and i + 1 < len(words):
            value = words[i + 1]
        if value.isdigit() and int(value) > 0:
            out[flag] = int(value)
    return out


def engine_limits(manifest: Manifest | None) -> EngineLimits:
    """The limits the manifest states (see the module docstring for the order of sources)."""
    if manifest is None:
        return EngineLimits()
    server, fixed = manifest.server, manifest.fixed
    replicas = _positive(server.get("replicas")) or _positive(server.get("kv_engines")) or 1
    flags = command_flags(str(fixed.get("server.command") or server.get("command") or "") or None)
    running, running_source = None, None
    for value, source in ((_positive(server.get("total_slots")), "the server's /props total_slots"),
                          (_positive(server.get("max_running_requests")), "the server's max_running_requests"),
                          *((flags.get(f), f"the server command's {f}") for f in RUNNING_FLAGS),
                          (_positive(fixed.get("serving.max_num_seqs")), "serving.max_num_seqs")):
        if value is not None:
            running, running_source = value, source
            break
    blocks, size, pool_source = None, None, None
    if _positive(server.get("num_gpu_blocks")) and _positive(server.get("block_size")):
        blocks, size = _positive(server.get("num_gpu_blocks")), _positive(server.get("block_size"))
        blocks = blocks - VLLM_NULL_BLOCKS if blocks is not None else None
        pool_source = "vllm:cache_config_info (less its null block)"
    elif POOL_FLAG in flags:
        blocks = flags[POOL_FLAG] - VLLM_NULL_BLOCKS
        size = flags.get(BLOCK_FLAG) or _positive(fixed.get("serving.block_size"))
        pool_source = f"the server command's {POOL_FLAG}"
    elif _positive(server.get("kv_blocks_per_replica")) and _positive(fixed.get("serving.block_size")):
        blocks, size = _positive(server.get("kv_blocks_per_replica")), _positive(fixed.get("serving.block_size"))
        pool_source = "the simulated pool"
    if size is None:
        blocks = None
    return EngineLimits(max_running=running * replicas if running is not None else None,
                        running_source=running_source, pool_blocks=blocks, block_size=size,
                        pool_source=pool_source if blocks is not None else None, replicas=replicas)
