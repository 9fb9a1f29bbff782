"""Audit a published capacity table (concurrency, output tok/s, TTFT…) against its own arithmetic.

Capacity claims usually arrive as a small table, and its numbers constrain each other: each level's
throughput fixes its mean TPOT and Little's law (`kvcap.audit.level_checks`); successive levels give the
scaling efficiency (the article's condition a); a memory plan says whether the "VRAM-only" arm was
VRAM-bound at all; and the levels that pass every check give the effective capacity the table supports.
This module runs the checks across levels and puts the findings together. Pure functions: the CLI reads
the CSV with `kvcap.audit.table.read_table` and prints what `audit_table` returns.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

from kvcap.analysis.capacity import MIN_SCALING
from kvcap.audit.level_checks import Finding, audit_level, finding, level_label, level_value, rounded
from kvcap.audit.table import Num, TableRow, combine_bounds, flip_bound, parse_row
from kvcap.errors import InputError
from kvcap.plan import PlanResult, round_up

SUBLINEAR_SCALING = 0.5
"""Below this (but above MIN_SCALING) throughput still grows, but much less than the load: a shared bottleneck."""
CONTROL_ARM = re.compile(r"control|vram|hbm|baseline|显存|对照", re.IGNORECASE)


def audit_table(rows: list[dict[str, Any]], *, output_tokens: int | None, input_tokens: int | None = None,
                slo: dict[str, float] | None = None, plan: PlanResult | None = None,
                claimed_effective: float | None = None) -> dict[str, Any]:
    """Findings per level and check, the derived numbers per level, and the effective capacity they support.

    ``output_tokens`` is the output length per request (the article's "max 256": a cap, so the mean may be
    smaller; each finding says what follows if it is); a table column output_tokens or request_s overrides it
    per row. ``slo`` as from `kvcap.analysis.slo.parse_slo` (ms). ``plan`` a `kvcap.plan.PlanResult` for the
    same model, cluster and lengths. ``claimed_effective`` the capacity the table's source claims.
    """
    if not rows:
        raise InputError("table has no rows")
    if output_tokens is not None and output_tokens < 1:
        raise InputError(f"--output-tokens must be at least 1, got {output_tokens}")
    parsed = _parse_levels(rows)
    slo = dict(slo or {})
    findings: list[Finding] = []
    assumptions: list[str] = []
    levels = [audit_level(r, output_tokens, slo, findings) for r in parsed]
    sequences = _sequences(parsed)
    by_key = {(lv["arm"], lv["level"]): lv for lv in levels}
    for seq in sequences:
        _scaling(seq, by_key, findings)
    if plan is not None:
        _vram_check(parsed, plan, input_tokens, output_tokens, findings)
    _note_assumptions(parsed, output_tokens, slo, assumptions)
    effective = _effective(sequences, findings, claimed_effective, slo)
    findings.append(effective.pop("_finding"))
    _mark_failed_checks(levels, findings)
    findings.sort(key=lambda f: (f["level"] is None, f["level"] or 0))
    return {"findings": findings, "levels": levels, "effective": effective,
            "summary": _summary(levels, effective, findings, slo), "assumptions": assumptions,
            "inputs": {"output_tokens": output_tokens, "input_tokens": input_tokens, "slo": slo,
                       "claimed_effective": claimed_effective, "plan_model": plan.model if plan else None}}


def _parse_levels(rows: list[dict[str, Any]]) -> list[TableRow]:
    """Typed rows, one per arm and level (repeats must be aggregated before the audit)."""
    parsed = [parse_row(r, f"row {i}") for i, r in enumerate(rows, start=1)]
    seen: set[tuple[str, float]] = set()
    for r in parsed:
        if (r.arm, r.concurrency) in seen:
            raise InputError(f"{r.where}: a second row for {level_label(r.arm, r.concurrency)}: aggregate repeats "
                             "(e.g. their median) into one row per arm and level")
        seen.add((r.arm, r.concurrency))
    return parsed


def _mark_failed_checks(levels: list[dict[str, Any]], findings: list[Finding]) -> None:
    """Each level's ``failed_checks`` (checks with an error finding, in order) and ``passes``, in place."""
    for lv in levels:
        errs = [f["check"] for f in findings if f["level"] == lv["level"] and f["arm"] == (lv["arm"] or None)
                and f["severity"] == "error"]
        lv["failed_checks"] = list(dict.fromkeys(errs))
        lv["passes"] = not errs


# --- checks across levels ------------------------------------------------------------------------------------

