"""`kvcap bench` against a REAL llama.cpp server (built by scripts/install-llama-server) serving a tiny
random-weights GGUF the test writes: kvcap's figures checked against llama.cpp's own counters."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcap.rundir import RunDir
from tests.conftest import run_cli
from tests.llamacpp import llama_server
from tests.tiny_gguf import write_tiny_llama_gguf

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _counter_at(series: list[tuple[float, float]], t: float) -> float:
    ts, vs = np.array([s[0] for s in series]), np.array([s[1] for s in series])
    return float(np.interp(t, ts, vs))


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bench_llamacpp_matches_its_own_counters(gguf, tmp_path, api):
    out = tmp_path / "run"
    with llama_server(gguf, parallel=8, ctx_size=8 * 512) as url:
        p = run_cli("bench", "--url", url, "--api", api, "--out", str(out), "--quiet", "--json",
                    "--concurrency", "1,4,8", "--input-tokens", "48", "--output-tokens", "24", "--warmup", "1s",
                    "--duration", "5s", "--metrics-url", url + "/metrics", "--extra-body",
                    '{"cache_prompt": false}', timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout)
    run = RunDir(out)
    recs = run.records()
    assert recs and all(r["ok"] for r in recs), [r.get("error_detail") for r in recs if not r["ok"]][:3]
    assert all(r["output_tokens"] == 24 and r["tokens_source"] == "usage" for r in recs)
    assert run.manifest.server["engine"] == "llama.cpp"
    tel = run.telemetry()
    predicted = sorted((t["t_s"], t["value"]) for t in tel if t["labels"]["raw"] == "llamacpp:tokens_predicted_total")
    assert len(predicted) >= 10
    # every token kvcap counted, llama.cpp counted too (its counter moves when a request finishes)
    assert predicted[-1][1] - predicted[0][1] == sum(r["output_tokens"] for r in recs)
    running = [t["value"] for t in tel if t["name"] == "server.requests_running"]
    assert max(running) <= 8
    infos = {i.level: i for i in run.levels()}
    for lv in summary["levels"]:
        info = infos[lv["level"]]
        t0, t1 = info.measure_start_s, info.measure_end_s
        server_rate = (_counter_at(predicted, t1) - _counter_at(predicted, t0)) / (t1 - t0)
        assert lv["output_tok_s"] == pytest.approx(server_rate, rel=0.05), (lv["level"], server_rate)
        assert lv["ttft_ms"]["p50"] > 0 and lv["tpot_ms"]["p50"] > 0
    tps = [lv["output_tok_s"] for lv in summary["levels"]]
    assert tps[2] > tps[0]  # more streams, more tokens per second from 8 slots


def test_llamacpp_error_inside_200_stream_is_classified(gguf, tmp_path):
    # a unified KV pool of 256 tokens shared by 4 slots runs out mid-generation: llama.cpp then ends every
    # in-flight stream with data: {"error": …} in an HTTP 200 and no [DONE]
    out = tmp_path / "run"
    with llama_server(gguf, parallel=4, ctx_size=256, extra_args=("--kv-unified",)) as url:
        p = run_cli("bench", "--url", url, "--out", str(out), "--quiet", "--json", "--concurrency", "4",
                    "--input-tokens", "20", "--output-tokens", "120", "--warmup", "0s", "--requests", "8",
                    "--extra-body", '{"cache_prompt": false}', timeout=120)
    lv = json.loads(p.stdout)["levels"][0]
    assert p.returncode == (0 if lv["ok"] else 1), p.stderr[-2000:]  # not one success: exit 1 (test_dead_endpoint)
    assert lv["error_classes"].get("server_error_in_stream", 0) >= 1, lv["error_classes"]
    bad = [r for r in RunDir(out).records() if r["error"] == "server_error_in_stream"]
    assert all(r["status"] == 200 and "Context size" in r["error_detail"] for r in bad)


def test_bench_llamacpp_input_length_is_the_servers_count(gguf, tmp_path):
    # llama.cpp's tokenizer (the tiny model's vocabulary) is not kvcap's word rule: before calibration it counted
    # prompts of `--input-tokens 40` as 61-77 tokens; now kvcap asks its /tokenize (chat: /apply-template first)
    with llama_server(gguf, parallel=4, ctx_size=4 * 512) as url:
        for api in ("completions", "chat"):
            out = tmp_path / api
            p = run_cli("bench", "--url", url, "--api", api, "--out", str(out), "--quiet", "--concurrency", "2",
                        "--input-tokens", "40", "--output-tokens", "4", "--warmup", "0s", "--requests", "8",
                        "--extra-body", '{"cache_prompt": false}', timeout=120)
            assert p.returncode == 0, p.stderr[-2000:]
            run = RunDir(out)
            counted = [r["input_tokens"] for r in run.records() if r["ok"]]  # usage.prompt_tokens
            assert len(counted) == 8
            assert np.mean(counted) == pytest.approx(40, rel=0.02), (api, counted)
            lengths = run.manifest.server["input_lengths"]
            assert lengths["method"] == "tokenize:llama.cpp" and lengths["multi_token_words"] > 0, lengths
            assert run.manifest.fixed["workload.input_tokens_measured"] == pytest.approx(40, rel=0.02)
