"""Engine profiles and measured step costs (issue 12): ``serving.engine: llamacpp``, ``serving.kv_tokens`` and
``serving.step_cost``, checked against the batching test server over HTTP and against closed-form truths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvcap.rundir import RunDir
from kvcap.sim.batch_shape import BatchShape
from kvcap.sim.cost_empirical import EmpiricalCost
from kvcap.sim.policy_llamacpp import SlotTable, forward_passes
from kvcap.sim.request import SimRequest
from kvcap.specs.model import load_model
from tests.conftest import run_cli
from tests.servers import start_fake_server

A_S, B_S, P_S = 0.010, 0.002, 0.00002  # the test server's step: A + B·batch + P·(prompt tokens admitted)
SLOTS = 8
IN_TOK, OUT_TOK = 64, 32


def scenario(tmp_path: Path, serving: dict, workload: dict, name: str = "sc.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"serving": serving, "workload": workload}))
    return path


def sim(path: Path, out: Path, *args: str) -> dict:
    p = run_cli("sim", str(path), "--out", str(out), "--quiet", "--json", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def levels(summary: dict) -> dict[float, dict]:
    return {lv["level"]: lv for lv in summary["levels"]}


LLAMACPP_LIKE_TEST_SERVER = {  # one forward pass a step, whatever slots are busy: llama.cpp's unified KV
    "engine": "llamacpp", "max_num_seqs": SLOTS, "kv_tokens": SLOTS * 1024, "kv_unified": True,
    "step_cost": {"base": f"{A_S * 1e3}ms", "per_decode": f"{B_S * 1e3}ms", "per_prefill_token": f"{P_S * 1e3}ms"},
}


def test_llamacpp_profile_reproduces_the_batching_test_server(tmp_path):
    # the test server is a fixed-slot engine with a known step time; the profile with the same coefficients
    # must give the same TPOT and throughput, below the slot count (closed-loop bubble) and above it (queue)
    load = ("--concurrency", "1,4,8,16", "--input-tokens", str(IN_TOK), "--output-tokens", str(OUT_TOK),
            "--warmup", "1s", "--duration", "3s")
    with start_fake_server(slots=SLOTS, step_a=f"{A_S * 1e3}ms", step_b=f"{B_S * 1e3}ms",
                           prefill_per_token=f"{P_S * 1e3}ms") as srv:
        p = run_cli("bench", "--url", srv.url, "--out", str(tmp_path / "real"), "--quiet", "--json", *load,
                    timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    real = levels(json.loads(p.stdout))
    path = scenario(tmp_path, LLAMACPP_LIKE_TEST_SERVER, {"input_tokens": IN_TOK, "output_tokens": OUT_TOK})
    simulated = levels(sim(path, tmp_path / "sim", *load))
    for c in (1, 4, 8, 16):
        r, s = real[c], simulated[c]
        assert r["ok"] > 0 and s["ok"] > 0
        assert s["tpot_ms"]["p50"] == pytest.approx(r["tpot_ms"]["p50"], rel=0.03), c
        assert s["output_tok_s"] == pytest.approx(r["output_tok_s"], rel=0.03), c
    # and both agree with the closed form where it is exact: batch 1, and a full batch of 8 under a queue
    assert simulated[1]["tpot_ms"]["p50"] == pytest.approx((A_S + B_S) * 1e3, rel=1e-6)
    assert simulated[16]["tpot_ms"]["p50"] == pytest.approx((A_S + B_S * SLOTS) * 1e3, rel=0.01)


def test_kv_tokens_sets_residency_paged_vs_slots(tmp_path, cli_json):
    # 1008-token prompts + 16 out = 1024 tokens = 64 blocks of 16: a 16384-token pool holds 16 of them (vllm);
    # llamacpp splits it into 8 slots of 2048 tokens: 8, whatever the pool could hold by length
    workload = {"input_tokens": 1008, "output_tokens": 16}
    cost = {"base": "5ms", "per_decode": "1ms", "per_prefill_token": "0.001ms"}
    vllm = scenario(tmp_path, {"engine": "vllm", "max_num_seqs": 64, "kv_tokens": 16384, "step_cost": cost},
                    workload, "vllm.yaml")
    slots = scenario(tmp_path, {"engine": "llamacpp", "max_num_seqs": 8, "kv_tokens": 16384, "step_cost": cost},
                     workload, "slots.yaml")
    pv, ps = cli_json("plan", "--scenario", str(vllm)), cli_json("plan", "--scenario", str(slots))
    assert pv["kv_tokens_per_gpu"] == 16384 and pv["kv_blocks_per_gpu"] == 1024
    assert pv["resident_requests"]["hbm"] == 16384 // 1024
    assert ps["resident_requests"]["hbm"] == 8 and ps["slot_context_tokens"] == 2048
    assert any("serving.kv_tokens=16384" in a for a in pv["assumptions"])
    assert not any(a.startswith("usable KV per GPU") for a in pv["assumptions"])
    load = ("--concurrency", "32", "--warmup", "0s", "--duration", "3s")
    sv, ss = levels(sim(vllm, tmp_path / "v", *load))[32], levels(sim(slots, tmp_path / "s", *load))[32]
    assert sv["server_running_max"] == 16
    assert ss["server_running_max"] == 8 and ss["preemptions"] == 0


def test_llamacpp_waits_fifo_and_never_preempts(tmp_path):
    # open-loop overload on 4 slots with long outputs: requests queue; each takes a slot in arrival order
    path = scenario(tmp_path, {"engine": "llamacpp", "max_num_seqs": 4, "kv_tokens": 4 * 512,
                               "step_cost": {"base": "10ms", "per_decode": "1ms"}},
                    {"input_tokens": "uniform:20,200", "output_tokens": "uniform:10,300"})
    summary = sim(path, tmp_path / "run", "--rate", "20", "--warmup", "0s", "--duration", "5s")
    recs = [r for r in RunDir(tmp_path / "run").records() if r["ok"]]
    assert len(recs) > 50 and summary["levels"][0]["server_waiting_max"] > 10
    assert all(r["preemptions"] == 0 and r["recomputed_tokens"] == 0 for r in recs)
    started = [r["start_s"] + r["queue_ms"] / 1e3 for r in sorted(recs, key=lambda r: (r["start_s"], r["index"]))]
    assert started == sorted(started)  # a slot is taken in arrival order
    assert max(r["queue_ms"] for r in recs) > 1000  # and the wait is real


def test_llamacpp_full_slot_context_truncates_and_a_prompt_that_fills_it_is_refused(tmp_path):
    # slots of 1024 / 8 = 128 tokens: a 100-token prompt can have 28 output tokens; a 128-token one none
    cost = {"base": "10ms", "per_decode": "1ms"}
    path = scenario(tmp_path, {"engine": "llamacpp", "max_num_seqs": 8, "kv_tokens": 1024, "step_cost": cost},
                    {"input_tokens": 100, "output_tokens": 50})
    sim(path, tmp_path / "a", "--concurrency", "2", "--warmup", "0s", "--requests", "6")
    recs = [r for r in RunDir(tmp_path / "a").records()]
    assert recs and all(r["ok"] and r["output_tokens"] == 28 and r["requested_output_tokens"] == 50
                        and r["truncated"] and r["finish_reason"] == "length" for r in recs)
    sim(path, tmp_path / "b", "--concurrency", "1", "--warmup", "0s", "--requests", "3", "--input-tokens", "128")
    recs = [r for r in RunDir(tmp_path / "b").records()]
    assert recs and all(not r["ok"] and r["status"] == 400 for r in recs)


def test_llamacpp_chunks_a_long_prompt_by_n_batch(tmp_path):
    # 3000 prompt tokens, n_batch 2048: two steps of prefill (2048 + 952), each a sampled row, at c = 1; each step
    # runs its tokens in passes of n_ubatch = 512 (4 + 2), each pass paying the fixed part
    cost = {"base": "10ms", "per_decode": "2ms", "per_prefill_token": "0.01ms"}
    path = scenario(tmp_path, {"engine": "llamacpp", "max_num_seqs": 2, "kv_tokens": 8192,
                               "max_num_batched_tokens": 2048, "step_cost": cost},
                    {"input_tokens": 3000, "output_tokens": 8})
    lv = levels(sim(path, tmp_path / "run", "--concurrency", "1", "--warmup", "0s", "--requests", "3"))[1]
    assert lv["ttft_ms"]["p50"] == pytest.approx((4 + 2) * 10 + 2 * 2 + 0.01 * 3000, abs=1e-3)
    assert lv["tpot_ms"]["p50"] == pytest.approx(10 + 2, abs=1e-3)


def test_empirical_cost_is_the_linear_step_and_its_spans_sum_in_closed_form():
    cost = EmpiricalCost(load_model("llama-3.1-8b"), base=0.02, per_decode=0.003, per_prefill_token=1e-4,
                         per_context_token=1e-6)
    mixed = BatchShape.of(prefill=[(500, 0)], decode=[100, 300])
    # 2 decoders + 1 prefill chunk sample; 500 prompt tokens; decoders attend to 400 tokens
    assert cost.iteration_time(mixed).total_s == pytest.approx(0.02 + 0.003 * 3 + 1e-4 * 500 + 1e-6 * 400)
    assert cost.iteration_time(mixed).bound == "compute"
    decode = BatchShape.of(decode=[100, 300, 50])
    times = cost.decode_step_times(decode, 40)
    by_step = [cost.iteration_time(BatchShape.of(decode=[100 + i, 300 + i, 50 + i])).total_s for i in range(40)]
    assert times.tolist() == pytest.approx(by_step)
    assert cost.decode_steps_time(decode, 40) == pytest.approx(sum(by_step))


def test_a_floor_holds_small_steps_up_and_spans_still_sum_in_closed_form():
    """A step takes at least ``floor`` (per forward pass): a span whose steps climb through it (the context term)
    sums, in closed form, to its steps one by one."""
    cost = EmpiricalCost(load_model("llama-3.1-8b"), base=0.002, per_decode=0.001, per_prefill_token=1e-4,
                         per_context_token=1e-5, floor=0.010)
    one = BatchShape.of(decode=[100])
    assert cost.iteration_time(one).total_s == pytest.approx(0.010)  # the line says 0.002 + 0.001 + 0.001
    two_passes = BatchShape.of(decode=[100])
    two_passes.passes = 2
    assert cost.iteration_time(two_passes).total_s == pytest.approx(0.020)
    mixed = BatchShape.of(prefill=[(500, 0)], decode=[100])  # 0.002 + 0.002 + 0.05 + 0.001: above the floor
    assert cost.iteration_time(mixed).total_s == pytest.approx(0.055)
    climbing = BatchShape.of(decode=[400, 300])  # 0.002 + 0.002 + 0.007 = 0.011 rising 2e-5 a step; floor below
    low = BatchShape.of(decode=[200, 100])  # 0.007 rising 2e-5 a step: under the floor for 150 steps
    for batch, kvs in ((climbing, [400, 300]), (low, [200, 100])):
        by_step = [cost.iteration_time(BatchShape.of(decode=[k + i for k in kvs])).total_s for i in range(300)]
        assert cost.decode_step_times(batch, 300).tolist() == pytest.approx(by_step)
        assert cost.decode_steps_time(batch, 300) == pytest.approx(sum(by_step))
    assert min(cost.decode_step_times(low, 300)) == pytest.approx(0.010)


@pytest.mark.parametrize("serving, words", [
    ({"step_cost": {"base": "-1ms"}}, "step_cost.base"),
    ({"step_cost": {"per_decode": -0.001}}, "step_cost.per_decode"),
    ({"kv_tokens": 0}, "kv_tokens"),
    ({"engine": "llamacpp", "max_num_seqs": 8, "kv_tokens": 4}, "kv_tokens"),
    ({"engine": "sglang"}, "engine"),
])
def test_bad_profile_keys_are_one_line_exit_2(tmp_path, serving, words):
    path = scenario(tmp_path, serving, {"input_tokens": 16, "output_tokens": 4})
    p = run_cli("plan", "--scenario", str(path), "--json")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and words in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_per_request_delays_the_first_token_by_exactly_its_time_and_takes_no_engine_time(tmp_path):
    # a lone request (c=1): TTFT = per_request + its prompt's step; TPOT and the step itself do not move
    load = ("--concurrency", "1", "--input-tokens", str(IN_TOK), "--output-tokens", str(OUT_TOK),
            "--requests", "20", "--warmup", "0s")
    wl = {"input_tokens": IN_TOK, "output_tokens": OUT_TOK}
    plain = levels(sim(scenario(tmp_path, LLAMACPP_LIKE_TEST_SERVER, wl, "a.yaml"), tmp_path / "a", *load))[1]
    front = {**LLAMACPP_LIKE_TEST_SERVER, "step_cost": {**LLAMACPP_LIKE_TEST_SERVER["step_cost"], "per_request": "4ms"}}
    slow = levels(sim(scenario(tmp_path, front, wl, "b.yaml"), tmp_path / "b", *load))[1]
    first_step = (A_S + B_S + P_S * IN_TOK) * 1e3
    assert plain["ttft_ms"]["p50"] == pytest.approx(first_step, rel=1e-6)
    assert slow["ttft_ms"]["p50"] == pytest.approx(first_step + 4.0, rel=1e-6)
    assert slow["tpot_ms"]["p50"] == pytest.approx(plain["tpot_ms"]["p50"], rel=1e-9)


@pytest.mark.parametrize(("tokens", "passes"), [
    ([1, 1, 1, 1], 1),  # one run of busy slots: one pass
    ([1, 1, 0, 0, 1, 1, 0, 0], 2),  # {0, 1, 4, 5}: a pass per run (pinned 1.79 ms against 1.38 for one run)
    ([1, 0, 1, 0, 1, 0, 1, 0], 4),  # {0, 2, 4, 6} (pinned 2.85 ms)
    ([0, 0, 48], 1),  # a lone prompt: one ubatch
    ([1, 1, 48, 1], 2),  # a prompt beside decodes: one token from each, then the prompt's other 47 alone
    ([2048], 4),  # n_ubatch = 512 tokens a pass
    ([0, 0, 0], 0),
])
def test_llamacpp_forward_passes_follow_split_equal(tokens, passes):
    assert forward_passes(tokens) == passes


def test_llamacpp_slot_choice_is_least_recently_released():
    table = SlotTable(4)
    reqs = [SimRequest(rid=i, arrival=0.0, prompt=8, max_out=4) for i in range(6)]
    assert [table.take(r) for r in reqs[:4]] == [3, 2, 1, 0]  # never used: the highest id first
    reqs[0].state = reqs[2].state = "done"  # slots 3 and 1 released in one step: the lower id counts as older
    table.free_finished(1.0)
    assert table.take(reqs[4]) == 1
    reqs[4].state = "done"
    table.free_finished(2.0)  # slot 1 again, later than slot 3
    assert table.take(reqs[5]) == 3


def test_llamacpp_scattered_slots_cost_a_pass_each(tmp_path):
    """Three slots, a trace: A, B, C arrive together and take slots 2, 1, 0; A finishes, then B; D then takes
    the least recently released slot, 2 (A's), so C (slot 0) and D decode in two passes: a step of
    2·base + 2·per_decode, where one pass (unified KV) is base + 2·per_decode."""
    trace = tmp_path / "trace.jsonl"
    rows = [(0.0, 3), (0.0, 5), (0.0, 400), (1.0, 20)]  # (arrival s, output tokens); A, B, C, D
    trace.write_text("".join(json.dumps({"arrival_s": t, "input_tokens": 16, "output_tokens": n}) + "\n"
                             for t, n in rows))
    serving = {"engine": "llamacpp", "max_num_seqs": 3, "kv_tokens": 3 * 512,
               "step_cost": {"base": "10ms", "per_decode": "1ms"}}
    for unified, step_ms in ((False, 2 * 10 + 2 * 1), (True, 10 + 2 * 1)):
        path = scenario(tmp_path, {**serving, "kv_unified": unified}, {"input_tokens": 16, "output_tokens": 8},
                        f"u{unified}.yaml")
        sim(path, tmp_path / f"run{unified}", "--trace", str(trace), "--warmup", "0s")
        d = next(r for r in RunDir(tmp_path / f"run{unified}").records() if r["output_tokens"] == 20)
        assert d["tpot_ms"] == pytest.approx(step_ms, abs=1e-6), unified