def _sequences(rows: list[TableRow]) -> list[list[TableRow]]:
    """Levels to compare for scaling: one per arm when arms share levels (a real A/B), else the whole table."""
    arms: dict[str, set[float]] = {}
    for r in rows:
        arms.setdefault(r.arm, set()).add(r.concurrency)
    shared = len(arms) > 1 and any(a & b for i, a in enumerate(arms.values())
                                   for b in list(arms.values())[i + 1:])
    if shared:
        return [sorted((r for r in rows if r.arm == a), key=lambda r: r.concurrency) for a in arms]
    return [sorted(rows, key=lambda r: r.concurrency)]


def _scaling(seq: list[TableRow], by_key: dict[tuple[str, Any], dict[str, Any]], findings: list[Finding]) -> None:
    """Check 3: (Δthroughput %)/(Δconcurrency %) between successive levels; < MIN_SCALING fails condition (a)."""
    for a, b in itertools.pairwise(seq):
        gain = b.output_tok_s.value / a.output_tok_s.value - 1
        prop = b.concurrency / a.concurrency - 1
        eff = gain / prop
        marginal = (b.output_tok_s.value - a.output_tok_s.value) / (b.concurrency - a.concurrency)
        bound = combine_bounds(b.output_tok_s.bound, flip_bound(a.output_tok_s.bound))
        by_key[(b.arm, level_value(b.concurrency))]["scaling_efficiency"] = rounded(eff)
        step = f"{level_value(a.concurrency):g} → {level_value(b.concurrency):g}"
        msg = (f"{step}: throughput {a.output_tok_s.value:g} → {b.output_tok_s.value:g} tok/s ({gain:+.1%}) for "
               f"{prop:+.0%} concurrency: efficiency {Num(eff, bound).text('{:.3f}')}; each added stream adds "
               f"{marginal:.2f} tok/s against {a.output_tok_s.value / a.concurrency:.2f} per stream before")
        if eff < MIN_SCALING:
            sev = "error"
            msg += f" — throughput no longer grows (< {MIN_SCALING:g}): condition (a) fails, a stress limit"
        elif eff < SUBLINEAR_SCALING:
            sev = "warn"
            msg += " — sub-linear: the streams share a saturating resource (compute, memory bandwidth, link)"
        else:
            sev = "info"
        if a.arm != b.arm:
            msg += f" [crosses arms: {a.arm or '?'} → {b.arm or '?'}, so the step mixes the arm change with the load]"
        findings.append(finding(b, "scaling", sev, msg, from_level=level_value(a.concurrency),
                                scaling_efficiency=rounded(eff), throughput_gain=rounded(gain),
                                concurrency_gain=rounded(prop), marginal_tok_s_per_stream=rounded(marginal),
                                bound=bound))


def _model_context(name: str) -> int | None:
    try:
        from kvcap.specs.model import load_model
        return load_model(name).max_position_embeddings or None
    except (InputError, OSError, ValueError):
        return None


def _vram_bound_tokens(plan: PlanResult, concurrency: float) -> int | None:
    """Tokens per request above which ``concurrency`` requests no longer fit in HBM (None: the batch cap binds)."""
    per_replica = math.ceil(concurrency / plan.replicas)
    if per_replica > plan.max_num_seqs:
        return None
    return plan.kv_tokens_per_gpu // per_replica // plan.block_size * plan.block_size


