"""`kvcap calibrate` on a REAL llama.cpp server (issue 12): fit on ``--parallel 4`` at c = 1, 2, 4, then predict
``--parallel 8`` (twice the context) at c = 4, 8 and compare with what `kvcap bench` measures on that server.

The model is the tests' random-weights GGUF, made a little larger (4 layers, width 256) so that a decode step
takes milliseconds: with the 2-layer default a step is ~0.2 ms and the client's own per-token work (SSE parsing
on a shared 2-core machine, send delays up to 10 ms measured) is as large as the server's, which no server model
should absorb.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.llamacpp import llama_server
from tests.tiny_gguf import write_tiny_llama_gguf

pytestmark = pytest.mark.llamacpp

SHAPE = {"n_layers": 4, "hidden": 256, "n_heads": 4, "n_kv_heads": 2, "ff": 768}
CTX_PER_SLOT = 512
LENGTHS = ("--input-tokens", "48", "--output-tokens", "32")
NO_CACHE = ("--extra-body", '{"cache_prompt": false}')
TOLERANCE = 0.15


def bench(url: str, out: Path, levels: str) -> dict:
    p = run_cli("bench", "--url", url, "--out", str(out), "--quiet", "--json", "--metrics-url", url + "/metrics",
                *NO_CACHE, *LENGTHS, "--concurrency", levels, "--warmup", "1s", "--duration", "4s", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return {lv["level"]: lv for lv in json.loads(p.stdout)["levels"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The profile (--parallel 4) and the server to predict (--parallel 8), each benched once."""
    root = tmp_path_factory.mktemp("cal-llamacpp")
    gguf = write_tiny_llama_gguf(root / "tiny.gguf", **SHAPE)
    with llama_server(gguf, parallel=4, ctx_size=4 * CTX_PER_SLOT) as url:
        bench(url, root / "p4", "1,2,4")
    with llama_server(gguf, parallel=8, ctx_size=8 * CTX_PER_SLOT) as url:
        measured = bench(url, root / "p8", "4,8")
    scenario = root / "calibrated.yaml"
    p = run_cli("calibrate", str(root / "p4"), "--out", str(scenario), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    return {"root": root, "scenario": scenario, "fit": json.loads(p.stdout), "measured": measured}


def test_calibrate_takes_slots_and_kv_pool_from_the_servers_props(runs):
    fit = runs["fit"]
    assert fit["engine"] == "llamacpp"
    assert fit["slots"] == 4 and fit["slots_source"] == "server /props total_slots"
    assert fit["kv_tokens"] == 4 * CTX_PER_SLOT  # /props n_ctx per slot × total_slots = --ctx-size
    assert all(v["value_s"] >= 0 for v in fit["step_cost"].values())


@pytest.mark.xfail(strict=False, reason="issue 12 open: the decode step is not linear in the batch on this CPU "
                   "build (slots pinned with id_slot, 200-token decodes: 0.65 ms for one sequence, 2.0 ms for two in "
                   "adjacent slots, 1.25 ms for slots 0 and 7 — llama.cpp's split KV puts only consecutive slot ids "
                   "in one ubatch — 3.2 ms for four, 5.2 ms for eight), so a line fitted on c = 1, 2, 4 misses c = 8 "
                   "(TPOT p50 +19%, throughput -16%); and interleaved benches of one server differ by up to 24% on "
                   "this shared 2-core machine")
def test_calibrated_llamacpp_predicts_twice_the_slots_within_15pct(runs):
    sim = run_cli("sim", str(runs["scenario"]), "--set", "serving.max_num_seqs=8",
                  "--set", f"serving.kv_tokens={8 * CTX_PER_SLOT}", "--concurrency", "4,8", *LENGTHS,
                  "--out", str(runs["root"] / "sim8"), "--quiet", "--json")
    assert sim.returncode == 0, sim.stderr[-2000:]
    predicted = {lv["level"]: lv for lv in json.loads(sim.stdout)["levels"]}
    for c in (4, 8):
        p, m = predicted[c], runs["measured"][c]
        assert p["output_tok_s"] == pytest.approx(m["output_tok_s"], rel=TOLERANCE), c
        assert p["tpot_ms"]["p50"] == pytest.approx(m["tpot_ms"]["p50"], rel=TOLERANCE), c
