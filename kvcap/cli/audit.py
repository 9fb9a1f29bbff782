"""`kvcap audit`: check a capacity table someone hands you against itself (and, given a model, against VRAM).

The checks live in kvcap.audit; this module only reads the flags, builds the optional capacity plan
for the VRAM check and prints the findings.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvcap.cli import common

AUDIT_EXAMPLES = """
examples:
  kvcap audit tests/data/article_table.csv --output-tokens 256 --slo ttft_p95=500ms,tpot_p95=80ms
  kvcap audit table.csv --output-tokens 256 --input-tokens 1024 --model llama-3.1-8b --gpu rtx4090 --nodes 4 \\
              --claimed-effective 16 --json
"""

SEVERITY_COLOURS = {"error": "red", "warn": "yellow", "info": "white"}


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser("audit", help="check a capacity table someone hands you for internal consistency",
                       description=common.doc("""
                           Reads a CSV (concurrency, output_tok_s, ttft_ms[, tpot_ms, output_tokens, arm, …]) and
                           checks it against itself: the TPOT its throughput implies, Little's law, scaling
                           efficiency, the SLO, and — with --model and --gpu/--gpu-mem — whether the claimed
                           concurrency is really VRAM-bound for that model.
                       """), epilog=AUDIT_EXAMPLES, formatter_class=common.formatter)
    p.add_argument("table", metavar="TABLE.csv")
    p.add_argument("--output-tokens", type=common.positive_int, help="output tokens per request (the table's cap)")
    p.add_argument("--input-tokens", type=common.positive_int, help="input tokens per request (for the VRAM check)")
    common.add_slo_flag(p, help="e.g. ttft_p95=500ms,tpot_p95=80ms")
    p.add_argument("--claimed-effective", type=float, help="the effective capacity the table's author claims")
    p.add_argument("--model", help="model preset or config.json, for the VRAM check")
    p.add_argument("--gpu", help="GPU preset, for the VRAM check")
    p.add_argument("--gpu-mem", metavar="SIZE", help="GPU memory, for the VRAM check")
    p.add_argument("--nodes", type=common.positive_int, help="nodes (one GPU each unless --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=common.positive_int)
    common.add_json_flag(p)
    p.set_defaults(func=cmd_audit)


def cmd_audit(a: argparse.Namespace) -> int:
    from kvcap.audit.across_levels import audit_table
    from kvcap.audit.table import read_table

    rows = read_table(a.table)
    plan_result = _vram_plan(a) if a.model else None
    result = audit_table(rows, output_tokens=a.output_tokens, input_tokens=a.input_tokens,
                         slo=common.optional_slo(a.slo), plan=plan_result, claimed_effective=a.claimed_effective)
    if a.json:
        common.print_json(result)
    else:
        _print_findings(result)
    return 0


def _vram_plan(a: argparse.Namespace) -> Any:
    """The capacity plan of the model and GPUs the flags name, for the check that the table is VRAM-bound."""
    from kvcap.plan import plan, resolve
    from kvcap.specs.scenario import load_scenario

    over: dict[str, Any] = {"model.preset": a.model} if not a.model.endswith(".json") else {"model.config": a.model}
    for key, val in (("cluster.gpu.preset", a.gpu), ("cluster.gpu.memory", a.gpu_mem), ("cluster.nodes", a.nodes),
                     ("cluster.gpus_per_node", a.gpus_per_node), ("workload.input_tokens", a.input_tokens),
                     ("workload.output_tokens", a.output_tokens)):
        if val is not None:
            over[key] = val
    return plan(resolve(load_scenario(None, over)))


def _print_findings(result: dict[str, Any]) -> None:
    from kvcap.report.console import make_console

    con = make_console()
    for f in result["findings"]:
        where = f"{f.get('arm') or ''} c={f.get('level')}".strip() if f.get("level") is not None else "table"
        colour = SEVERITY_COLOURS.get(f["severity"], "white")
        con.print(f"[{colour}]{f['severity']:5}[/] {where} · {f['check']}: {f['message']}")
    con.print(f"\n[bold]{result['summary']}[/bold]")
