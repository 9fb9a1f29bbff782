"""Did the treatment take effect? The server-side signs ``compare`` reads beside the verdict: more requests held
(running, or parked in a tier) at the same level, more prompt tokens loaded from a lower tier, more prompt tokens
the server says it served from its cache (its per-request ``cached_tokens``) — each with its evidence line — and
the warnings where none says so or where a tier was on and never hit.
"""

from __future__ import annotations

from kvcap.analysis.prefix_reuse import tier_on
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import LevelSummary, Summary


def treatment_took_effect(control: list[LevelSummary], treatment: list[LevelSummary]) -> bool | None:
    """True/False from server telemetry (more requests held — running, or parked in a tier — at the same level);
    None without telemetry."""
    def held(lv: LevelSummary) -> float | None:
        running = lv.server_running_max
        return None if running is None else running + (lv.server_parked_max or 0)

    pairs = [(x, y) for a in control for b in treatment if a.level == b.level
             and (x := held(a)) is not None and (y := held(b)) is not None]
    if not pairs:
        return None
    return any(b > a for a, b in pairs)


def effect_signs(control: Summary, treatment: Summary, tiers: tuple[TierHits, TierHits]
                 ) -> tuple[bool | None, list[str], str | None]:
    """Whether the treatment took effect by the server's signs — more requests held (telemetry), more tier-hit
    tokens, more prompt tokens the server says it served from its cache (its per-request ``cached_tokens``): True
    when one says so, False when none does and one was known, None when none was known; with the evidence lines
    and the warning (None without one)."""
    cached = CachedHits.of(control), CachedHits.of(treatment)
    held = treatment_took_effect(control.levels, treatment.levels)
    more_tier = tier_took_effect(*tiers)
    more_cached = cached_took_effect(*cached)
    signs = (held, more_tier, more_cached)
    took_effect = True if True in signs else False if False in signs else None
    evidence = [tier_evidence(*tiers)] if more_tier else []
    if more_cached:
        evidence.append(cached_evidence(*cached))
    warning = None
    if took_effect is False and more_cached is not None:
        warning = no_sign_warning(held, more_tier)
    elif took_effect is False:
        warning = ("no server-side sign that the treatment took effect (no more requests running or parked"
                   + (", no more tier-hit tokens)" if more_tier is False and held is not False else ")"))
    elif took_effect is None:
        warning = ("no server telemetry in these runs (bench --metrics-url): cannot tell whether the treatment "
                   "took effect")
    return took_effect, evidence, warning


class TierHits:
    """One arm's prompt tokens loaded from a lower tier, summed over its levels' ``prefix_reuse`` figures (None:
    unknown — no figure reports a tier and the records do not say they hit nothing)."""

    def __init__(self, levels: dict[tuple[str, float], tuple[float, float, str]], known_zero: bool):
        self.levels = levels
        """(mode, level) → (tier-hit tokens, prompt tokens, source) of the levels that report a tier."""
        self.known_zero = known_zero

    @classmethod
    def of(cls, summary: Summary, records_hit_nothing: bool) -> TierHits:
        levels = {(lv.mode, float(lv.level)): (float(r.tier_hit_tokens), float(r.prompt_tokens), r.source)
                  for lv in summary.levels if (r := lv.prefix_reuse) is not None and r.tier_hit_tokens is not None}
        # the server's prefix counters were read at every level and show no offload connector: nothing came from
        # a tier (a plain vLLM control beside a treatment with LMCache)
        no_connector = bool(summary.levels) and all(
            (r := lv.prefix_reuse) is not None and r.source == "telemetry" and r.tier_hit_tokens is None
            for lv in summary.levels)
        return cls(levels, (records_hit_nothing or no_connector) and not levels)

    def total(self, keys: set[tuple[str, float]] | None = None) -> tuple[float, float] | None:
        """(tier-hit tokens, prompt tokens) over ``keys`` (every level reported when None); None when unknown."""
        if self.known_zero:
            return 0.0, 0.0
        if not self.levels:
            return None
        rows = [v for k, v in self.levels.items() if keys is None or k in keys]
        return sum(r[0] for r in rows), sum(r[1] for r in rows)

    @property
    def connector_seen(self) -> bool:
        """The server's telemetry reports an offload connector (its counters, read into the figures)."""
        return any(source == "telemetry" for _, _, source in self.levels.values())


def _shared(control: TierHits, treatment: TierHits) -> set[tuple[str, float]] | None:
    """The levels both arms report a tier for; None (every level) where one arm has none to match."""
    both = set(control.levels) & set(treatment.levels)
    return both or None


def tier_took_effect(control: TierHits, treatment: TierHits) -> bool | None:
    """True: more prompt tokens came from a lower tier in the treatment than in the control (at the levels both
    report, else over every level); False: known for both and not more; None: unknown for either."""
    keys = _shared(control, treatment)
    c, t = control.total(keys), treatment.total(keys)
    if c is None or t is None:
        return None
    return t[0] > c[0]


