"""What bounds an arm, and which way to scale — the article's rules of thumb, each backed by the numbers shown.

- prefill recompute (checked first: recomputing fills both the queue and the batch): requests queue — the server
  has ``QUEUED_WAITING`` or more waiting on average, or TTFT p50 exceeds 2·TTFT₀ + 5·TPOT₀ of the lowest level —
  at a level whose cached share (prompt tokens served from the HBM prefix cache or a lower tier, over its prompt
  tokens: ``LevelSummary.prefix_reuse``) falls short of the reuse the workload holds. Short means: reuse was seen
  (a lower level's cached share at least ``REUSE_SHARE``) and this level's share is at most ``SHORT_FRACTION`` of
  that peak; or the workload declares shared prefixes (prefix groups, a trace) and the share is under
  ``DECLARED_SHORT``, or, where the workload says how much of each prompt is its group's prefix (shared-prefix
  groups), under ``SHORT_FRACTION`` of that share. The reused part of prompts is computed again: a prefix tier
  that holds it can help.
- batch cap: requests queue while the requests running sit at the engine's limit with KV room left — the limit
  the manifest states (:mod:`kvcap.analysis.engine_limits`: max_num_seqs, slots), else inferred where running
  stays flat from the level below while requests wait and the next request fits in the KV pool. The scheduler's
  cap, not memory or compute, bounds the level: raise it where KV room and TPOT allow. With a stated limit
  reached the cap is named even where a usage figure says the cache is full (a usage figure cannot tell which
  stopped admission; the pool's blocks can, and then both are named).
- KV capacity at block granularity: requests wait and the next one's prompt blocks (less those its prefix finds
  cached) do not fit in the free blocks — the pool's size and block size from the manifest, the used blocks from
  the KV usage figure. Without the pool's size: the KV cache ``KV_FULL`` or more full while requests wait, or
  requests parked in a lower tier (the engine's own sign that HBM ran short).
- KV capacity: requests queue (server waiting > 0, or TTFT jumps) while the per-token time stays flat → the
  GPU had compute to spare; more KV memory (VRAM, host or remote offload) is likely to help.
- Queueing is the server's waiting count where the server reports one (``QUEUED_WAITING`` on average); only
  without it, the client's TTFT jump.
- compute: the per-token time grows with the batch while nothing queues → "GPU busy, VRAM to spare": more
  memory won't help; add compute (GPUs/replicas), quantize, or cap the batch.
- KV capacity with no prefix reuse (cached share under ``REUSE_SHARE`` at every level and none declared): decode KV
  binds and a tier saves no prefill — it can only park requests that only HBM can decode.
- interconnect: a link near its capacity → remote KV access is the limit; faster links or hotter local data.
- client: the load generator lagged or could not keep the offered concurrency → fix the client first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcap.analysis.engine_limits import EngineLimits
from kvcap.analysis.prefix_reuse import hit_share
from kvcap.rundir.summary import Finding, Imbalance, LevelSummary

TPOT_FLAT = 1.15
TPOT_GROWS = 1.30
QUEUED_WAITING = 0.5
"""Requests waiting at the server, on average, from which a level counts as queueing."""
REUSE_SHARE = 0.2
"""Cached share of prompt tokens (HBM prefix hits + tier hits) from which a level shows prefix reuse."""
SHORT_FRACTION = 0.5
"""A queueing level whose cached share is at most this fraction of a lower level's peak recomputes reused prefixes."""
DECLARED_SHORT = 0.25
"""With shared prefixes declared by the workload, a queueing level's cached share under this is recompute."""
PARK_ONLY = ("decode KV capacity bounds it — a tier can only park: no prompt reuses a prefix, so an offload tier "
             "saves no prefill; it holds waiting or parked requests that only HBM can decode. More KV room in HBM "
             "(fp8 KV cache, a GQA model, bigger or more GPUs) raises stable concurrency")
RECOMPUTE = ("prefill recompute bounds this level — a prefix tier can help: the reused part of prompts is computed "
             "again; a KV tier (host, remote or shared storage) big enough for the reused prefixes, or prefix-aware "
             "routing, serves them instead, where loading them is faster than computing them")


def _p(lv: LevelSummary, metric: str, q: str = "p50") -> float | None:
    value: float | None = getattr(getattr(lv, f"{metric}_ms"), q)
    return value


