"""The two steps read from records (:mod:`kvcap.calibrate.steps`), on records of a lockstep server whose steps are
known: a pure decode step of ``PURE`` and ``PROMPT`` more for a step that carries a new request's prompt."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from typing import Any

import pytest

from kvcap.calibrate.closed_form import closed_form, measured_prompt_cost
from kvcap.calibrate.observe import Observation
from kvcap.calibrate.steps import step_splits

PURE, PROMPT = 0.020, 0.006


def lockstep_records(users: int, n_out: int, requests: int, chunked: bool = False) -> list[dict[str, Any]]:
    """A closed loop of ``users`` on a server of steps back to back: a step costs ``PURE`` (+``PROMPT`` per new
    request in it), every running request gets a token at its end, a finished request's user sends the next at
    once. Users start a step apart, so the loop runs out of lockstep (a prompt in most steps' neighbours).
    ``chunked``: the stream delivers tokens three at a time (two gaps of three zero)."""
    t = 0.0
    waiting = [(u * PURE, u) for u in range(users)]  # (sent at, user)
    running: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    sent = users
    while len(done) < requests:
        joining = [w for w in waiting if w[0] <= t] if waiting else []
        if not running and not joining:
            t = min(w[0] for w in waiting)
            continue
        waiting = [w for w in waiting if w not in joining]
        step = PURE + PROMPT * len(joining)
        t += step
        for r in running:
            r["times"].append(t)
        for sent_at, _ in joining:
            running.append({"start_s": sent_at, "times": [t]})
        for r in [r for r in running if len(r["times"]) == n_out]:
            running.remove(r)
            times = r["times"]
            if chunked:  # after the first token, each token arrives with the last of its chunk of three
                times = times[:1] + [times[min(3 * ((i - 1) // 3) + 3, n_out - 1)] for i in range(1, n_out)]
            itl = [(b - a) * 1e3 for a, b in pairwise(times)]
            done.append({"ok": True, "mode": "concurrency", "level": float(users), "repeat": 0,
                         "start_s": r["start_s"], "ttft_ms": (times[0] - r["start_s"]) * 1e3, "itl_ms": itl})
            if sent < requests + users:
                waiting.append((t, sent))
                sent += 1
    return done


def test_a_closed_loop_out_of_lockstep_tells_the_pure_step_from_a_prompts():
    recs = lockstep_records(users=4, n_out=16, requests=80)
    split = step_splits(recs, {("concurrency", 4.0): PURE * 1e3})[("concurrency", 4.0)]
    assert split.pure_s == pytest.approx(PURE, rel=1e-6)
    assert split.prompt_s == pytest.approx(PROMPT, rel=1e-6)


def test_a_level_of_chunked_streams_or_too_few_gaps_tells_neither():
    recs = lockstep_records(users=4, n_out=16, requests=80, chunked=True)
    tpot = {("concurrency", 4.0): PURE * 1e3}
    assert step_splits(recs, tpot)[("concurrency", 4.0)].pure_s is None  # the median gap is zero: not a step
    few = lockstep_records(users=1, n_out=4, requests=2)
    assert step_splits(few, {("concurrency", 1.0): PURE * 1e3})[("concurrency", 1.0)].pure_s is None


def level(c: int, per_decode: float, ppt: float, n_in: float = 512) -> Observation:
    step = PURE + per_decode * c
    return Observation(run="r", mode="concurrency", level=c, ttft_p50=step + ppt * n_in, ttft_p95=step,
                       tpot_p50=step + 0.1 * ppt * n_in, tpot_p95=step, throughput=100.0, input_tokens=n_in,
                       output_tokens=32, pure_step=step, prompt_step=per_decode + ppt * n_in)


def test_the_prompt_cost_is_what_a_prompts_step_adds_beyond_one_more_sequence():
    """A step that carried a prompt also samples that request's first token: one more sequence's cost, which is
    per_decode, not prefill (a server with free prefill shows exactly per_decode there)."""
    assert measured_prompt_cost([level(4, 0.002, 0.0)], per_decode=0.002)[0] == 0.0
    assert measured_prompt_cost([level(4, 0.002, 50e-6)], per_decode=0.002)[0] == pytest.approx(50e-6)


def test_the_step_line_goes_through_the_pure_steps_not_tpot():
    """TPOT here carries a share of the other requests' prompts (a tenth of one, every level): a line through it
    would put that in the base; the pure steps give the truth, and the front end is what TTFT holds beyond."""
    cost, _, notes = closed_form([level(c, 0.002, 50e-6) for c in (1, 2, 4, 8)], slots=8)
    assert (cost.base, cost.per_decode, cost.per_prefill_token) == pytest.approx((PURE, 0.002, 50e-6), rel=1e-6)
    assert cost.per_request == pytest.approx(0.0, abs=1e-9)
    assert any("steps that carried one prompt" in n for n in notes)


def test_a_pure_step_above_the_line_of_the_larger_batches_is_a_floor():
    """Pure steps of a roofline (0.7 ms at least, 0.39 + 0.2 ms a sequence above): the line goes through the
    batches above the floor, and the floor is the smallest batch's step — a line through all would say 0.165 ms a
    sequence and 1.8 ms at 8 where the server takes 2.0."""
    def roof(c: int) -> Observation:
        step = max(0.0007, 0.00039 + 0.0002 * c)
        return Observation(run="r", mode="concurrency", level=c, ttft_p50=step + 0.005, ttft_p95=step,
                           tpot_p50=step, tpot_p95=step, throughput=100.0, input_tokens=48, output_tokens=32,
                           pure_step=step, prompt_step=0.0002 + 0.005)
    cost, _, notes = closed_form([roof(c) for c in (1, 2, 4)], slots=4)
    assert (cost.floor, cost.base, cost.per_decode) == pytest.approx((0.0007, 0.00039, 0.0002), rel=1e-6)
    assert any(n.startswith("floor:") for n in notes)
    linear, _, _ = closed_form([level(c, 0.002, 50e-6) for c in (1, 2, 4)], slots=8)
    assert linear.floor == 0.0  # on the line: no floor
    two, _, _ = closed_form([roof(c) for c in (1, 4)], slots=4)
    assert two.floor == 0.0  # two batch sizes make any line: a floor is not told


def test_a_queue_for_the_slots_is_priced_apart_from_the_line():
    """Pure steps of 0.4 ms + 0.2 ms a sequence, plus 1 µs per sequence per request waiting for one of 8 slots (what
    llama.cpp's notify_all costs): the line goes through the unqueued levels only, and the queued levels' excess
    over it is ``per_waiting``. A line through every level would have read the queue as cost per sequence."""
    def lvl(c: int) -> Observation:
        b, waiting = min(c, 8), max(0, c - 8)
        step = 0.0004 + 0.0002 * b + 1e-6 * b * waiting
        return Observation(run="r", mode="concurrency", level=c, ttft_p50=step + 0.005, ttft_p95=step,
                           tpot_p50=step, tpot_p95=step, throughput=100.0, input_tokens=48, output_tokens=32,
                           pure_step=step, prompt_step=0.0002 + 0.005)
    cost, _, notes = closed_form([lvl(c) for c in (2, 4, 8, 64, 128)], slots=8)
    assert (cost.base, cost.per_decode, cost.per_waiting) == pytest.approx((0.0004, 0.0002, 1e-6), rel=1e-6)
    assert any(n.startswith("per_waiting from the pure steps of c=64") for n in notes)
    unqueued, _, _ = closed_form([lvl(c) for c in (2, 4, 8)], slots=8)
    assert unqueued.per_waiting == 0.0
    # noise-sized excess (under 3% of the step) is not a cost; one unqueued batch size cannot carry a line apart
    flat, _, notes = closed_form([lvl(c) for c in (2, 4, 8)] + [replace(lvl(8), level=64)], slots=8)
    assert flat.per_waiting == 0.0 and any(n.startswith("per_waiting 0:") for n in notes)
    one, _, notes = closed_form([lvl(c) for c in (4, 64, 128)], slots=8)
    assert one.per_waiting == 0.0 and any("fewer than two batch sizes" in n for n in notes)