def tier_evidence(control: TierHits, treatment: TierHits) -> str:
    """The tier-hit evidence line, with its numbers."""
    keys = _shared(control, treatment)
    c, t = control.total(keys) or (0.0, 0.0), treatment.total(keys) or (0.0, 0.0)

    def share(x: tuple[float, float]) -> str:
        return f" ({x[0] / x[1]:.1%} of {x[1]:,.0f} prompt tokens)" if x[1] else ""

    sources = sorted({s for arm in (control, treatment) for _, _, s in arm.levels.values()})
    where = {"records": "the measured requests' records", "telemetry": "the server's tier counters"}
    return (f"more prompt tokens loaded from a lower tier: {t[0]:,.0f} tier-hit tokens in the treatment"
            f"{share(t)} vs {c[0]:,.0f} in the control{share(c)}, from "
            + " and ".join(where.get(s, s) for s in sources))


CACHED_MARGIN = 0.05
"""The least rise, in the share of prompt tokens a server says it served from its cache (its per-request
``cached_tokens``), that counts as a sign the treatment took effect: two runs of one setup differ by a cache block
here and there."""


class CachedHits:
    """One arm's prompt tokens the server says it served from its cache, from the levels whose ``prefix_reuse``
    came from the records' ``cached_tokens`` (``server_cached_tokens``: a ``bench`` run without prefix counters)."""

    def __init__(self, levels: dict[tuple[str, float], tuple[float, float]]):
        self.levels = levels
        """(mode, level) → (cached tokens, prompt tokens)."""

    @classmethod
    def of(cls, summary: Summary) -> CachedHits:
        return cls({(lv.mode, float(lv.level)): (float(r.server_cached_tokens), float(r.prompt_tokens))
                    for lv in summary.levels
                    if (r := lv.prefix_reuse) is not None and r.server_cached_tokens is not None})

    def total(self, keys: set[tuple[str, float]] | None = None) -> tuple[float, float] | None:
        """(cached tokens, prompt tokens) over ``keys`` (every level when None); None without a prompt token."""
        rows = [v for k, v in self.levels.items() if keys is None or k in keys]
        cached, prompt = sum(r[0] for r in rows), sum(r[1] for r in rows)
        return (cached, prompt) if prompt > 0 else None


CachedTotal = tuple[float, float]
"""(cached tokens, prompt tokens)."""


def _cached_totals(control: CachedHits, treatment: CachedHits) -> tuple[CachedTotal, CachedTotal] | None:
    """Both arms' (cached, prompt) tokens at the levels both report (else over every level); None: unknown."""
    both = set(control.levels) & set(treatment.levels) or None
    c, t = control.total(both), treatment.total(both)
    return (c, t) if c is not None and t is not None else None


def cached_took_effect(control: CachedHits, treatment: CachedHits) -> bool | None:
    """True: the treatment's share of prompt tokens served from the server's cache (its own per-request count) is
    above the control's by more than ``CACHED_MARGIN``; False: known for both and not; None: unknown for either."""
    totals = _cached_totals(control, treatment)
    if totals is None:
        return None
    c, t = totals
    return t[0] / t[1] - c[0] / c[1] > CACHED_MARGIN


def cached_evidence(control: CachedHits, treatment: CachedHits) -> str:
    """The cached-tokens evidence line, with its numbers and where they came from."""
    totals = _cached_totals(control, treatment)
    if totals is None:
        return ""
    c, t = totals
    return (f"more prompt tokens served from the server's cache: {t[0]:,.0f} cached tokens in the treatment "
            f"({t[0] / t[1]:.1%} of {t[1]:,.0f} prompt tokens) vs {c[0]:,.0f} in the control ({c[0] / c[1]:.1%} of "
            f"{c[1]:,.0f}), more than the {CACHED_MARGIN:.0%} margin, from the server's per-request cached_tokens")


def no_sign_warning(held: bool | None, more_tier: bool | None) -> str:
    """The warning where the server's cached tokens were known for both arms and no sign says the treatment took
    effect: what was looked at, each with its source."""
    looked = ["no more cached prompt tokens (the server's per-request cached_tokens)"]
    if held is False:
        looked.insert(0, "no more requests running or parked")
    if more_tier is False:
        looked.append("no more tier-hit tokens")
    return "no server-side sign that the treatment took effect (" + ", ".join(looked) + ")"


def idle_tier_warning(manifest: Manifest | None, hits: TierHits) -> str | None:
    """A treatment that turns a tier on (its scenario's ``serving.kv_offload``, or the server's offload counters)
    and loads no token from it: the tier saved no prefill, so any gain is parking alone."""
    total = hits.total()
    if total is None or total[0] > 0 or not (tier_on(manifest) or hits.connector_seen):
        return None
    offload = (manifest.fixed if manifest is not None else {}).get("serving.kv_offload")
    on = f"serving.kv_offload={offload}" if tier_on(manifest) else "the server's offload counters"
    return (f"tier on, no hit tokens: it cannot have saved work ({on}, 0 tier-hit tokens in the treatment's "
            "measured windows): any gain is parked requests, not saved prefill")