def _vram_check(rows: list[TableRow], plan: PlanResult, input_tokens: int | None, output_tokens: int | None,
                findings: list[Finding]) -> None:
    """Check 5: was the "VRAM-only" control actually VRAM-bound? The plan says how many requests HBM holds."""
    hbm = plan.resident_requests.get("hbm", 0)
    per_gpu = plan.resident_requests_per_gpu.get("hbm", hbm / max(plan.gpus, 1))
    ctrl = [r for r in rows if r.arm and CONTROL_ARM.search(r.arm)]
    top = max(r.concurrency for r in rows)
    anchor = max(ctrl, key=lambda r: r.concurrency) if ctrl else max(rows, key=lambda r: r.concurrency)
    cc = anchor.concurrency
    mismatch = []
    if input_tokens is not None and input_tokens != plan.input_tokens:
        mismatch.append(f"input {input_tokens} vs the plan's {plan.input_tokens}")
    if output_tokens is not None and output_tokens != plan.output_tokens:
        mismatch.append(f"output {output_tokens} vs the plan's {plan.output_tokens}")
    linear = plan.kv_bytes_per_request == round_up(plan.tokens_per_request, plan.block_size) * plan.kv_bytes_per_token
    bound_tokens = _vram_bound_tokens(plan, cc)
    ctx = _model_context(plan.model)
    nums: dict[str, Any] = {
        "model": plan.model, "attention": plan.attention_kind, "gpu": plan.gpu, "gpus": plan.gpus,
        "tokens_per_request": plan.tokens_per_request, "kv_bytes_per_request": plan.kv_bytes_per_request,
        "usable_kv_bytes_per_gpu": plan.usable_kv_bytes_per_gpu, "hbm_requests": hbm,
        "hbm_requests_per_gpu": rounded(per_gpu, 2), "control_concurrency": level_value(cc),
        "max_concurrency": level_value(top), "vram_bound_above_tokens": bound_tokens, "model_context": ctx}
    head = (f"plan: {plan.model} ({plan.attention_kind}, {plan.kv_bytes_per_token / 1024:.0f} KiB of KV per token) "
            f"on {plan.gpus}× {plan.gpu}: {plan.usable_kv_bytes_per_gpu / 2**30:.2f} GiB of KV per GPU holds "
            f"{hbm} requests of {plan.tokens_per_request} tokens ({per_gpu:g} per GPU, "
            f"{plan.kv_bytes_per_request / 2**20:.0f} MiB each)")
    where = (f"the {anchor.arm} arm stops at {level_value(cc):g}" if ctrl
             else f"the table's largest level is {level_value(cc):g}")
    if cc < hbm:
        sev = "warn"
        msg = (f"{head}; {where} ({cc / plan.gpus:g} per GPU): the control was not VRAM-bound — "
               f"HBM had room for {hbm - cc:g} more")
        if top <= hbm:
            msg += (f", and every level up to {level_value(top):g} fits in HBM too, so the spill-over arm had "
                    "nothing to spill: its gain or loss is not the memory's")
        if bound_tokens is not None:
            msg += (f". At {level_value(cc):g} streams HBM becomes the limit only above ≈ {bound_tokens:,} tokens "
                    f"per request{'' if linear else ' (full-attention estimate)'}")
            if ctx and bound_tokens > ctx:
                msg += f", beyond this model's {ctx:,}-token context: it cannot be VRAM-bound here"
    else:
        sev = "info"
        msg = (f"{head}; {where} ({cc / plan.gpus:g} per GPU): consistent with a VRAM-bound control "
               "(HBM is full at or below this level)")
    if mismatch:
        msg += f" [the plan's lengths differ from the table's: {', '.join(mismatch)}]"
    findings.append(finding(anchor, "vram_bound", sev, msg, **nums))


def _walk_up(seq: list[TableRow], findings: list[Finding],
             skip: tuple[str, ...] = ()) -> tuple[float | None, list[str], float | None]:
    """Counting up one sequence: the last level before the first with an error (checks in ``skip`` aside),
    that level's failing checks, and the level itself (None if every level passes)."""
    eff = None
    for r in seq:
        errs = [f["check"] for f in findings if f["level"] == level_value(r.concurrency)
                and f["arm"] == (r.arm or None) and f["severity"] == "error" and f["check"] not in skip]
        if errs:
            return eff, list(dict.fromkeys(errs)), r.concurrency
        eff = r.concurrency
    return eff, [], None


def _effective(sequences: list[list[TableRow]], findings: list[Finding], claimed: float | None,
               slo: dict[str, float]) -> dict[str, Any]:
    """Check 6: the largest level that passes every check, counting up from the lowest (as `capacities` does)."""
    by_arm: dict[str, Any] = {}
    best, limited_by, first_fail = None, [], None
    best_wo = None
    for seq in sequences:
        eff, lim, fail_at = _walk_up(seq, findings)
        eff_wo, _, _ = _walk_up(seq, findings, ("implied_tpot",))
        if len(sequences) > 1:
            by_arm[seq[0].arm] = None if eff is None else level_value(eff)
        if (eff is not None and (best is None or eff > best)) or (best is None and first_fail is None):
            best, limited_by, first_fail = eff, lim, fail_at
        if eff_wo is not None and (best_wo is None or eff_wo > best_wo):
            best_wo = eff_wo
    stress = max(r.concurrency for seq in sequences for r in seq)
    out: dict[str, Any] = {"level": None if best is None else level_value(best), "by_arm": by_arm or None,
                           "stress_limit": level_value(stress), "limited_by": limited_by,
                           "first_failing_level": None if first_fail is None else level_value(first_fail),
                           "without_implied_tpot": None if best_wo is None else level_value(best_wo),
                           "claimed": claimed, "slo": slo}
    sev, msg = _effective_message(best, best_wo, first_fail, limited_by, claimed, stress, slo)
    out["_finding"] = {"level": None, "arm": None, "check": "effective_capacity", "severity": sev, "message": msg,
                       "effective": out["level"], "without_implied_tpot": out["without_implied_tpot"],
                       "claimed": claimed, "stress_limit": out["stress_limit"]}
    out["message"] = msg
    return out


