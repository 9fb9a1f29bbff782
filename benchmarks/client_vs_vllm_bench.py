"""kvcap's load generator side by side with vLLM's own client (``vllm bench serve``) on one real vLLM (CPU build).

Both clients run the same closed loop — c concurrent users, fixed input and output lengths, a fixed number of
requests, ``ignore_eos`` — alternated for a number of rounds against one server (``tests.vllm_cpu``: the tiny
random-weights Llama). Before and after each run the server's ``/metrics`` are scraped, so every client figure
stands beside the server's own account of the same requests:

- **server TTFT mean** — ``vllm:time_to_first_token_seconds`` sum/count over the run: the referee. A client's
  mean TTFT minus it is that client's own share (HTTP, detokenisation, streaming, its event loop);
- **computed/prompt** — ``vllm:request_prefill_kv_computed_tokens`` over ``vllm:request_prompt_tokens``: how much
  of the prompts the engine really computed (the rest came from its prefix cache);
- **steps >512 tok** — engine steps that carried more than 512 tokens (``vllm:iteration_tokens_total``): with
  256-token prompts, steps that batched two or more prefills together — what users in lockstep make;
- **spread** — per request, how many other requests of the same run were sent within ``--near-ms`` of it: 0 when
  users are out of phase, c − 1 when they all start together.

``--vllm-seed fixed`` keeps vLLM's random dataset at its default seed (the same prompts every run, as a user who
does not pass ``--seed`` gets); ``per-round`` gives every round a new seed. ``--no-prefix-caching`` starts vLLM
without its prefix cache and ``--vllm-args "--temperature 0"`` makes vLLM's client ask for greedy decoding as
kvcap does: the same load from both clients.

    .venv/bin/python benchmarks/client_vs_vllm_bench.py [--rounds 4] [--blocks 2000] [--vllm-seed fixed|per-round]
        [--no-prefix-caching] [--vllm-args "--temperature 0"] [--url URL] [--out DIR] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.vllm_cpu import MODEL_NAME, VllmConfig, require_python, scrape, tiny_model, vllm_server  # noqa: E402

VLLM_BENCH = ("import sys\n"
              "from vllm.benchmarks.serve import add_cli_args, main\n"
              "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
              "p = FlexibleArgumentParser()\n"
              "add_cli_args(p)\n"
              "main(p.parse_args(sys.argv[1:]))\n")
"""``vllm bench serve`` without the console script (which fails in the ``vllm-cpu`` distribution: its version
lookup asks for a package named ``vllm``): the same ``add_cli_args`` and ``main`` the subcommand calls."""

SERVER_SERIES = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_prefill_kv_computed_tokens", "vllm:iteration_tokens_total",
                 "vllm:request_queue_time_seconds")
BIG_STEP = 512.0
"""An engine step above this many tokens carried two or more 256-token prefills."""


def server_state(metrics_url: str) -> dict[str, float]:
    """The sums and counts of :data:`SERVER_SERIES` (and the step histogram's bucket at :data:`BIG_STEP`)."""
    out: dict[str, float] = {}
    for line in scrape(metrics_url).splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        for series in SERVER_SERIES:
            if name in (series + "_sum", series + "_count"):
                out[name] = out.get(name, 0.0) + float(value)
            elif name == series + "_bucket" and series == "vllm:iteration_tokens_total" and \
                    f'le="{BIG_STEP}"' in labels:
                out["steps_le_big"] = out.get("steps_le_big", 0.0) + float(value)
    return out


def server_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def mean(series: str, scale: float = 1.0) -> float | None:
        n = d.get(series + "_count", 0.0)
        return d[series + "_sum"] / n * scale if n else None

    prompt = d.get("vllm:request_prompt_tokens_sum", 0.0)
    steps = d.get("vllm:iteration_tokens_total_count", 0.0)
    return {"requests": d.get("vllm:time_to_first_token_seconds_count"),
            "ttft_mean_ms": mean("vllm:time_to_first_token_seconds", 1e3),
            "itl_mean_ms": mean("vllm:inter_token_latency_seconds", 1e3),
            "tpot_mean_ms": mean("vllm:request_time_per_output_token_seconds", 1e3),
            "queue_mean_ms": mean("vllm:request_queue_time_seconds", 1e3),
            "computed_share": d.get("vllm:request_prefill_kv_computed_tokens_sum", 0.0) / prompt if prompt else None,
            "steps": steps, "big_steps": steps - d.get("steps_le_big", 0.0)}


def spread(starts: list[float], near_s: float) -> float:
    """Mean number of other requests sent within ``near_s`` of each request."""
    s = sorted(starts)
    return statistics.fmean(sum(1 for u in s if abs(u - t) <= near_s) - 1 for t in s) if s else 0.0


def run_kvcap(url: str, out: Path, a: argparse.Namespace, tag: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvcap", "bench", "--url", url, "--model", MODEL_NAME,
           "--concurrency", str(a.concurrency), "--requests", str(a.requests), "--input-tokens", str(a.input_tokens),
           "--output-tokens", str(a.output_tokens), "--warmup", "0s", "--out", str(out), "--quiet", "--overwrite",
           *a.kvcap_args]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=a.timeout_s,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"kvcap bench failed ({tag}): {p.stderr[-2000:]}")
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if r.get("phase") == "measure" and r["ok"]]
    summary = json.loads((out / "summary.json").read_text())
    level = summary["levels"][0]
    return {"n": len(recs), "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in recs),
            "ttft_mean_ms": statistics.fmean(r["ttft_ms"] for r in recs),
            "tpot_p50_ms": statistics.median(r["tpot_ms"] for r in recs),
            "tok_s": level["output_tok_s"], "spread": spread([r["start_s"] for r in recs], a.near_ms / 1e3),
            "send_delay_p50_ms": statistics.median(r["send_delay_ms"] for r in recs)}


