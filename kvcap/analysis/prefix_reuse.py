"""Prefix reuse per level: prompt tokens, and the part of them served from the HBM prefix cache or loaded from a
lower KV tier instead of computed — the work a cache tier can save, which is where more memory can pay.

Three sources, in this order: ``sim`` records carry ``prefix_hit_tokens`` and ``tier_hit_tokens`` per request
(summed over every measured request of a level that succeeded, all repeats); a real server's counters
(``server.prefix_cache_*``, ``server.offload_*``, normalised by the telemetry catalog) give their increase over
the level's window; a level without such counters whose ``bench`` records carry the server's own per-request
``cached_tokens`` gets their sum (:func:`cached_figure`: HBM and tier not split). A run with none of these gets
no figure, so its summary stays as it was; :class:`RecordHits` still tells the comparison that its hits were zero.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from kvcap.errors import InputError
from kvcap.rundir import REQUESTS, RunDir, iter_jsonl
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import PrefixReuse
from kvcap.specs.lengths import parse_length

log = logging.getLogger(__name__)

Key = tuple[str, float]
HBM_FIELD, TIER_FIELD, CACHED_FIELD = "prefix_hit_tokens", "tier_hit_tokens", "cached_tokens"
_CARRIED = re.compile(rb'"(?:prefix|tier)_hit_tokens"')
_NONZERO = re.compile(rb'"(?:prefix|tier)_hit_tokens": ?[1-9]')
_CACHED_COUNT = re.compile(rb'"cached_tokens": ?[0-9]')
_SCAN_BYTES = 1 << 20

PROMPT_COUNTERS = ("server.prefix_cache_queries_total", "server.prompt_tokens_total")
"""The prompt tokens a level's window saw, the first counter present deciding (vLLM counts the prefix cache's
queried tokens; every engine its prompt tokens)."""
HBM_COUNTERS = ("server.prefix_cache_hits_total",)
TIER_HIT_COUNTERS = ("server.offload_prefix_hits_total", "server.offload_hit_tokens_total",
                     "server.offload_matched_tokens_total")
"""Tokens served by an offload connector: vLLM's external prefix cache, LMCache's hit tokens, KVBM's matched
tokens — the first present deciding."""
TIER_QUERY_COUNTERS = ("server.offload_prefix_queries_total", "server.offload_requested_tokens_total")
TIER_PRESENCE = (*TIER_HIT_COUNTERS, *TIER_QUERY_COUNTERS, "server.offload_blocks_d2h_total",
                 "server.onboard_blocks_h2d_total")
"""Any of these series in a run's telemetry: the server has an offload connector (a tier is on)."""
COUNTERS = tuple(dict.fromkeys((*PROMPT_COUNTERS, *HBM_COUNTERS, *TIER_HIT_COUNTERS, *TIER_QUERY_COUNTERS,
                                *TIER_PRESENCE)))
"""Every counter the figure reads (``telemetry_figures`` takes each one's increase per window at its edges)."""


@dataclass
class RecordHits:
    """What a run's records say about hits: ``carried`` — some record has the hit fields; ``levels`` — per level
    the figure, filled only when some record hit (a run whose hits are all zero costs a scan, not a parse);
    ``cached`` — per level the figure from the server's ``cached_tokens``, read only when first asked for."""

    carried: bool = False
    levels: dict[Key, PrefixReuse] = field(default_factory=dict)
    path: Path | None = None
    counts_cached: bool | None = None
    """Some record carries a ``cached_tokens`` count (None: not looked for)."""

    @property
    def known_zero(self) -> bool:
        """The records carry hit counts and every one is zero."""
        return self.carried and not self.levels

    @cached_property
    def cached(self) -> dict[Key, PrefixReuse]:
        """Per level, the figure from the records' ``cached_tokens`` (:func:`cached_figure`); {} when no record
        carries a count (a byte search: nothing parsed)."""
        if self.path is None or self.counts_cached is False:
            return {}
        return record_cached(self.path, searched=self.counts_cached is True)


