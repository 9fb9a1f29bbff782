"""Input lengths are the server's count (issue 11 item 1): `kvcap bench --input-tokens N` sizes its prompts by how
the server tokenizes them, records what the server counted, warns when that is off, and `compare` judges the
measured lengths. Real HTTP over loopback to the project's test server, which can count a second way (``chars4``:
a word of n characters is ⌈n/4⌉ tokens, plus a fixed overhead as a BOS token or chat template adds) — the truth."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from kvcap.loadgen.client import Target
from kvcap.loadgen.lengths import ServerCounts, word_costs
from kvcap.rundir import RunDir
from kvcap.specs.lengths import parse_length
from kvcap.workload.prompts import PromptFactory
from kvcap.workload.words import WORDS
from tests.conftest import run_cli
from tests.servers import start_fake_server

CHARS4 = {"tokenizer": "chars4", "prompt_overhead": 3}
"""A server that counts unlike kvcap's word rule, and adds 3 tokens to every prompt."""
SMALL = ("--output-tokens", "3", "--warmup", "0s", "--quiet", "--json")


def bench(url: str, out, *args: str) -> tuple[dict, str]:
    p = run_cli("bench", "--url", url, "--out", str(out), *SMALL, *args, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout), p.stderr


@pytest.mark.parametrize("api", ["completions", "chat"])
@pytest.mark.parametrize("tokenize", [True, False], ids=["tokenize", "usage-probe"])
def test_server_counts_the_asked_length(tmp_path, api, tokenize):
    # before: prompts of 40 words (one a hex nonce) → this server counted ≈ 50-55 tokens, the manifest said 40
    with start_fake_server(ttft="2ms", itl="1ms", no_tokenize=not tokenize, **CHARS4) as srv:
        summary, err = bench(srv.url, tmp_path / "run", "--api", api, "--concurrency", "2", "--input-tokens", "40",
                             "--requests", "8")
        started = srv.stats()["requests_started"]
    run = RunDir(tmp_path / "run")
    recs = run.records()
    assert len(recs) == 8 and all(r["ok"] for r in recs)
    assert [r["input_tokens"] for r in recs] == [40] * 8  # usage.prompt_tokens: exact, not within 2%
    fixed, lengths = run.manifest.fixed, run.manifest.server["input_lengths"]
    assert fixed["workload.input_tokens"] == "40" and fixed["workload.input_tokens_measured"] == 40.0
    assert lengths["method"] == ("tokenize" if tokenize else "usage") and lengths["checked"] is True
    assert lengths["overhead_tokens"] == 3 and lengths["mean_error_pct"] == 0 and lengths["max_abs_error_tokens"] == 0
    assert lengths["multi_token_words"] == sum(1 for w in WORDS if len(w) > 4)
    assert summary["warnings"] == [] and "warning" not in err
    # /tokenize costs no generation; without it the probes are real requests (max_tokens=1), said in the count
    assert (started == 8) if tokenize else (started > 8)


@pytest.mark.parametrize("tokenize", [True, False], ids=["tokenize", "usage-probe"])
def test_word_costs_are_the_servers(tokenize):
    truth = tuple(math.ceil(len(w) / 4) for w in WORDS)

    async def measure(url: str) -> tuple[int, ...] | None:
        async with ServerCounts(Target(url=url)) as ask:
            count = ask.vllm_tokenize if tokenize else ask.usage
            return await word_costs(count)

    with start_fake_server(ttft="1ms", itl="1ms", no_tokenize=not tokenize, **CHARS4) as srv:
        assert asyncio.run(measure(srv.url)) == truth