def run_vllm_bench(url: str, out: Path, a: argparse.Namespace, seed: int, tag: str) -> dict[str, Any]:
    cmd = [str(require_python()), "-c", VLLM_BENCH, "--base-url", url, "--model", MODEL_NAME,
           "--tokenizer", str(tiny_model()), "--dataset-name", "random", "--random-input-len", str(a.input_tokens),
           "--random-output-len", str(a.output_tokens), "--num-prompts", str(a.requests),
           "--max-concurrency", str(a.concurrency), "--request-rate", "inf", "--ignore-eos", "--seed", str(seed),
           "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", "result.json",
           "--disable-tqdm", *a.vllm_args]
    out.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    (out / "stdout.txt").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({tag}): {(p.stdout + p.stderr)[-2000:]}")
    res = json.loads((out / "result.json").read_text())
    ttfts = [t * 1e3 for t, err in zip(res["ttfts"], res["errors"]) if not err]
    return {"n": res["completed"], "ttft_p50_ms": res["median_ttft_ms"], "ttft_mean_ms": statistics.fmean(ttfts),
            "tpot_p50_ms": res["median_tpot_ms"], "tok_s": res["output_throughput"],
            "spread": spread(res["start_times"], a.near_ms / 1e3), "send_delay_p50_ms": None}


def one_run(client: str, url: str, out: Path, a: argparse.Namespace, rnd: int) -> dict[str, Any]:
    before = server_state(url + "/metrics")
    t0 = time.monotonic()
    tag = f"{client} round {rnd}"
    if client == "kvcap":
        got = run_kvcap(url, out, a, tag)
    else:
        seed = 0 if a.vllm_seed == "fixed" else 1000 + rnd
        got = run_vllm_bench(url, out, a, seed, tag)
    srv = server_delta(before, server_state(url + "/metrics"))
    row = {"client": client, "round": rnd, "wall_s": round(time.monotonic() - t0, 1), **got,
           **{f"server_{k}": v for k, v in srv.items()}}
    print(f"  {tag}: TTFT p50 {got['ttft_p50_ms']:.1f} ms (server mean {srv['ttft_mean_ms'] or 0:.1f}), "
          f"TPOT p50 {got['tpot_p50_ms']:.2f} ms, {got['tok_s']:.0f} tok/s, computed {srv['computed_share'] or 0:.2f}"
          f", big steps {srv['big_steps']:.0f}/{srv['steps']:.0f}", file=sys.stderr, flush=True)
    return row