def diagnose(summary_levels: list[LevelSummary], arm: str = "run", shared_prefixes: bool = False,
             reusable: float | None = None, thinks: bool = False,
             limits: EngineLimits | None = None) -> list[Finding]:
    """Findings (arm, bound, evidence, direction) for one run's summary levels (bench or sim alike);
    ``shared_prefixes``: the workload declares prompts that share prefixes (``prefix_reuse.shares_prefixes``);
    ``reusable``: the share of prompt tokens that is a shared prefix, where known (``prefix_reuse.reusable_share``);
    ``thinks``: users pause between turns (sessions with a think time), so fewer requests in flight than users is
    the workload, not a lagging client; ``limits``: the engine's running limit and KV pool, where the manifest
    states them (``engine_limits.engine_limits``)."""
    limits = limits or EngineLimits()
    levels = sorted([lv for lv in summary_levels if (lv.ok or 0) > 0], key=lambda x: x.level)
    out: list[Finding] = []
    if len(levels) < 2:
        return _imbalance(levels, arm) + _link(levels, arm)
    warn = sorted({w for lv in levels for w in lv.client_warnings})
    lagging = [(lv, law) for lv in levels if not thinks and (law := lv.littles_law) is not None
               and law.ratio_to_concurrency is not None and law.ratio_to_concurrency < 0.85]
    if warn or lagging:
        ev = "; ".join(warn) if warn else (
            f"in flight {lagging[0][1].in_flight:.1f} at {_at(lagging[0][0])} "
            f"(ratio {lagging[0][1].ratio_to_concurrency:.2f})")
        out.append(Finding(arm=arm, bound="client", evidence=ev,
                           direction="the load generator limited the run: use --workers or a bigger client host "
                                     "before judging the server"))
    first, last = levels[0], levels[-1]
    tp0, tp1 = _p(first, "tpot"), _p(last, "tpot")
    tt0, tt1 = _p(first, "ttft"), _p(last, "ttft")
    waiting = [lv for lv in levels if (lv.server_waiting_mean or 0) >= QUEUED_WAITING]
    reported = any(lv.server_waiting_mean is not None for lv in levels)
    queued = waiting if reported else [lv for lv in levels
                                       if tt0 and (tt := _p(lv, "ttft")) and tt > 2 * tt0 + 5 * (tp0 or 0)]
    recompute = _recompute(levels, queued, waiting, shared_prefixes, arm, reusable)
    if recompute is not None:
        out.append(recompute)
        return out + _link(levels, arm) + _imbalance(levels, arm)
    no_reuse = _no_reuse(levels, shared_prefixes)
    capped = _batch_cap(levels, waiting, limits)
    if capped:
        for finding in capped:
            finding.arm = arm
            if finding.bound == "kv_capacity" and no_reuse:
                finding.direction = PARK_ONLY
        return out + capped + _link(levels, arm) + _imbalance(levels, arm)
    full = _kv_full(levels, limits)
    if full is not None:
        if no_reuse:
            full.direction = PARK_ONLY
        full.arm = arm
        out.append(full)
        out += _link(levels, arm)
        out += _imbalance(levels, arm)
        return out
    if tp0 and tp1:
        growth = tp1 / tp0
        if queued and growth <= TPOT_FLAT:
            q = queued[0]
            src = (f"server waiting {q.server_waiting_mean or 0:.1f} on average" if q in waiting
                   else f"TTFT p50 {_p(q, 'ttft') or 0:.0f} ms vs {tt0:.0f} ms at {_at(first)}")
            out.append(Finding(arm=arm, bound="kv_capacity",
                               evidence=f"from {_at(q)} requests queue ({src}) while TPOT p50 stays "
                                        f"{tp0:.1f} → {tp1:.1f} ms (×{growth:.2f}) from {_at(first)} to "
                                        f"{_at(last)}",
                               direction=PARK_ONLY if no_reuse else
                               "compute has headroom and requests wait for KV room: more KV memory "
                               "(VRAM, host or remote offload) is likely to raise stable concurrency, if "
                               "the link to it keeps up"))
        elif growth >= TPOT_GROWS:
            running = [lv.server_running_max for lv in levels]
            ev = (f"TPOT p50 grows {tp0:.1f} → {tp1:.1f} ms (×{growth:.2f}) from {_at(first)} to "
                  f"{_at(last)}")
            if all(r is not None for r in running):
                ev += f" with {running[-1]:.0f} requests running"
            if tt0 and tt1:
                ev += f"; TTFT p50 {tt0:.0f} → {tt1:.0f} ms"
            util = last.gpu_util_mean
            if util is not None:
                ev += f"; GPU utilisation {util:.0%}"
                if last.kv_usage_max is not None and last.kv_usage_max < KV_FULL:
                    ev += f" with the KV cache {last.kv_usage_max:.0%} full"
            out.append(Finding(arm=arm, bound="compute", evidence=ev,
                               direction="the GPU is the limit, not memory: more memory won't raise stable "
                                         "concurrency; add compute (GPUs/replicas), quantize, or cap the batch"))
    out += _link(levels, arm)
    out += _imbalance(levels, arm)
    if not out:
        out.append(Finding(arm=arm, bound="none_seen",
                           evidence=f"TPOT p50 {tp0} → {tp1} ms, no queueing seen up to {_at(last)}",
                           direction="no bottleneck reached: extend the sweep to higher load"))
    return out


