"""A host-RAM tier in a second engine: real llama.cpp with its host prompt cache off (``--cache-ram 0``) and on,
under multi-turn sessions with more users than slots — each turn resends the whole history, and a slot another
user took has lost it. With the cache, the history comes back from host RAM instead of being computed again:
``compare`` names the gain at equal concurrency, and llama.cpp's own per-request count of cached prompt tokens
says where it came from."""

from __future__ import annotations

import json

import pytest

from kvcap.rundir import RunDir
from tests.conftest import run_cli
from tests.llamacpp import llama_server
from tests.tiny_gguf import write_tiny_llama_gguf

pytestmark = pytest.mark.llamacpp

SHAPE = {"n_layers": 4, "hidden": 256, "n_heads": 4, "n_kv_heads": 2, "ff": 768}
SLOTS, CTX = 2, 2 * 2048
SESSIONS = ("--turns", "6", "--think-time", "0s", "--input-tokens", "150", "--output-tokens", "32",
            "--concurrency", "2,4", "--requests", "48", "--warmup", "0s", "--seed", "5")
# at c = 2 each user keeps a slot and the cache has nothing to give (saving slots to RAM even costs a little); at
# c = 4 the control computes lost histories again and the treatment restores them: TTFT p95 ~0.8 vs ~0.3 s on an
# idle machine, ~4.3 vs ~0.8 s beside other work — the SLO lets the treatment pass at c = 4 either way
ARMS = {"control": "0", "treatment": "256"}
"""``--cache-ram`` in MiB per arm."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("host-cache")
    gguf = write_tiny_llama_gguf(root / "tiny.gguf", **SHAPE)
    for arm, mib in ARMS.items():
        with llama_server(gguf, parallel=SLOTS, ctx_size=CTX, extra_args=("--cache-ram", mib)) as url:
            p = run_cli("bench", "--url", url, "--out", str(root / arm), "--quiet", *SESSIONS,
                        "--metrics-url", url + "/metrics", "--slo", "ttft_p95=1500ms", timeout=900)
            assert p.returncode == 0, p.stderr[-3000:]
    return root


def test_the_host_cache_serves_histories_the_slots_lost(runs):
    control, treatment = (RunDir(runs / arm).records() for arm in ARMS)
    assert all(r["ok"] for r in control + treatment)
    prompt = {arm: sum(r["input_tokens"] for r in recs) for arm, recs in (("control", control),
                                                                            ("treatment", treatment))}
    assert prompt["control"] == prompt["treatment"]  # the same sessions, turn for turn
    p = run_cli("compare", str(runs / "control"), str(runs / "treatment"), "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    verdict = json.loads(p.stdout)
    # users beyond the slots: the control computes lost histories again, the treatment restores them — more goodput
    # beyond noise at lower TTFT. (Which verdict that makes depends on the SLO and on whether c = 4 is stable,
    # which on 2 slots it is not: the unit tests hold the verdict rules to the figures.)
    at4 = next(lv for lv in verdict["per_level"] if lv["level"] == 4)
    assert at4["goodput_delta_ci95"][0] > 0, at4
    assert at4["ttft_p95_ms"][1] < at4["ttft_p95_ms"][0] / 2, at4
    assert verdict["treatment_took_effect"] is True, verdict["warnings"]
    cached = {arm: sum(r["cached_tokens"] or 0 for r in recs) for arm, recs in (("control", control),
                                                                              ("treatment", treatment))}
    assert cached["treatment"] > cached["control"]