def test_a_length_distribution_is_met_request_by_request(tmp_path):
    with start_fake_server(ttft="2ms", itl="1ms", **CHARS4) as srv:
        bench(srv.url, tmp_path / "run", "--concurrency", "4", "--input-tokens", "uniform:20,300", "--requests", "24",
              "--prefix-tokens", "16", "--prefix-groups", "2", "--seed", "5")
    asked = PromptFactory(seed=5, input_dist=parse_length("uniform:20,300"), output_dist=parse_length(3),
                          prefix_tokens=16, prefix_groups=2)
    recs = RunDir(tmp_path / "run").records()
    assert len(recs) == 24
    # each prompt is its group's 16-token prefix plus its own drawn length, as the server counts them
    assert all(r["input_tokens"] == 16 + asked.body(r["index"])[1] == asked.request(r["index"]).input_tokens
               for r in recs)


def test_workers_get_the_calibration(tmp_path):
    with start_fake_server(ttft="2ms", itl="1ms", **CHARS4) as srv:
        bench(srv.url, tmp_path / "run", "--workers", "2", "--concurrency", "4", "--input-tokens", "64",
              "--requests", "12")
    recs = RunDir(tmp_path / "run").records()
    assert {r["worker"] for r in recs} == {0, 1} and {r["input_tokens"] for r in recs} == {64}


def test_lengths_the_server_could_not_be_asked_about_are_flagged(tmp_path):
    # the only request that could have told (the first, the usage probe) fails: kvcap falls back to one word one
    # token, and the run's records (usage) show the server counted more — on stderr and in the summary
    with start_fake_server(ttft="2ms", itl="1ms", no_tokenize=True, fault=["http_500:every=100000"],
                           **CHARS4) as srv:
        summary, err = bench(srv.url, tmp_path / "run", "--concurrency", "2", "--input-tokens", "40",
                             "--requests", "8")
    run = RunDir(tmp_path / "run")
    assert run.manifest.server["input_lengths"] == {"method": None, "counter": "words", "checked": False}
    assert run.manifest.fixed["workload.input_tokens_measured"] is None
    measured = sum(r["input_tokens"] for r in run.records()) / 8
    assert measured > 40 * 1.05
    assert len(summary["warnings"]) == 1 and "+" in summary["warnings"][0] and "asked 40" in summary["warnings"][0]
    assert "kvcap bench: warning: input length" in err


def test_compare_judges_measured_lengths(tmp_path):
    def arm(name: str, **server: object) -> str:
        with start_fake_server(ttft="2ms", itl="1ms", **server) as srv:
            bench(srv.url, tmp_path / name, "--concurrency", "2", "--input-tokens", "40", "--requests", "8")
        return str(tmp_path / name)

    words = arm("words")
    chars4 = arm("chars4", **CHARS4)  # another tokenizer, sized to it: the same caliber for real
    p = run_cli("compare", words, chars4, "--json")
    assert p.returncode == 0, p.stderr
    lengths = json.loads(p.stdout)["input_lengths"]
    assert lengths["control"]["records_mean"] == lengths["treatment"]["records_mean"] == 40
    # the same asked length, but the server of this arm could not be asked: its prompts were longer to it
    blind = arm("blind", no_tokenize=True, fault=["http_500:every=100000"], **CHARS4)
    p = run_cli("compare", words, blind)
    assert p.returncode == 3 and "requests.input_tokens_mean: 40.0 vs" in p.stderr, p.stderr
    p = run_cli("compare", words, blind, "--allow-diff", "requests.input_tokens_mean")
    assert p.returncode == 0, p.stderr


def test_local_input_lengths_skip_the_servers_count(tmp_path):
    # --input-lengths local: prompts by kvcap's word rule, nothing asked of the server, and the gap shows
    with start_fake_server(ttft="2ms", itl="1ms", **CHARS4) as srv:
        summary, _ = bench(srv.url, tmp_path / "run", "--concurrency", "2", "--input-tokens", "40",
                             "--requests", "8", "--input-lengths", "local")
        started = srv.stats()["requests_started"]
    run = RunDir(tmp_path / "run")
    assert run.manifest.server["input_lengths"]["method"] == "off"
    assert started == 8
    assert sum(r["input_tokens"] for r in run.records()) / 8 > 40 * 1.05
    assert len(summary["warnings"]) == 1
