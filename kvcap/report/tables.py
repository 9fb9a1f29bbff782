"""The report's tables and lists as HTML: the key numbers, per-level comparison, raw per-level results, per-node
figures, fixed variables and the diagnosis. Every value from a run is escaped on the way in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvcap.analysis.slo import format_slo
from kvcap.analysis.summary import best_goodput_level
from kvcap.report.data import Arm, error_class_totals, quantile
from kvcap.report.format import ARMS, esc, fmt, fmtm, is_finite, level_name, pair, signed, value_text
from kvcap.rundir.compare import ArmResult, Comparison
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import Capacity, Finding, LevelSummary, NodeFigures, Summary

NOT_FIXED = {"target.url"}
"""Keys expected to differ between arms (two servers); shown, not flagged. Same set as ``compare`` uses."""
NODE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("GPU util mean", "gpu_util_mean", "pct"), ("GPU mem max", "gpu_mem_used_max_bytes", "gib"),
    ("KV usage mean", "kv_usage_mean", "pct"), ("running mean / max", "running", "pair"),
    ("waiting mean", "waiting_mean", "num"), ("net rx Gbps", "net_rx_gbps_mean", "num"),
    ("net tx Gbps", "net_tx_gbps_mean", "num"), ("busiest link", "link_util_max", "pct"))
RAW_HEAD = ["level", "req", "ok", "err", "err rate", "out tok/s", "goodput tok/s", "TTFT p50/p95/p99 ms",
            "TPOT p50/p95/p99 ms", "ITL p95/p99 ms", "E2E p95 ms", "running max", "waiting mean",
            "in flight", "scaling eff.", "SLO / conditions"]
RAW_QUANTILES = (("ttft", ("p50", "p95", "p99")), ("tpot", ("p50", "p95", "p99")), ("itl", ("p95", "p99")),
                 ("e2e", ("p95",)))
COMPARE_GROUPS = ["out tok/s", "goodput tok/s", "Δ goodput 95% CI", "TTFT p95 ms", "TPOT p95 ms", "running max",
                  "SLO"]


def resident_text(figures: ArmResult | Capacity, lower_bound: bool) -> str:
    """Resident requests, ``+ (lower bound)`` when the run never filled memory, and where the number came from."""
    text = fmt(figures.resident) + ("+ (lower bound)" if lower_bound else "")
    return text + (f" ({figures.resident_source})" if figures.resident_source else "")


def key_numbers(result: Comparison, labels: dict[str, str], summaries: dict[str, Summary]) -> str:
    """The three numbers per arm plus stress limit and what limited it; then the goodput difference and its noise."""
    c, t = result.control, result.treatment
    lower = {arm: summaries[arm].capacity.resident_lower_bound for arm in ARMS}
    rows = [("resident requests", resident_text(c, lower["control"]), resident_text(t, lower["treatment"])),
            ("effective capacity (within SLO)", fmt(c.effective), fmt(t.effective)),
            ("goodput tok/s (best level)",
             f"{fmtm(c.goodput_tok_s)} @ {fmt(c.goodput_level)}",
             f"{fmtm(t.goodput_tok_s)} @ {fmt(t.goodput_level)}"),
            ("stress limit", fmt(c.stress_limit), fmt(t.stress_limit)),
            ("limited by", fmt(c.limited_by), fmt(t.limited_by))]
    body = "".join(f'<tr><th>{esc(k)}</th><td class="num">{esc(a)}</td><td class="num">{esc(b)}</td></tr>'
                   for k, a, b in rows)
    table = (f'<table class="keynums"><thead><tr><th></th><th class="num">{esc(labels["control"])}</th>'
             f'<th class="num">{esc(labels["treatment"])}</th></tr></thead><tbody>{body}</tbody></table>')
    return table + "".join(f"<p>{x}</p>" for x in _gain_lines(result))


def _gain_lines(result: Comparison) -> list[str]:
    """Goodput Δ with its CI, efficiency, whether the treatment took effect, the SLO — as HTML lines."""
    g = result.goodput_gain
    ci = pair(g.ci95)
    noise = "beyond noise" if g.beyond_noise else "inside the noise"
    lines = [f"goodput Δ <b>{esc(signed(g.delta_tok_s))} tok/s</b>, 95% CI "
             f"[{esc(signed(ci[0]))}, {esc(signed(ci[1]))}] — {esc(noise)}"]
    eff = result.efficiency
    if eff is not None:
        lines.append(f"efficiency {esc(fmt(eff))} <span class=\"muted\">(relative goodput gain per relative gain in "
                     "effective capacity; 1 = proportional)</span>")
    took = result.treatment_took_effect
    lines.append("treatment took effect on the server: "
                 + esc("yes: " + "; ".join(result.effect_evidence) if took and result.effect_evidence else
                       {True: "yes (more requests running at the same level)", False: "NO sign of it",
                        None: "unknown (no server telemetry)"}[took]))
    if result.slo:
        lines.append(f"SLO: {esc(format_slo(result.slo))}")
    return lines


def single_key_numbers(summary: Summary) -> str:
    """One run's capacities and best goodput, then its SLO (or why the SLO-bound numbers are missing)."""
    cap = summary.capacity
    best = best_goodput_level(summary.levels)
    rows = [("resident requests", resident_text(cap, cap.resident_lower_bound)),
            ("effective capacity (within SLO)", fmt(cap.effective)),
            ("goodput tok/s (best level)", f"{fmtm(best.goodput_tok_s)} @ {fmt(best.level)}" if best else "–"),
            ("stress limit", fmt(cap.stress_limit)), ("limited by", fmt(cap.limited_by))]
    nums = ('<table class="keynums"><tbody>' + "".join(
        f'<tr><th>{esc(k)}</th><td class="num">{esc(v)}</td></tr>' for k, v in rows) + "</tbody></table>")
    if summary.slo:
        return nums + f"<p>SLO: {esc(format_slo(summary.slo))}</p>"
    return nums + '<p class="muted">No SLO given: effective capacity and goodput need one.</p>'


