"""Multi-turn sessions (kvcap.workload.sessions): a turn's prompt is the session's history plus its question, the
words bench sends chain into blocks exactly where the plan's hash ids share, and the simulator's closed loop runs
each user's turns in order, think time apart."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from kvcap.errors import InputError
from kvcap.rundir import RunDir
from kvcap.sim.run import config_for, run_sim
from kvcap.specs.fields import validate
from kvcap.specs.lengths import parse_length
from kvcap.specs.load import WorkloadSpec
from kvcap.specs.scenario import read_yaml
from kvcap.workload.blocks import prompt_block_hashes
from kvcap.workload.prompts import PromptFactory
from kvcap.workload.sessions import SessionPlan, session_plan, session_quota
from tests.conftest import ROOT

BLOCK = 16


def plan(question: str = "uniform:5,60", answer: str = "uniform:1,40", turns: int = 4, prefix: int = 0,
         groups: int = 0) -> SessionPlan:
    p = session_plan(3, turns, 0.5, parse_length(question), parse_length(answer), prefix, groups)
    assert p is not None
    return p


def test_one_turn_is_no_session():
    assert session_plan(0, 1, 0.0, parse_length(10), parse_length(10)) is None


def test_turn_k_prompt_is_every_earlier_question_and_answer_plus_its_question():
    p = plan()
    for s in range(5):
        lengths = p.lengths(s)
        assert len(lengths) == 4 and all(5 <= q <= 60 and 1 <= a <= 40 for q, a in lengths)
        for k in range(1, 5):
            t = p.turn(s, k)
            assert t.input_tokens == sum(q + a for q, a in lengths[: k - 1]) + lengths[k - 1][0]
            assert t.output_tokens == lengths[k - 1][1]
    assert p.lengths(0) != p.lengths(1)  # drawn per session
    assert plan().lengths(2) == p.lengths(2)  # by the seed alone


def test_hash_ids_of_a_turn_extend_the_previous_turns_full_blocks():
    p = plan()
    for s in range(4):
        prev: tuple[int, ...] = ()
        prev_full = 0
        for k in range(1, 5):
            t = p.turn(s, k)
            ids = p.hash_ids(t, BLOCK)
            assert len(ids) == -(-t.input_tokens // BLOCK)
            assert ids[:prev_full] == prev[:prev_full]  # every full block of turn k-1 is turn k's
            if t.input_tokens % BLOCK:  # a partial last block matches nothing later
                assert ids[-1] not in p.hash_ids(p.turn(s, 4), BLOCK) or k == 4
            prev, prev_full = ids, t.input_tokens // BLOCK
    other = {h for k in range(1, 5) for h in p.hash_ids(p.turn(1, k), BLOCK)}
    assert not other & set(p.hash_ids(p.turn(0, 4), BLOCK))  # sessions share nothing


def test_a_group_prefix_opens_the_session_and_is_shared_within_the_group():
    p = plan(prefix=70, groups=2)
    a, b, c = p.turn(0, 1), p.turn(2, 1), p.turn(1, 1)  # a, b: group 0; c: group 1
    assert a.input_tokens == 70 + p.lengths(0)[0][0] and a.group == b.group == 0 and c.group == 1
    full = 70 // BLOCK
    assert p.hash_ids(a, BLOCK)[:full] == p.hash_ids(b, BLOCK)[:full]
    assert p.hash_ids(a, BLOCK)[full] != p.hash_ids(b, BLOCK)[full]
    assert not set(p.hash_ids(a, BLOCK)) & set(p.hash_ids(c, BLOCK))


@pytest.mark.parametrize(("prefix", "groups"), [(0, 0), (40, 2)])
def test_the_words_bench_sends_chain_into_the_blocks_the_sim_hashes(prefix: int, groups: int):
    """Turn by turn, the words share a leading run of full blocks with earlier prompts exactly where the ids do,
    and each turn's words are the previous turn's plus its answer and question (one word one token)."""
    factory = PromptFactory(seed=3, input_dist=parse_length("uniform:5,60"), output_dist=parse_length("uniform:1,40"),
                            prefix_tokens=prefix, prefix_groups=groups, turns=4, think_time_s=0.5, run_id="r")
    p = factory.sessions
    assert p is not None
    seen_words: set[int] = set()
    seen_ids: set[int] = set()
    for s in range(6):
        prev: list[str] = []
        for k in range(1, 5):
            req = factory.session_request(p, s, k, level=2)
            words = req.prompt.split()
            t = p.turn(s, k)
            assert len(words) == req.input_tokens == t.input_tokens and (req.session, req.turn) == (s, k)
            assert words[: len(prev)] == prev  # append-only
            by_words = prompt_block_hashes(words, BLOCK)
            by_ids = p.hash_ids(t, BLOCK)[: len(words) // BLOCK]
            assert [h in seen_words for h in by_words] == [h in seen_ids for h in by_ids], (s, k)
            seen_words.update(by_words)
            seen_ids.update(by_ids)
            prev = words + factory._session_words(p, s, 2, 0)[2 * k].split()  # the planned answer follows


def test_prompt_set_identity_is_the_same_in_every_arm_and_differs_from_single_requests():
    def identity(run_id: str, turns: int) -> str:
        return PromptFactory(seed=0, input_dist=parse_length(20), output_dist=parse_length(5), turns=turns,
                             run_id=run_id).identity()

    assert identity("a", 3) == identity("b", 3) != identity("a", 1)


def test_spec_defaults_serialise_as_before_and_bad_combinations_are_refused():
    assert "turns" not in WorkloadSpec().model_dump() and "think_time" not in WorkloadSpec().model_dump()
    spec = WorkloadSpec(turns=3, think_time="250ms")
    assert spec.model_dump()["turns"] == 3 and spec.think_time == pytest.approx(0.25)
    for bad, why in (({"think_time": "1s"}, "think_time"),
                     ({"turns": 2, "prefix_tokens": 10, "prefix_groups": 2, "prompts_per_group": 3},
                      "prompts_per_group")):
        with pytest.raises(InputError, match=why):
            validate(WorkloadSpec, bad, "test")
    assert session_quota(10, 3) == 4 and session_quota(None, 3) is None


def test_sim_closed_loop_runs_each_users_turns_in_order_think_time_apart(tmp_path: Path):
    data = read_yaml(str(ROOT / "scenarios" / "seed-reference.yaml"))
    overrides = {"load.concurrency": [1], "load.rate": None, "load.requests": 6, "load.duration": None,
                 "load.warmup": 0, "load.repeats": 1, "workload.turns": 3, "workload.think_time": "200ms",
                 "workload.input_tokens": 100, "workload.output_tokens": 8}
    run_sim(config_for(data, overrides, tmp_path / "sim"))
    recs = sorted(RunDir(tmp_path / "sim").records(), key=lambda r: r["start_s"])
    assert [(r["session"], r["turn"]) for r in recs] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert [r["input_tokens"] for r in recs] == [100, 208, 316] * 2
    for before, after in pairwise(recs):
        gap = after["start_s"] - before["end_s"]
        assert gap == pytest.approx(0.2 if after["turn"] > 1 else 0.0, abs=1e-6)