COLUMNS = (("TTFT p50", "ttft_p50_ms", "{:.1f}"), ("TTFT mean", "ttft_mean_ms", "{:.1f}"),
           ("server TTFT mean", "server_ttft_mean_ms", "{:.1f}"), ("client − server", "gap_ms", "{:+.1f}"),
           ("TPOT p50", "tpot_p50_ms", "{:.2f}"), ("server ITL mean", "server_itl_mean_ms", "{:.2f}"),
           ("tok/s", "tok_s", "{:.0f}"), ("computed/prompt", "server_computed_share", "{:.2f}"),
           ("steps >512 tok", "server_big_steps", "{:.0f}"), ("spread", "spread", "{:.2f}"))


def table(rows: list[dict[str, Any]]) -> str:
    """One line per client: the median over its rounds of each column (ms, tok/s)."""
    lines = ["| client | rounds | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---|---:|" + "---:|" * len(COLUMNS)]
    for client in dict.fromkeys(r["client"] for r in rows):
        mine = [{**r, "gap_ms": r["ttft_mean_ms"] - r["server_ttft_mean_ms"]} for r in rows if r["client"] == client]
        cells = []
        for _, key, fmt in COLUMNS:
            vals = [r[key] for r in mine if r.get(key) is not None]
            cells.append(fmt.format(statistics.median(vals)) if vals else "–")
        name = "vllm bench serve" if client == "vllm" else client
        lines.append(f"| {name} | {len(mine)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--clients", default="kvcap,vllm", help="the order within a round")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--input-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=2000,
                    help="vLLM's KV pool in 128-token blocks (enough to keep a run's prompts)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--no-prefix-caching", action="store_true", help="start vLLM with its prefix cache off")
    ap.add_argument("--vllm-seed", choices=("fixed", "per-round"), default="fixed")
    ap.add_argument("--near-ms", type=float, default=2.0, help="the window of the spread column")
    ap.add_argument("--kvcap-args", default="", help="more kvcap bench flags, one string")
    ap.add_argument("--vllm-args", default="", help="more vllm bench serve flags, one string")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None, help="keep every run here (default: a temp folder)")
    ap.add_argument("--json", action="store_true", help="print every run's row as JSON too")
    ap.add_argument("--url", default=None, help="a running vLLM serving the tiny model (default: start one)")
    a = ap.parse_args()
    a.kvcap_args, a.vllm_args = a.kvcap_args.split(), a.vllm_args.split()
    clients = a.clients.split(",")
    with tempfile.TemporaryDirectory(prefix="kvcap-vbench-") as tmp:
        base = a.out or Path(tmp)
        home = Path(tempfile.mkdtemp(prefix="kvvh-", dir=tmp))
        cfg = VllmConfig(blocks=a.blocks, max_num_seqs=a.max_num_seqs, max_model_len=2048,
                         extra_args=("--no-enable-prefix-caching",) if a.no_prefix_caching else ())
        rows: list[dict[str, Any]] = []
        with contextlib.nullcontext(a.url) if a.url else vllm_server(home, cfg) as url:
            for rnd in range(1, a.rounds + 1):
                for client in clients:
                    rows.append(one_run(client, url, base / f"r{rnd}-{client}", a, rnd))
    print(f"vLLM CPU, tiny-llama, {a.blocks} blocks, max_num_seqs {a.max_num_seqs}; c = {a.concurrency}, "
          f"{a.input_tokens} in / {a.output_tokens} out, {a.requests} requests, {a.rounds} rounds, vLLM seed "
          f"{a.vllm_seed}; medians over rounds (ms, tok/s)\n")
    print(table(rows))
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
