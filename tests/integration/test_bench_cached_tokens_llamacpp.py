"""``bench`` against a REAL llama.cpp server (scripts/install-llama-server) serving a tiny GGUF the test writes:
its records carry llama.cpp's own count of prompt tokens reused from the slot's cache, and ``compare`` takes more
of them in the treatment as the sign that the treatment (the prompt cache) took effect.

What llama.cpp does with one prompt sent again on its one slot (the test reads it from a direct request): it finds
the whole prompt in the slot but evaluates the last token again, so ``timings.cache_n`` and
``usage.prompt_tokens_details.cached_tokens`` are both the prompt's tokens − 1.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvcap.rundir import RunDir
from kvcap.workload.prompts import LEAD
from tests.conftest import run_cli
from tests.llamacpp import llama_server
from tests.tiny_gguf import words_prompt, write_tiny_llama_gguf

pytestmark = pytest.mark.llamacpp

REQUESTS, OUTPUT = 6, 4


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def one_prompt(tmp_path: Path) -> tuple[str, Path]:
    """A dataset of one prompt: every request ``bench`` sends is the same."""
    prompt = words_prompt(40)
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": prompt}) + "\n")
    return prompt, path


def last_usage_and_timings(url: str, api: str, prompt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One streamed request as ``bench`` sends it, read without kvcap: the last usage and timings it carried."""
    body: dict[str, Any] = {"max_tokens": OUTPUT, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        raw = resp.read().decode()
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    for event in raw.split("\n\n"):
        if event.startswith("data:") and event[5:].strip() != "[DONE]":
            obj = json.loads(event[5:])
            usage = obj.get("usage") or usage
            timings = obj.get("timings") or timings
    return usage, timings


def bench(url: str, api: str, dataset: Path, out: Path, *extra: str) -> None:
    """One level of ``REQUESTS`` requests, one at a time, each the dataset's prompt as it is (no unique tag)."""
    proc = run_cli("bench", "--url", url, "--api", api, "--out", str(out), "--quiet", "--concurrency", "1",
                   "--requests", str(REQUESTS), "--warmup", "0", "--dataset", str(dataset), "--no-unique-prefix",
                   "--output-tokens", str(OUTPUT), *extra, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_records_carry_llamacpps_own_cached_count(gguf: Path, tmp_path: Path, api: str) -> None:
    prompt, dataset = one_prompt(tmp_path)
    with llama_server(gguf, parallel=1, ctx_size=512) as url:
        bench(url, api, dataset, tmp_path / "run")
        # what bench sent (its lead word, then the row's prompt), once more on the one slot
        usage, timings = last_usage_and_timings(url, api, f"{LEAD} {prompt}")
    prompt_tokens, cache_n = usage["prompt_tokens"], timings["cache_n"]
    assert cache_n == usage["prompt_tokens_details"]["cached_tokens"] == prompt_tokens - 1
    recs = sorted(RunDir(tmp_path / "run").records(), key=lambda r: r["start_s"])
    assert len(recs) == REQUESTS and all(r["ok"] and r["input_tokens"] == prompt_tokens for r in recs)
    assert [r["cached_tokens"] for r in recs] == [0] + [cache_n] * (REQUESTS - 1)  # a fresh slot, then all of it


def test_compare_takes_more_cached_prompt_tokens_as_the_treatments_sign(gguf: Path, tmp_path: Path) -> None:
    """Control: ``cache_prompt`` off (every prompt computed); treatment: on. No --metrics-url: the server's
    per-request counts are the only server-side sign."""
    _, dataset = one_prompt(tmp_path)
    with llama_server(gguf, parallel=1, ctx_size=512) as url:
        bench(url, "completions", dataset, tmp_path / "control", "--extra-body", '{"cache_prompt": false}')
        bench(url, "completions", dataset, tmp_path / "treatment")
    control = RunDir(tmp_path / "control").records()
    treatment = RunDir(tmp_path / "treatment").records()
    assert [r["cached_tokens"] for r in control] == [0] * REQUESTS
    cached = sum(r["cached_tokens"] for r in treatment)
    prompt_tokens = sum(r["input_tokens"] for r in treatment)
    assert cached >= (REQUESTS - 1) * (prompt_tokens // REQUESTS - 1)

    proc = run_cli("compare", str(tmp_path / "control"), str(tmp_path / "treatment"), "--json",
                   "--allow-diff", "decoding.extra_body", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["treatment_took_effect"] is True
    assert not any("took effect" in w for w in result["warnings"]), result["warnings"]
    control_prompt = sum(r["input_tokens"] for r in control)
    assert result["effect_evidence"] == [
        f"more prompt tokens served from the server's cache: {cached:,} cached tokens in the treatment "
        f"({cached / prompt_tokens:.1%} of {prompt_tokens:,} prompt tokens) vs 0 in the control (0.0% of "
        f"{control_prompt:,}), more than the 5% margin, from the server's per-request cached_tokens"]