KV_FULL = 0.9
"""KV usage (of HBM blocks) at which the cache counts as full."""


def _recompute(levels: list[LevelSummary], queued: list[LevelSummary], waiting: list[LevelSummary],
               shared_prefixes: bool, arm: str, reusable: float | None = None) -> Finding | None:
    """The prefill-recompute bound (the module's rule): the first queueing level whose cached share falls short."""
    shares = [hit_share(lv.prefix_reuse) for lv in levels]
    for q in queued:
        i = levels.index(q)
        share = shares[i]
        if share is None:
            continue
        below = [(s, lv) for s, lv in zip(shares[:i], levels[:i]) if s is not None]
        peak, at_peak = max(below, key=lambda x: x[0]) if below else (None, None)
        src = (f"server waiting {q.server_waiting_mean or 0:.1f} on average" if q in waiting
               else f"TTFT p50 {_p(q, 'ttft') or 0:.0f} ms vs {_p(levels[0], 'ttft') or 0:.0f} ms at "
                    f"{_at(levels[0])}")
        cached = _cached(q)
        if peak is not None and at_peak is not None and peak >= REUSE_SHARE and share <= SHORT_FRACTION * peak:
            ev = (f"from {_at(q)} requests queue ({src}) while the prompt tokens served from a cache fall from "
                  f"{peak:.0%} at {_at(at_peak)} to {share:.0%} ({cached})")
        elif reusable is not None and share < SHORT_FRACTION * reusable:
            ev = (f"from {_at(q)} requests queue ({src}) while {reusable:.0%} of each prompt is its group's shared "
                  f"prefix and only {share:.0%} of prompt tokens are served from a cache ({cached})")
        elif shared_prefixes and share < DECLARED_SHORT:
            ev = (f"from {_at(q)} requests queue ({src}) while the workload shares prefixes and only {share:.0%} of "
                  f"prompt tokens are served from a cache ({cached})")
        else:
            continue
        return Finding(arm=arm, bound="prefill_recompute", evidence=ev, direction=RECOMPUTE)
    return None


def _cached(lv: LevelSummary) -> str:
    """A level's cached share by where it came from: '41% HBM, 3% tier' (the tier only where reported)."""
    r = lv.prefix_reuse
    if r is None:
        return ""
    if r.server_cached_tokens is not None:  # the server's per-request count: HBM and tier together
        return f"{r.hbm_hit_rate or 0:.0%} cached (the server's count) of {r.prompt_tokens:,.0f} prompt tokens"
    parts = [f"{r.hbm_hit_rate or 0:.0%} HBM prefix cache"]
    if r.tier_hit_tokens is not None:
        parts.append(f"{r.tier_hit_rate or 0:.0%} tier")
    return ", ".join(parts) + f" of {r.prompt_tokens:,.0f} prompt tokens"


def _no_reuse(levels: list[LevelSummary], shared_prefixes: bool) -> bool:
    """The levels carry prefix-reuse figures and none shows reuse, and the workload declares none: a tier on this
    run could only park."""
    shares = [s for lv in levels if (s := hit_share(lv.prefix_reuse)) is not None]
    return bool(shares) and max(shares) < REUSE_SHARE and not shared_prefixes


@dataclass(frozen=True)
class KvRoom:
    """Whether the next waiting request fits in a level's KV cache at its fullest, and the numbers that say so."""

    fits: bool | None
    """None: the level has no KV usage figure (or nothing to size one request by)."""
    text: str = ""
    blocks: bool = False
    """Decided on the pool's blocks (the manifest's pool size and block size), not estimated from the usage."""


