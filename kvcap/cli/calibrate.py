"""`kvcap calibrate`: bench runs of one server → a scenario whose simulator reproduces it, and the fit table."""

from __future__ import annotations

import argparse

from kvcap.cli import common

EXAMPLES = """
examples:
  kvcap bench --url http://127.0.0.1:8000 --concurrency 1,2,4,8 --metrics-url http://127.0.0.1:8000/metrics \\
              --duration 30s --out runs/profile
  kvcap calibrate runs/profile --out calibrated.yaml --holdout 8
  kvcap sim calibrated.yaml --set serving.max_num_seqs=24 --concurrency 8,16,24 --out runs/what-if-24
"""


def register(sub: common.Subparsers) -> None:
    p = sub.add_parser(
        "calibrate", help="fit a scenario (step cost, slots, KV pool) to bench runs of a real server",
        description=common.doc("""
            Reads bench run directories of one server (closed-loop or open-loop levels; trace replays, whose
            schedule is rebuilt from their records and replayed as sent), fits the simulator's per-step cost
            (serving.step_cost: base, per_decode, per_prefill_token, per_context_token, per_request) and limits
            (serving.max_num_seqs, serving.kv_tokens: from the server where it says them — llama.cpp /props, vLLM
            cache_config_info, SGLang server info) — in closed form first, then refined by running the simulator on
            the measured levels — and writes an ordinary scenario file with a calibration: section (source runs,
            coefficients with standard errors, the fit table). Prints, per level, measured vs simulated throughput,
            TTFT and TPOT. Fewer than 2 levels, a run without successful requests, or a fit that does not converge:
            one line, exit 2, nothing written.
        """), epilog=EXAMPLES, formatter_class=common.formatter)
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="bench run directories of one server")
    p.add_argument("--out", required=True, metavar="SCENARIO.yaml", help="the calibrated scenario to write")
    p.add_argument("--engine", choices=("vllm", "llamacpp"),
                   help="scheduling profile (default: llamacpp if the server answered /props, else vllm)")
    p.add_argument("--kv-unified", action="store_true",
                   help="the llama.cpp server ran with --kv-unified (its /props does not say): a step is one "
                        "forward pass, not one per run of consecutive busy slots")
    p.add_argument("--holdout", metavar="LEVELS",
                   help="levels to leave out of the fit and report the prediction error on, e.g. 8 or 4,8; "
                        "'trace' holds out every trace replay, e.g. 8,trace")
    p.add_argument("--model", metavar="ID|config.json",
                   help="model, for what-ifs on memory arithmetic (with --gpu; default: kv_tokens only)")
    p.add_argument("--gpu", metavar="NAME", help="GPU preset, for what-ifs on memory arithmetic (with --model)")
    common.add_json_flag(p, help="print the result as JSON")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(a: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from kvcap.calibrate.output import render_table
    from kvcap.calibrate.pipeline import calibrate

    parts = [x.strip() for x in (a.holdout or "").split(",") if x.strip()]
    trace = "trace" in parts
    values = ",".join(x for x in parts if x != "trace")
    holdout = common.parse_levels(values, "--holdout", False) if values else ()
    result = calibrate(list(a.runs), Path(a.out), a.engine, holdout, a.model, a.gpu, holdout_trace=trace,
                       kv_unified=a.kv_unified)
    common.print_notes("calibrate", result)
    for limit in result["limits"]:
        print(f"kvcap calibrate: note: {limit}", file=sys.stderr)
    if a.json:
        common.print_json(result)
        return 0
    c = result["step_cost"]
    ms = {k: v["value_s"] * 1e3 for k, v in c.items()}
    render_table(result["table"], title=f"kvcap calibrate → {result['scenario']}")
    floor_text = f", at least {ms['floor']:.3f} ms" if ms.get("floor") else ""
    waiting_text = (f" + {ms['per_waiting'] * 1e3:.2f} µs/sequence/request waiting" if ms.get("per_waiting")
                    else "")
    print(f"step = {ms['base']:.3f} ms + {ms['per_decode']:.3f} ms/sequence + "
          f"{ms['per_prefill_token'] * 1e3:.2f} µs/prompt token + {ms['per_context_token'] * 1e3:.4f} µs/KV token"
          f"{waiting_text}{floor_text}; {result['slots']} slots ({result['slots_source']}); engine {result['engine']}")
    fe, he = result["fit_error"], result["holdout_error"]
    print(f"fit error (mean |%|): tok/s {fe['throughput']}, TPOT p50 {fe['tpot_p50']}, TTFT p50 {fe['ttft_p50']}")
    if he:
        print(f"held-out error (mean |%|): tok/s {he['throughput']}, TPOT p50 {he['tpot_p50']}, "
              f"TTFT p50 {he['ttft_p50']}")
    return 0
