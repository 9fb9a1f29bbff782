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
- KV capacity: requests queue (server waiting > 0, or TTFT jumps) while the per-token time stays flat → the
  GPU had compute to spare; more KV memory (VRAM, host or remote offload) is likely to help.
- compute: the per-token time grows with the batch while nothing queues → "GPU busy, VRAM to spare": more
  memory won't help; add compute (GPUs/replicas), quantize, or cap the batch.
- KV capacity with no prefix reuse (cached share under ``REUSE_SHARE`` at every level and none declared): decode KV
  binds and a tier saves no prefill — it can only park requests that only HBM can decode.
- interconnect: a link near its capacity → remote KV access is the limit; faster links or hotter local data.
- client: the load generator lagged or could not keep the offered concurrency → fix the client first.
"""

from __future__ import annotations

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
             reusable: float | None = None, thinks: bool = False) -> list[Finding]:
    """Findings (arm, bound, evidence, direction) for one run's summary levels (bench or sim alike);
    ``shared_prefixes``: the workload declares prompts that share prefixes (``prefix_reuse.shares_prefixes``);
    ``reusable``: the share of prompt tokens that is a shared prefix, where known (``prefix_reuse.reusable_share``);
    ``thinks``: users pause between turns (sessions with a think time), so fewer requests in flight than users is
    the workload, not a lagging client."""
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
    queued = waiting or [lv for lv in levels
                         if tt0 and (tt := _p(lv, "ttft")) and tt > 2 * tt0 + 5 * (tp0 or 0)]
    recompute = _recompute(levels, queued, waiting, shared_prefixes, arm, reusable)
    if recompute is not None:
        out.append(recompute)
        return out + _link(levels, arm) + _imbalance(levels, arm)
    no_reuse = _no_reuse(levels, shared_prefixes)
    full = _kv_full(levels)
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
    parts = [f"{r.hbm_hit_rate or 0:.0%} HBM prefix cache"]
    if r.tier_hit_tokens is not None:
        parts.append(f"{r.tier_hit_rate or 0:.0%} tier")
    return ", ".join(parts) + f" of {r.prompt_tokens:,.0f} prompt tokens"


def _no_reuse(levels: list[LevelSummary], shared_prefixes: bool) -> bool:
    """The levels carry prefix-reuse figures and none shows reuse, and the workload declares none: a tier on this
    run could only park."""
    shares = [s for lv in levels if (s := hit_share(lv.prefix_reuse)) is not None]
    return bool(shares) and max(shares) < REUSE_SHARE and not shared_prefixes


def _kv_full(levels: list[LevelSummary]) -> Finding | None:
    """Server telemetry shows the KV cache full while requests wait (or sit parked in a lower tier); the finding's
    arm is set by the caller (it comes last in the file)."""
    for i, lv in enumerate(levels):
        held = (lv.server_waiting_mean or 0) + (lv.server_parked_mean or 0)
        kv = lv.kv_usage_max or 0
        if kv < KV_FULL or held < 0.5:
            continue
        before = levels[i - 1] if i else lv
        tp_a, tp_b = _p(before, "tpot"), _p(levels[-1], "tpot")
        parked = lv.server_parked_mean or 0
        ev = (f"from {_at(lv)} the KV cache is {kv:.0%} full with "
              f"{lv.server_waiting_mean or 0:.1f} requests waiting")
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
            direction = ("VRAM for KV binds while compute has headroom: more KV room in HBM (fp8 KV cache, a GQA "
                         "model, bigger or more GPUs) raises stable concurrency; an offload tier holds waiting "
                         "requests but cannot decode them, so it helps only where it saves prefill (reused prefixes)")
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