def kv_room(lv: LevelSummary, limits: EngineLimits) -> KvRoom:
    """At block granularity where the pool is known: the blocks in use at the level's highest KV usage (per
    replica: the usage figure is their mean) against the next request's prompt blocks, less the share of prompt
    tokens the level found cached. Without the pool: one more request of the running ones' average share fits in
    what is free."""
    usage = lv.kv_usage_max
    if usage is None:
        return KvRoom(None)
    blocks, size = limits.pool_blocks, limits.block_size
    if blocks is not None and size is not None and lv.input_tokens_mean:
        used = min(blocks, round(usage * blocks))
        free = blocks - used
        r = lv.prefix_reuse
        cached = (r.hbm_hit_rate or 0.0) if r is not None else 0.0
        prompt = lv.input_tokens_mean * (1.0 - cached)
        need = max(1, math.ceil(prompt / size))
        per = " per replica" if limits.replicas > 1 else ""
        what = "uncached prompt tokens" if cached else "prompt tokens"
        return KvRoom(need <= free, f"{used:,} of {blocks:,} blocks of {size} tokens{per} in use at most "
                                    f"({usage:.0%}); the next request's {prompt:,.0f} {what} need {need} "
                                    f"block{'s' if need != 1 else ''}, {free:,} {'is' if free == 1 else 'are'} "
                                    "free", blocks=True)
    running = lv.server_running_max
    if not running:
        return KvRoom(None)
    share = usage / (running / limits.replicas)
    return KvRoom(1.0 - usage >= share, f"the KV cache {usage:.0%} full at most with {running:.0f} running: one "
                                        f"more takes about {share:.0%}")


CAP_DIRECTION = ("the engine's batch cap binds, not memory or compute: requests wait for a running slot; raise the "
                 "cap (vLLM --max-num-seqs, llama.cpp --parallel, SGLang --max-running-requests) as far as KV room "
                 "and the TPOT SLO allow — more memory or compute won't raise stable concurrency until then")
KV_DIRECTION = ("VRAM for KV binds while compute has headroom: more KV room in HBM (fp8 KV cache, a GQA model, "
                "bigger or more GPUs) raises stable concurrency; an offload tier holds waiting requests but cannot "
                "decode them, so it helps only where it saves prefill (reused prefixes)")


def _batch_cap(levels: list[LevelSummary], waiting: list[LevelSummary], limits: EngineLimits) -> list[Finding]:
    """The batch/slot cap at the first waiting level where it binds (the module's rule), and with it the KV
    capacity finding where the pool's blocks show the next request would not fit either; [] where none."""
    for q in waiting:
        running = q.server_running_max
        if running is None or running < 1:
            continue
        i = levels.index(q)
        room = kv_room(q, limits)
        if limits.max_running is not None:
            if running < limits.max_running:
                continue
            limit = f"the engine's limit ({limits.max_running} from {limits.running_source})"
        else:
            below = levels[i - 1] if i else None
            if below is None or below.server_running_max is None or running > below.server_running_max \
                    or room.fits is not True:
                continue
            limit = f"flat from {_at(below)}: the engine's limit, inferred"
        onset = next(lv for lv in levels if (lv.server_running_max or 0) >= running)
        ev = (f"from {_at(q)} requests queue (server waiting {q.server_waiting_mean or 0:.1f} on average) while "
              f"{running:.0f} run at once, {limit}")
        if room.fits is True:
            ev += f", with KV room left ({room.text})"
        tp_a, tp_b, tp0 = _p(onset, "tpot"), _p(q, "tpot"), _p(levels[0], "tpot")
        if tp_a and tp_b and onset is not q:
            ev += f"; TPOT p50 {tp_a:.1f} → {tp_b:.1f} ms from {_at(onset)} to {_at(q)} with the batch held at the cap"
        if tp0 and tp_a and onset is not levels[0] and tp_a / tp0 >= TPOT_GROWS:
            ev += (f"; TPOT p50 grew {tp0:.1f} → {tp_a:.1f} ms (×{tp_a / tp0:.2f}) from {_at(levels[0])} to "
                   f"{_at(onset)} as the batch grew: a higher cap costs TPOT")
        out = [Finding.model_validate({"bound": "batch_cap", "evidence": ev, "direction": CAP_DIRECTION,
                                       "arm": ""})]
        if room.fits is False and room.blocks:
            out.append(Finding.model_validate({
                "bound": "kv_capacity", "evidence": f"at {_at(q)} the KV pool has no room for the next request "
                                                    f"either: {room.text}",
                "direction": KV_DIRECTION, "arm": ""}))
        return out
    return []


