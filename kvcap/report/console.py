"""Terminal tables (rich) for command results."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kvcap.plan import PlanResult
from kvcap.report.format import MODE_PREFIX
from kvcap.rundir.compare import Comparison
from kvcap.rundir.summary import Percentiles, Summary
from kvcap.units import format_bandwidth, format_size


def make_console() -> Console:
    """A console at least 160 columns wide when output is not a terminal (tables stay readable in files)."""
    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 160))
    return con


def _int(n: float) -> str:
    return f"{n:,.0f}"


def render_plan(r: PlanResult, console: Console | None = None) -> None:
    """The plan as two tables (memory per GPU; residency per tier) plus rates, links, assumptions, warnings."""
    con = console or make_console()
    title = (f"{r.model} ({r.attention_kind}, {r.num_parameters / 1e9:.2f} B params, weights {r.weights_dtype}, "
             f"KV {r.kv_dtype}) on {r.nodes} node(s) × {r.gpus_per_node} {r.gpu}")
    con.print(f"[bold]{title}[/bold]")
    if not r.fits:
        _render_fit_options(r, con)
    mem = Table(show_header=True)
    mem.add_column("per GPU")
    mem.add_column("value", justify="right")
    rows = [
        ("GPU memory", format_size(r.gpu_memory_bytes)),
        (f"× utilization {r.gpu_memory_utilization:g}", format_size(r.gpu_memory_bytes * r.gpu_memory_utilization)),
        (f"− weights (tp={r.tensor_parallel}, pp={r.pipeline_parallel})", format_size(r.weights_bytes_per_gpu)),
        ("− activation peak", format_size(r.activation_peak_bytes_per_gpu)),
        ("− runtime overhead", format_size(r.runtime_overhead_bytes_per_gpu)),
        ("− reserve", format_size(r.reserve_bytes_per_gpu)),
        ("= usable for KV", format_size(r.usable_kv_bytes_per_gpu)),
        ("KV bytes per token (all layers, this GPU)", f"{_int(r.kv_bytes_per_token_per_gpu)} B"),
        (f"KV blocks of {r.block_size} tokens", _int(r.kv_blocks_per_gpu)),
        ("KV tokens", _int(r.kv_tokens_per_gpu)),
        (f"KV per request ({r.tokens_per_request} tokens)", format_size(r.kv_bytes_per_request_per_gpu)),
    ]
    for k, v in rows:
        mem.add_row(k, v)
    con.print(mem)

    tiers = Table(title="Resident requests (all KV of a request in one tier)", title_justify="left")
    tiers.add_column("tier")
    tiers.add_column("KV capacity", justify="right")
    tiers.add_column("requests", justify="right")
    tiers.add_column("per GPU", justify="right")
    tiers.add_column("reached over")
    for t in r.tiers:
        tiers.add_row(t.name, format_size(t.capacity_bytes), _int(t.requests), f"{t.requests / r.gpus:.1f}",
                      t.link or "local HBM")
    tiers.add_row("total", "", _int(r.resident_requests["total"]),
                  f"{r.resident_requests['total'] / r.gpus:.1f}", "", style="bold")
    con.print(tiers)
    con.print(f"Only the [bold]{r.resident_requests['hbm']}[/bold] HBM-resident requests can decode at once; "
              "the others are parked and must be swapped back before each of their decode turns.")

    if r.rate is not None:
        con.print(f"\nRate {r.rate:g} req/s → input {_int(r.input_tok_s or 0)} tok/s, "
                  f"output {_int(r.output_tok_s or 0)} tok/s")
        if r.active_sequences is not None:
            con.print(f"Little's law: {r.rate:g} req/s × {r.response_time_s:g} s = "
                      f"{r.active_sequences:.1f} sequences in flight")
    if r.links:
        links = Table(title=f"Link budget to bring parked sequences back ({r.in_flight:g} in flight: "
                            f"{r.in_flight_source})", title_justify="left")
        for col in ("tier", "link", "parked per link", "swap-in needs ≥", "capacity", "use", "decode in place"):
            links.add_column(col, justify="left" if col in ("tier", "link") else "right")
        for b in r.links:
            links.add_row(b.tier, b.link_name, f"{b.parked_per_link:.1f}", format_bandwidth(b.required_bytes_s),
                          format_bandwidth(b.capacity_bytes_s), f"{b.utilization:.0%}",
                          f"{b.decode_in_place_s_per_step * 1e3:.0f} ms/step")
        con.print(links)
    con.print("\n[bold]Assumptions[/bold]")
    for a in r.assumptions:
        con.print(f"  • {a}")
    if r.warnings:
        con.print("\n[bold yellow]Warnings[/bold yellow]")
        for w in r.warnings:
            con.print(f"  [yellow]![/yellow] {w}")


def _render_fit_options(r: PlanResult, con: Console) -> None:
    """Does not fit: why, and the smallest parallelism per weights dtype that would (and what it then holds)."""
    con.print(f"[bold red]Does not fit:[/bold red] {r.fit_problem}")
    con.print(f"KV per token {_int(r.kv_bytes_per_token)} B (all layers); per request of {r.tokens_per_request} "
              f"tokens {format_size(r.kv_bytes_per_request)}")
    if not r.fit_options:
        con.print("No tensor/pipeline parallelism fits at these weights dtypes on this GPU.")
        return
    t = Table(title=f"What fits on {r.gpu} ({format_size(r.gpu_memory_bytes)}): smallest tp and pp per weights "
                    "dtype", title_justify="left")
    cols = ("weights", "tp", "pp", "GPUs per replica", "weights per GPU", "left for KV per GPU",
            "KV tokens per replica", "requests per replica", f"replicas on {r.gpus} GPU(s)")
    for col in cols:
        t.add_column(col, justify="left" if col == "weights" else "right")
    for o in r.fit_options:
        t.add_row(o.weights_dtype, str(o.tp), str(o.pp), str(o.gpus), format_size(o.weights_bytes_per_gpu),
                  format_size(o.usable_kv_bytes_per_gpu), _int(o.kv_tokens_per_replica), _int(o.requests_per_replica),
                  str(o.replicas_on_cluster))
    con.print(t)


def _ms(d: Percentiles, q: str) -> str:
    v = getattr(d, q)
    return "–" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def render_levels(summary: Summary, console: Console | None = None, title: str = "Per-level results") -> None:
    """One row per level: counts, throughput, TTFT/TPOT/ITL/E2E p50/p95/p99, queue, SLO verdict.

    On a narrow terminal (< 140 columns) only p50/p95 of TTFT, TPOT and E2E are shown (summary.json has them all).
    """
    con = console or make_console()
    wide = con.width >= 140
    qs = ("p50", "p95", "p99") if wide else ("p50", "p95")
    metrics = ("ttft", "tpot", "itl", "e2e") if wide else ("ttft", "tpot", "e2e")
    t = Table(title=title, title_justify="left")
    q_label = "/".join(q.lstrip("p") for q in qs)
    cols = ["level", "req", "ok", "err", "out tok/s", *[f"{m.upper()} p{q_label} ms" for m in metrics]]
    cols += ["queue p95", "SLO"] if wide else ["SLO"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("level", "SLO") else "right")
    for lv in summary.levels:
        mode = MODE_PREFIX.get(lv.mode, lv.mode)
        level = f"{mode}={lv.level:g}"
        if lv.achieved_rate is not None:
            level += f" (got {lv.achieved_rate:.2f}/s)"
        trio = ["/".join(_ms(getattr(lv, f"{m}_ms"), q) for q in qs) for m in metrics]
        slo = "–" if not summary.slo else ("pass" if lv.slo_ok else "FAIL " + ",".join(lv.failed_checks))
        row = [level, str(lv.requests), str(lv.ok), str(lv.errors), f"{lv.output_tok_s:.1f}", *trio]
        row += [_ms(lv.queue_ms, "p95"), slo] if wide else [slo]
        t.add_row(*row)
    con.print(t)
    errs = {k: v for lv in summary.levels for k, v in lv.error_classes.items()}
    if errs:
        con.print("errors by class: " + ", ".join(f"{k} {v}" for k, v in sorted(errs.items())))
    cap = summary.capacity
    if summary.slo:
        con.print(f"effective capacity {cap.effective} · stress limit {cap.stress_limit} · resident "
                  f"{cap.resident}{'+ (lower bound)' if cap.resident_lower_bound else ''} "
                  f"({cap.resident_source or 'no telemetry'})"
                  + (f" · limited by {cap.limited_by}" if cap.limited_by else ""))
    for d in summary.diagnosis:
        con.print(f"bounded by [bold]{d.bound}[/bold] — {d.evidence}. → {d.direction}")
    for w in summary.client.warnings if summary.client is not None else []:
        con.print(f"[yellow]! {w}[/yellow]")
    if summary.interrupted:
        con.print("[yellow]interrupted: the summary covers the requests that finished[/yellow]")


def render_compare(result: Comparison, console: Console | None = None) -> None:
    """Verdict first, then the three numbers per arm, then the per-level differences."""
    con = console or make_console()
    colour = {"performance-scaling": "green", "performance-only": "green", "capacity-only": "yellow",
              "no-gain": "white", "regression": "red"}[result.verdict]
    con.print(f"[bold {colour}]verdict: {result.verdict}[/bold {colour}]")
    t = Table(title_justify="left")
    for col in ("", "control", "treatment"):
        t.add_column(col, justify="left" if not col else "right")
    c, tr = result.control, result.treatment
    t.add_row("resident", f"{c.resident} ({c.resident_source})", f"{tr.resident} ({tr.resident_source})")
    t.add_row("effective", str(c.effective), str(tr.effective))
    t.add_row("stress limit", str(c.stress_limit), str(tr.stress_limit))
    t.add_row("goodput tok/s (best level)", f"{c.goodput_tok_s:.1f} @ {c.goodput_level}",
              f"{tr.goodput_tok_s:.1f} @ {tr.goodput_level}")
    t.add_row("limited by", str(c.limited_by), str(tr.limited_by))
    con.print(t)
    g = result.goodput_gain
    con.print(f"goodput Δ {g.delta_tok_s:+.1f} tok/s, 95% CI [{g.ci95[0]:+.1f}, {g.ci95[1]:+.1f}] — "
              + ("beyond noise" if g.beyond_noise else "inside the noise"))
    if result.moved is not None:
        con.print(f"moved: {result.moved.text}")
    if result.efficiency is not None:
        con.print(f"efficiency (Δ goodput % / Δ effective %): {result.efficiency:.2f}")
    for line in result.effect_evidence or []:
        con.print(f"treatment took effect: {line}")
    lv = Table(title="Per level (control → treatment)", title_justify="left")
    parked = any(any(v for v in row.server_parked_max) for row in result.per_level)
    for col in ("level", "out tok/s", "goodput tok/s", "Δ goodput CI95", "TTFT p95 ms", "TPOT p95 ms", "SLO",
                "server running max") + (("parked max",) if parked else ()):
        lv.add_column(col, justify="right" if col != "level" else "left")

    def pair(x: list[Any], fmt: str = "{:.0f}") -> str:
        return " → ".join("–" if v is None else fmt.format(v) for v in x)

    for row in result.per_level:
        lv.add_row(str(row.level), pair(row.output_tok_s, "{:.1f}"), pair(row.goodput_tok_s, "{:.1f}"),
                   f"[{row.goodput_delta_ci95[0]:+.1f}, {row.goodput_delta_ci95[1]:+.1f}]",
                   pair(row.ttft_p95_ms), pair(row.tpot_p95_ms, "{:.1f}"),
                   " → ".join("pass" if x else "fail" for x in row.slo_ok), pair(row.server_running_max),
                   *((pair([v or 0 for v in row.server_parked_max]),) if parked else ()))
    con.print(lv)
    for d in result.diagnosis:
        con.print(f"[bold]{d.arm}[/bold]: bounded by [bold]{d.bound}[/bold] — {d.evidence}. → {d.direction}")
    for diff in result.fixed_variables.allowed_differences:
        con.print(f"differs (allowed): {diff.key}: {diff.control!r} → {diff.treatment!r}")
    for w in result.warnings:
        con.print(f"[yellow]! {w}[/yellow]")