def record_hits(run: RunDir) -> RecordHits:
    """The records' hit counts per level (see :class:`RecordHits`)."""
    path = run.dir / REQUESTS
    carried, hit, counts_cached = _scan(path)
    out = RecordHits(carried=carried, path=path, counts_cached=counts_cached)
    if not hit:
        return out
    sums: dict[Key, list[int]] = {}
    for rec in iter_jsonl(path):
        if not isinstance(rec, dict) or HBM_FIELD not in rec or not rec.get("ok"):
            continue
        if rec.get("phase", "measure") != "measure":
            continue
        key = (str(rec.get("mode", "concurrency")), float(rec.get("level", 0)))
        acc = sums.setdefault(key, [0, 0, 0])
        acc[0] += int(rec.get("input_tokens") or 0)
        acc[1] += int(rec.get(HBM_FIELD) or 0)
        acc[2] += int(rec.get(TIER_FIELD) or 0)
    out.levels = {key: figure("records", prompt, hbm, tier) for key, (prompt, hbm, tier) in sums.items()}
    return out


def record_cached(path: Path, searched: bool = False) -> dict[Key, PrefixReuse]:
    """Per level, the prompt tokens and the server's own ``cached_tokens`` summed over every measured request that
    succeeded (all repeats); {} when no record carries a count (``searched``: one is known to). In a run where
    some record carries one, a record whose count is None counts 0: vLLM leaves the count out of a request that
    found nothing."""
    if not searched and not _scan(path, hits=False)[2]:
        return {}
    sums: dict[Key, list[int]] = {}
    for rec in iter_jsonl(path):
        if not isinstance(rec, dict) or not rec.get("ok") or rec.get("phase", "measure") != "measure":
            continue
        key = (str(rec.get("mode", "concurrency")), float(rec.get("level", 0)))
        acc = sums.setdefault(key, [0, 0])
        acc[0] += int(rec.get("input_tokens") or 0)
        acc[1] += int(rec.get(CACHED_FIELD) or 0)
    return {key: cached_figure(prompt, cached) for key, (prompt, cached) in sums.items()}


def cached_figure(prompt: float, cached: float) -> PrefixReuse:
    """A level's figure from the server's per-request ``cached_tokens``: the server does not say which cache
    served them, so the total goes in ``hbm_hit_tokens`` (the prefix cache it looks up first) and again in
    ``server_cached_tokens``, which marks the split as unknown; ``tier_hit_tokens`` stays None."""
    reuse = figure("records", prompt, cached, None)
    reuse.server_cached_tokens = _number(cached)
    return reuse


def records_hit_nothing(run: RunDir) -> bool:
    """The run's records carry hit counts and every one is zero (a byte search: nothing parsed)."""
    carried, hit, _ = _scan(run.dir / REQUESTS)
    return carried and not hit


def _scan(path: Path, hits: bool = True) -> tuple[bool, bool, bool | None]:
    """(some record carries hit fields, some hit field is nonzero, some record carries a ``cached_tokens`` count),
    by a byte search: no record parsed. The search stops at the first nonzero hit, the cached count then unknown
    unless seen (None); ``hits`` False looks for the cached count alone."""
    carried = cached = False
    try:
        with open(path, "rb") as f:
            tail = b""
            while block := f.read(_SCAN_BYTES):
                text = tail + block
                if not cached:
                    cached = bool(_CACHED_COUNT.search(text))
                if not hits:
                    if cached:
                        break
                elif _NONZERO.search(text):
                    return True, True, cached or None
                else:
                    carried = carried or bool(_CARRIED.search(text))
                tail = text[-40:]  # a field split across two blocks is found in the next
    except FileNotFoundError:
        log.debug("no %s in the run directory: no record hits", REQUESTS)
    return carried, False, cached


def figure(source: str, prompt: float, hbm: float | None, tier: float | None,
           tier_queries: float | None = None) -> PrefixReuse:
    """A level's figure, the hit rates as fractions of the prompt tokens (None without any)."""
    def rate(x: float | None) -> float | None:
        return round(x / prompt, 4) if x is not None and prompt > 0 else None

    data: dict[str, object] = {"source": source, "prompt_tokens": _number(prompt), "hbm_hit_tokens": _number(hbm),
                               "tier_hit_tokens": _number(tier)}
    if tier_queries is not None:
        data["tier_query_tokens"] = _number(tier_queries)
    data["hbm_hit_rate"], data["tier_hit_rate"] = rate(hbm), rate(tier)
    return PrefixReuse.model_validate(data)