def _kv_full(levels: list[LevelSummary], limits: EngineLimits) -> Finding | None:
    """Server telemetry shows the KV cache full while requests wait (or sit parked in a lower tier): at block
    granularity where the pool is known (``kv_room``), else from ``KV_FULL``; the finding's arm is set by the
    caller (it comes last in the file)."""
    for i, lv in enumerate(levels):
        parked = lv.server_parked_mean or 0
        held = (lv.server_waiting_mean or 0) + parked
        kv = lv.kv_usage_max or 0
        if held < 0.5:
            continue
        room = kv_room(lv, limits) if parked < 0.5 else KvRoom(None)
        if room.blocks:
            if room.fits:
                continue  # the next request fits: whatever holds it back, it is not KV room
        elif kv < KV_FULL:
            continue
        before = levels[i - 1] if i else lv
        tp_a, tp_b = _p(before, "tpot"), _p(levels[-1], "tpot")
        if kv >= KV_FULL:
            ev = (f"from {_at(lv)} the KV cache is {kv:.0%} full with "
                  f"{lv.server_waiting_mean or 0:.1f} requests waiting")
        else:  # full at block granularity below the usage threshold: the blocks say why
            ev = (f"from {_at(lv)} the KV pool has no room for the next request with "
                  f"{lv.server_waiting_mean or 0:.1f} requests waiting: {room.text}")
        if parked:
            ev += f" and {parked:.1f} parked in a lower tier"
        if lv.server_running_max is not None:
            ev += f"; at most {lv.server_running_max:.0f} run (decode) at once"
        if tp_a and tp_b:
            ev += f"; TPOT p50 {tp_a:.1f} → {tp_b:.1f} ms from {_at(before)} to {_at(levels[-1])}"
        if parked >= 0.5:
            direction = ("the offload tier holds the extra requests but only HBM-resident ones decode: it raises "
                         "resident capacity, not stable concurrency; more KV room in HBM (fp8 KV cache, a GQA model, "
                         "bigger or more GPUs) would")
        else:
            direction = KV_DIRECTION
        return Finding.model_validate({"bound": "kv_capacity", "evidence": ev, "direction": direction, "arm": ""})
    return None


def _link(levels: list[LevelSummary], arm: str) -> list[Finding]:
    util = [lv.link_util_max for lv in levels if lv.link_util_max is not None]
    if util and max(util) >= 0.8:
        return [Finding(arm=arm, bound="interconnect", evidence=f"link utilisation up to {max(util):.0%}",
                        direction="remote KV traffic saturates the link: faster interconnect, keep hot KV local, "
                                  "or offload only cold prefixes")]
    return []


def _imbalance(levels: list[LevelSummary], arm: str) -> list[Finding]:
    """Load that could be spread is not (kvcap.analysis.telemetry_nodes.imbalance): the hottest node bounds the
    cluster."""
    for lv in levels:
        hot = lv.imbalance
        if hot:
            return [Finding(arm=arm, bound="imbalance", evidence=f"at {_at(lv)} {_imbalance_evidence(hot)}",
                            direction="load that could be spread is not: fix routing / placement (KV-aware or "
                                      "least-loaded balancing) before adding memory or GPUs")]
    return []


def _at(lv: LevelSummary) -> str:
    return {"concurrency": f"c={lv.level}", "rate": f"{lv.level} req/s",
            "trace": f"trace ×{lv.level:g}"}.get(lv.mode, f"{lv.mode} {lv.level}")


level_at = _at
"""A level as the findings name it (c=8, 2 req/s, trace ×1), for the verdict's evidence too."""


def _imbalance_evidence(hot: Imbalance) -> str:
    flight = hot.in_flight
    load = f" with {round(flight, 1):g} in flight on {hot.replicas} replicas" if flight else ""
    if hot.metric == "requests_held":
        return (f"node {hot.hot} holds {hot.hot_value:.1f} requests (running + waiting) while node "
                f"{hot.cold} holds {hot.cold_value:.1f} of a fair share of "
                f"{hot.fair_share or 0:.1f}{load}")
    if hot.metric == "waiting_mean":
        kv = hot.cold_kv_usage_max
        room = f" and its KV cache {kv:.0%} full" if kv is not None else ""
        return (f"{hot.hot_value:.1f} requests wait on node {hot.hot} while node {hot.cold} has "
                f"{hot.cold_value:.1f} waiting{room}{load}")
    return (f"node {hot.hot} has {hot.metric} {hot.hot_value:.0%} while node {hot.cold} has "
            f"{hot.cold_value:.0%}{load}")