def slo_cell(ok: bool | None, failed_checks: Sequence[str], has_slo: bool) -> str:
    """pass / FAIL (with the failed checks) / an en dash where the level has no SLO verdict."""
    if ok is None:
        return "–"
    if ok:
        return '<span class="pass">pass</span>'
    checks = ", ".join(failed_checks)
    return f'<span class="fail">{"FAIL" if has_slo else "fail"}</span> {esc(checks)}'


def per_level_compare(result: Comparison, labels: dict[str, str]) -> str:
    """Both arms side by side per level, with the per-level goodput Δ CI."""
    rows = result.per_level
    if not rows:
        return ""
    head1 = '<tr><th rowspan="2">level</th>' + "".join(
        f'<th rowspan="2" class="num">{esc(g)}</th>' if g.startswith("Δ") else f'<th colspan="2">{esc(g)}</th>'
        for g in COMPARE_GROUPS) + "</tr>"
    head2 = "<tr>" + "".join(f'<th class="num">{esc(labels[a])}</th>' for g in COMPARE_GROUPS
                             if not g.startswith("Δ") for a in ARMS) + "</tr>"
    body = []
    for r in rows:
        ci = r.goodput_delta_ci95
        cells = [*r.output_tok_s, *r.goodput_tok_s]
        cells_txt = [fmtm(x) for x in cells] + [f"[{signed(ci[0])}, {signed(ci[1])}]"]
        cells_txt += [fmtm(x) for x in (*r.ttft_p95_ms, *r.tpot_p95_ms)]
        cells_txt += [fmt(x) for x in r.server_running_max]
        slo = "".join(f"<td>{slo_cell(ok, [], True)}</td>" for ok in r.slo_ok)
        body.append(f"<tr><td>{esc(level_name(r.mode, r.level))}</td>"
                    + "".join(f'<td class="num">{esc(x)}</td>' for x in cells_txt) + slo + "</tr>")
    return ("<h3>Per-level comparison</h3><div class=\"scroll\"><table class=\"perlevel\"><thead>"
            + head1 + head2 + "</thead><tbody>" + "".join(body)
            + "</tbody></table></div>")


