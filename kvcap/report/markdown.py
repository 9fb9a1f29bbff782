"""A short Markdown summary of a compare (or of one run) for pasting into a ticket or a pull request.

Verdict first, then the numbers behind it. Cells come from run data, so ``|`` is escaped (it would split a table
cell), newlines are folded, and ``<``/``>`` become entities so a hostile model name cannot inject HTML into
renderers that allow it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcap.analysis.slo import format_slo
from kvcap.analysis.summary import best_goodput_level
from kvcap.report.format import ARMS, VERDICT_MEANING, fmt, fmtm, level_name, pair, run_notes
from kvcap.rundir.compare import ArmResult, Comparison
from kvcap.rundir.summary import Finding, Summary


def md_escape(value: Any) -> str:
    """Text safe inside a Markdown table cell (and inline): no cell splits, no line breaks, no raw HTML."""
    text = "" if value is None else str(value)
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
    return " ".join(text.splitlines())


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[bool] | None = None) -> list[str]:
    right = right or [i > 0 for i in range(len(head))]
    out = ["| " + " | ".join(md_escape(h) for h in head) + " |",
           "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    out += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in rows]
    return out


def _signed(v: Any) -> str:
    return f"{v:+,.1f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "–"


def _percent(x: float | None) -> str:
    return "–" if x is None else f"{x:.1%}"


def _slo(ok: Any) -> str:
    return "–" if ok is None else "pass" if ok else "FAIL"


def _finding(d: Finding) -> str:
    text = (f"[{d.arm}] " if d.arm else "") + f"bounded by **{d.bound}**"
    if d.evidence:
        text += f" — {d.evidence}"
    if d.direction:
        text += f". → {d.direction}"
    return text


def _bullets(title: str, items: Sequence[str]) -> list[str]:
    if not items:
        return []
    return ["", f"**{title}**", *(f"- {md_escape(x)}" for x in items)]


def render_markdown(result: Comparison) -> str:
    """Verdict, the per-arm capacity table, goodput Δ with its CI, the per-level table, diagnosis and warnings."""
    verdict = result.verdict
    out = [f"### kvcap compare: **{md_escape(verdict)}**", "",
           md_escape(VERDICT_MEANING.get(verdict, "Unknown verdict.")), ""]

    def res(a: ArmResult) -> str:
        return fmt(a.resident) + (f" ({a.resident_source})" if a.resident_source else "")

    arm_results = [result.control, result.treatment]
    labels = [arm if (a.arm or arm) == arm else f"{arm} ({a.arm})" for arm, a in zip(ARMS, arm_results)]
    out += _table(["arm", "resident", "effective", "goodput tok/s (best level)", "stress limit", "limited by"],
                  [[lab, res(a), fmt(a.effective), f"{fmtm(a.goodput_tok_s)} @ {fmt(a.goodput_level)}",
                    fmt(a.stress_limit), fmt(a.limited_by)] for lab, a in zip(labels, arm_results)],
                  right=[False, True, True, True, True, False])
    g = result.goodput_gain
    ci = pair(g.ci95)
    noise = "beyond noise" if g.beyond_noise else "inside the noise"
    line = f"Goodput Δ **{_signed(g.delta_tok_s)} tok/s**, 95% CI [{_signed(ci[0])}, {_signed(ci[1])}] — {noise}."
    if result.efficiency is not None:
        line += f" Efficiency {fmt(result.efficiency)}."
    out += ["", line]
    if result.moved is not None:
        out += ["", f"Moved: {md_escape(result.moved.text)}."]
    fv = result.fixed_variables
    tested = [f"`{md_escape(d.key)}` {md_escape(d.control)} → {md_escape(d.treatment)}"
              for d in fv.allowed_differences]
    if tested:
        out += ["", "Under test: " + ", ".join(tested)]
    if not fv.equal:
        out += ["", "**Not the same caliber** — fixed variables differ: "
                + ", ".join(f"`{md_escape(d.key)}`" for d in fv.differences)]
    if result.slo:
        out += ["", f"SLO: {md_escape(format_slo(result.slo))}"]
    rows = []
    for r in result.per_level:
        tok, good = r.output_tok_s, r.goodput_tok_s
        ttft, tpot, ok = r.ttft_p95_ms, r.tpot_p95_ms, r.slo_ok
        ci = r.goodput_delta_ci95
        rows.append([level_name(r.mode, r.level), fmtm(tok[0]), fmtm(tok[1]), fmtm(good[0]),
                     fmtm(good[1]), f"[{_signed(ci[0])}, {_signed(ci[1])}]", fmtm(ttft[0]), fmtm(ttft[1]),
                     fmtm(tpot[0]), fmtm(tpot[1]), _slo(ok[0]), _slo(ok[1])])
    if rows:
        out += ["", *_table(["level", "tok/s C", "tok/s T", "goodput C", "goodput T", "Δ goodput 95% CI",
                             "TTFT p95 C ms", "TTFT p95 T ms", "TPOT p95 C ms", "TPOT p95 T ms", "SLO C", "SLO T"],
                            rows, right=[False] + [True] * 9 + [False, False])]
    out += _bullets("Treatment took effect", result.effect_evidence or [])
    out += _bullets("Diagnosis", [_finding(f) for f in result.diagnosis])
    summaries = result.summaries
    out += _bullets("Warnings", [*result.warnings, *(f"{arm}: {note}" for arm in ARMS if summaries is not None
                                                     for note in run_notes(getattr(summaries, arm)))])
    return "\n".join(out) + "\n"


def render_markdown_single(summary: Summary) -> str:
    """One run: capacities, then the per-level table, diagnosis and warnings."""
    cap = summary.capacity
    best = best_goodput_level(summary.levels)
    out = [f"### kvcap run{': ' + md_escape(summary.arm) if summary.arm else ''}", ""]
    out += _table(["resident", "effective", "goodput tok/s (best level)", "stress limit", "limited by"],
                  [[fmt(cap.resident) + (f" ({cap.resident_source})" if cap.resident_source else ""),
                    fmt(cap.effective),
                    f"{fmtm(best.goodput_tok_s)} @ {fmt(best.level)}" if best else "–",
                    fmt(cap.stress_limit), fmt(cap.limited_by)]],
                  right=[True, True, True, True, False])
    if summary.slo:
        out += ["", f"SLO: {md_escape(format_slo(summary.slo))}"]
    rows = [[level_name(lv.mode, lv.level), fmtm(lv.output_tok_s), fmtm(lv.goodput_tok_s),
             fmtm(lv.ttft_ms.p95), fmtm(lv.tpot_ms.p95),
             _slo(lv.slo_ok) + ("" if lv.slo_ok or not lv.failed_checks else " " + ", ".join(lv.failed_checks))]
            for lv in summary.levels]
    head = ["level", "tok/s", "goodput", "TTFT p95 ms", "TPOT p95 ms", "SLO"]
    right = [False, True, True, True, True, False]
    if any(lv.prefix_reuse is not None for lv in summary.levels):  # hit rates per tier beside TTFT
        head, right = [*head, "HBM hit %", "tier hit %"], [*right, True, True]
        for row, lv in zip(rows, summary.levels):
            r = lv.prefix_reuse
            row += [_percent(r.hbm_hit_rate if r else None), _percent(r.tier_hit_rate if r else None)]
    if rows:
        out += ["", *_table(head, rows, right=right)]
    out += _bullets("Diagnosis", [_finding(f) for f in summary.diagnosis])
    client = summary.client.warnings if summary.client is not None else []
    out += _bullets("Warnings", [*client, *run_notes(summary)])
    return "\n".join(out) + "\n"