def from_counters(increase: dict[str, float]) -> PrefixReuse | None:
    """A level's figure from its counters' increase over the window (``{series: increase}``, present series
    only); None without any prefix or tier counter."""
    def first(names: tuple[str, ...]) -> float | None:
        return next((increase[n] for n in names if n in increase), None)

    hbm, tier, queries = first(HBM_COUNTERS), first(TIER_HIT_COUNTERS), first(TIER_QUERY_COUNTERS)
    connector = any(increase.get(n, 0.0) > 0 for n in TIER_PRESENCE)
    if not connector:
        # vLLM publishes its external-cache counters, at zero, with no connector: only a connector that was
        # asked (or that moved blocks) is a tier
        tier, queries = None, None
    if hbm is None and tier is None and queries is None:
        return None
    if tier is None and connector:
        tier = 0.0  # a connector that reports blocks but not tokens: no token counted as a hit
    return figure("telemetry", first(PROMPT_COUNTERS) or 0.0, hbm, tier, queries)


def _number(x: float | None) -> float | int | None:
    if x is None:
        return None
    return int(x) if float(x).is_integer() else round(float(x), 3)


def hit_share(reuse: PrefixReuse | None) -> float | None:
    """The share of a level's prompt tokens served from any cache (HBM and tier); None without the figure."""
    if reuse is None or not reuse.prompt_tokens:
        return None
    return ((reuse.hbm_hit_tokens or 0) + (reuse.tier_hit_tokens or 0)) / reuse.prompt_tokens


def shares_prefixes(manifest: Manifest | None) -> bool:
    """The workload declares prompts that share prefixes: shared-prefix groups, sessions (each turn resends the
    history), or a trace (whose ``hash_ids`` say which blocks repeat)."""
    fixed = manifest.fixed if manifest is not None else {}
    groups, turns = fixed.get("workload.prefix_groups") or 0, fixed.get("workload.turns") or 1
    return ((isinstance(groups, (int, float)) and groups > 0) or (isinstance(turns, int) and turns > 1)
            or fixed.get("load.mode") == "trace")


def reusable_share(manifest: Manifest | None) -> float | None:
    """The share of a workload's prompt tokens a cache big enough for all of them serves (past each group's or
    session's first request): a shared-prefix group's system prompt; for sessions of T turns, turn k's resent
    earlier prompt — the prefix and the k − 1 earlier turns but the last answer (a planned answer is not what
    the server cached). None for other workloads."""
    fixed = manifest.fixed if manifest is not None else {}
    prefix, groups = fixed.get("workload.prefix_tokens") or 0, fixed.get("workload.prefix_groups") or 0
    turns, spec = fixed.get("workload.turns") or 1, fixed.get("workload.input_tokens")
    grouped = isinstance(prefix, int) and isinstance(groups, int) and prefix > 0 and groups > 0
    sessions = isinstance(turns, int) and turns > 1
    if not (grouped or sessions) or spec is None:
        return None
    try:
        own = parse_length(spec).mean
        answer = parse_length(fixed.get("workload.output_tokens") or 0).mean if sessions else 0.0
    except InputError:
        return None
    prefix = prefix if grouped else 0
    if sessions:
        prompts = [prefix + (k - 1) * (own + answer) + own for k in range(1, turns + 1)]
        reused = [prefix + max(0.0, (k - 2) * (own + answer) + own) if k > 1 else prefix for k in range(1, turns + 1)]
        return sum(reused) / sum(prompts)
    total = prefix + own if "workload.prompt" in fixed else max(own, prefix)  # older runs cut the prefix inside
    return prefix / total if total > 0 else None


def users_think(manifest: Manifest | None) -> bool:
    """Session workloads whose users pause between turns (``workload.think_time`` > 0)."""
    think = (manifest.fixed if manifest is not None else {}).get("workload.think_time")
    return isinstance(think, (int, float)) and think > 0


def tier_on(manifest: Manifest | None) -> bool:
    """The run's scenario turns a KV tier on (``serving.kv_offload`` set and not 'none')."""
    offload = (manifest.fixed if manifest is not None else {}).get("serving.kv_offload")
    return offload not in (None, "none", False)