def node_cell(figs: NodeFigures, key: str, kind: str) -> str:
    """One per-node figure: a percentage, GiB, ``mean / max`` running, or a plain number."""
    if kind == "pair":
        a, b = figs.running_mean, figs.running_max
        return "–" if a is None else f"{a:.1f} / {b:.0f}"
    v = getattr(figs, key)
    if v is None:
        return "–"
    if kind == "pct":
        return f"{v:.0%}"
    if kind == "gib":
        return f"{v / 2**30:.2f} GiB"
    return fmt(v, 3)


def node_table(a: Arm) -> str:
    """Per level and node of one arm, the hot node highlighted; empty when no level has per-node figures."""
    head = "".join(f"<th>{esc(h)}</th>" for h, _, _ in NODE_COLUMNS)
    rows = []
    for lv in a.summary.levels:
        hot = lv.imbalance.hot if lv.imbalance is not None else None
        for node, figs in (lv.nodes or {}).items():
            cls = ' class="hot"' if node == hot else ""
            cells = "".join(f'<td class="num">{esc(node_cell(figs, k, kind))}</td>' for _, k, kind in NODE_COLUMNS)
            rows.append(f"<tr{cls}><td>{esc(level_name(lv.mode, lv.level))}</td><td>{esc(node)}</td>"
                        f"{cells}</tr>")
    if not rows:
        return ""
    return (f'<h3>{esc(a.label)}</h3><div class="scroll"><table class="raw nodes"><thead><tr><th>level</th>'
            f"<th>node</th>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def _raw_row(lv: LevelSummary, has_slo: bool) -> str:
    trio = {m: " / ".join(fmtm(quantile(lv, m, q)) for q in qs) for m, qs in RAW_QUANTILES}
    name = level_name(lv.mode, lv.level)
    if lv.achieved_rate is not None:
        name += f" (got {fmt(lv.achieved_rate)}/s)"
    err_rate = lv.error_rate
    cells = [fmt(lv.requests), fmt(lv.ok), fmt(lv.errors),
             f"{err_rate:.1%}" if is_finite(err_rate) else "–", fmtm(lv.output_tok_s),
             fmtm(lv.goodput_tok_s), trio["ttft"], trio["tpot"], trio["itl"], trio["e2e"],
             fmt(lv.server_running_max), fmt(lv.server_waiting_mean),
             fmt(lv.littles_law.in_flight if lv.littles_law is not None else None), fmt(lv.scaling_efficiency)]
    return (f"<tr><td>{esc(name)}</td>" + "".join(f'<td class="num">{esc(c)}</td>' for c in cells)
            + f"<td>{slo_cell(lv.slo_ok, lv.failed_checks, has_slo)}</td></tr>")


def raw_table(summary: Summary) -> str:
    """Every level's numbers as measured: counts, throughput, goodput, latency percentiles, server gauges."""
    levels = summary.levels
    if not levels:
        return '<p class="muted">No levels.</p>'
    out = ['<div class="scroll"><table class="raw"><thead><tr>'
           + "".join(f'<th{" class=num" if i not in (0, len(RAW_HEAD) - 1) else ""}>{esc(h)}</th>'
                     for i, h in enumerate(RAW_HEAD)) + "</tr></thead><tbody>"]
    has_slo = bool(summary.slo)
    out += [_raw_row(lv, has_slo) for lv in levels]
    out.append("</tbody></table></div>")
    errs = error_class_totals(levels)
    if errs:
        out.append('<p class="muted">errors by class: ' + esc(", ".join(f"{k} {v}" for k, v in sorted(errs.items())))
                   + "</p>")
    return "\n".join(out)


def findings(items: Iterable[Finding]) -> list[str]:
    """Diagnosis entries as list items: the arm's tag, the bound, its evidence and which way to scale."""
    out = []
    for d in items:
        arm = f'<span class="tag">{esc(d.arm)}</span>' if d.arm else ""
        text = f"{arm}bounded by <b>{esc(d.bound)}</b>"
        if d.evidence:
            text += f" — {esc(d.evidence)}"
        if d.direction:
            text += f". → {esc(d.direction)}"
        out.append(f"<li>{text}</li>")
    return out


def notes(items: Iterable[str]) -> list[str]:
    """Warnings as list items."""
    return [f"<li>{esc(w)}</li>" for w in items]


def _fixed_tag(k: str, a: Any, b: Any, differences: set[Any], under: set[Any], allowed: set[Any]) -> tuple[str, str]:
    """Row class and tag of one fixed variable: differs (red), under test or allowed (blue), expected (grey)."""
    if k in differences:
        return "diff", "DIFFERS"
    if k in under:
        return "under-test", "under test"
    if k in allowed:
        return "under-test", "allowed difference"
    if k in NOT_FIXED:
        return "expected", "expected to differ"
    if a != b:
        return "diff", "differs"
    return "", ""


def fixed_table(result: Comparison, manifests: dict[str, Manifest | None]) -> str:
    """Key, control, treatment — differences red, variables under test blue, expected differences grey."""
    fv = result.fixed_variables
    under = set(fv.under_test)
    allowed = {d.key for d in fv.allowed_differences}
    differences = {d.key for d in fv.differences}
    control, treatment = manifests.get("control"), manifests.get("treatment")
    fc: dict[Any, Any] = dict(control.fixed) if control is not None else {}
    ft: dict[Any, Any] = dict(treatment.fixed) if treatment is not None else {}
    note = ""
    if not fc and not ft:  # no run directories: only what the result lists
        for d in [*fv.allowed_differences, *fv.differences]:
            fc.setdefault(d.key, d.control)
            ft.setdefault(d.key, d.treatment)
        note = '<p class="muted">Run directories not given: only the keys that differ are listed.</p>'
    keys = sorted({str(k) for k in fc} | {str(k) for k in ft} | under)
    if not keys:
        return '<p class="muted">No fixed variables recorded.</p>'
    rows = []
    for k in keys:
        a, b = fc.get(k), ft.get(k)
        cls, tag = _fixed_tag(k, a, b, differences, under, allowed)
        rows.append(f'<tr class="{cls}"><td><code>{esc(k)}</code></td><td>{esc(value_text(a))}</td>'
                    f"<td>{esc(value_text(b))}</td><td>{esc(tag)}</td></tr>")
    verdict = ('<p class="pass">Same caliber: every fixed variable matches except those under test.</p>'
               if fv.equal else
               '<p class="caution">Not the same caliber: fixed variables differ (red rows) — the verdict does not '
               "isolate the variable under test.</p>")
    return (verdict + note + '<table class="fixed"><thead><tr><th>key</th><th>control</th><th>treatment</th>'
            "<th></th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>")


def single_fixed_table(manifest: Manifest | None) -> str:
    """One run's fixed variables, those under test highlighted."""
    fixed = manifest.fixed if manifest is not None else {}
    if not fixed or manifest is None:
        return '<p class="muted">No fixed variables recorded.</p>'
    under = set(manifest.under_test)
    rows = [f'<tr class="{"under-test" if k in under else ""}"><td><code>{esc(k)}</code></td>'
            f"<td>{esc(value_text(v))}</td><td>{'under test' if k in under else ''}</td></tr>"
            for k, v in sorted(fixed.items(), key=lambda kv: str(kv[0]))]
    return ('<table class="fixed"><thead><tr><th>key</th><th>value</th><th></th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")