def _effective_message(best: float | None, best_wo: float | None, first_fail: float | None, limited_by: list[str],
                       claimed: float | None, stress: float, slo: dict[str, float]) -> tuple[str, str]:
    """Severity and sentence of the effective-capacity finding: an error when the claim is not supported."""
    eff_txt = "none — no level" if best is None else f"{level_value(best):g}"
    msg = f"effective capacity by the table's own numbers{' under the SLO' if slo else ''}: {eff_txt}"
    if best is None:
        msg += " passes every check"
    if first_fail is not None:
        msg += f" (first failure at {level_value(first_fail):g}: {', '.join(limited_by)})"
    if best_wo != best:
        msg += (f"; taking the table's latencies at face value and ignoring the TPOT its throughput implies, "
                f"it would be {'none' if best_wo is None else f'{level_value(best_wo):g}'}")
    sev = "info"
    if claimed is not None:
        if best is not None and claimed <= best:
            msg += f"; the claim of {claimed:g} is supported"
        else:
            sev = "error"
            msg += (f"; the claim of {claimed:g} is not supported by the table's own numbers"
                    + (" (it follows from TTFT alone)" if best_wo is not None and claimed <= best_wo else ""))
    msg += f"; stress limit {level_value(stress):g}"
    return sev, msg


def _note_assumptions(rows: list[TableRow], output_tokens: int | None, slo: dict[str, float],
                      assumptions: list[str]) -> None:
    """What the audit takes for granted about this table, said once rather than in every finding."""
    assumptions.append("closed loop: each of the C streams always has a request in flight, so T = C·N/E2E; "
                       "idle streams would make the true E2E and TPOT smaller")
    if output_tokens is not None:
        assumptions.append(f"{output_tokens} output tokens per request (where the table gives no length or rate); "
                           "if it is a cap the mean is smaller: see max_mean_output_tokens_for_slo")
    if any("" in r.latency.get("ttft", {}) for r in rows):
        assumptions.append("unlabelled TTFT is read as the mean in E2E = TTFT + (N−1)·TPOT and as the SLO's "
                           "percentile against the SLO; either reading only makes a failure firmer")
    if any(v.bound for r in rows for vals in r.latency.values() for v in vals.values()):
        assumptions.append("a value like '>900' is a lower bound: it fails an SLO it exceeds, and what is derived "
                           "from it is marked as a bound")
    unchecked = [k for k in slo if not re.fullmatch(r"(ttft|tpot|itl|e2e)_p\d{2}", k)]
    if unchecked:
        assumptions.append(f"SLO keys not checkable from a table: {', '.join(unchecked)}")


def _summary(levels: list[dict[str, Any]], effective: dict[str, Any], findings: list[Finding],
             slo: dict[str, float]) -> str:
    """One paragraph: each level's per-stream rate, implied TPOT, scaling and verdict; then the capacity."""
    parts = []
    for lv in levels:
        bits = [f"{lv['per_stream_tok_s']:.3g} tok/s/stream"]
        if lv.get("implied_tpot_ms") is not None:
            bits.append(f"TPOT {Num(lv['implied_tpot_ms'], lv.get('implied_tpot_bound')).text('{:.1f}', '≈ ')} ms")
        if lv.get("scaling_efficiency") is not None:
            bits.append(f"scaling {lv['scaling_efficiency']:.2f}")
        bits.append("ok" if lv["passes"] else "fails " + ",".join(lv["failed_checks"]))
        parts.append(f"{lv['level']:g}{' (' + lv['arm'] + ')' if lv['arm'] else ''}: {', '.join(bits)}")
    n_err = sum(f["severity"] == "error" for f in findings)
    n_warn = sum(f["severity"] == "warn" for f in findings)
    return (f"{len(levels)} levels — " + "; ".join(parts) + f". {effective['message']}. "
            f"{n_err} errors, {n_warn} warnings" + ("" if slo else " (no SLO given)"))
