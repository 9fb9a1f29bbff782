"""Multi-turn sessions: which prompt turn ``k`` of session ``s`` sends, its lengths, and the hash ids of its blocks —
one definition for ``bench`` (which writes the words) and ``sim`` (which reads the hash ids), as
:mod:`kvcap.workload.reuse` is for shared prefixes.

The shape follows LMCache's multi-round QA benchmark (``benchmarks/multi-round-qa``): a user holds a conversation
of ``turns`` rounds and every round resends the whole conversation so far followed by a new question, so turn
``k``'s prompt is every earlier question and answer of the session plus the new one — optionally opened by its
group's shared system prompt (``prefix_tokens``, group ``s mod prefix_groups``), as LMCache's shared system
prompt opens each user's history. Each question is ``input_tokens`` long and each answer ``output_tokens``, drawn
per (seed, session, turn).

One deliberate difference: LMCache appends the text the server generated; here the history carries the *planned*
answers (deterministic words of the turn's output length), so every arm and the simulator send the same prompts
whatever the server wrote. The consequence: a real engine's cached KV of its own generated output is not what the
next turn reuses — the previous turn's *prompt* blocks are (up to its last full block), and the planned answer's
blocks are computed afresh in the next turn.

Session ``s``'s token stream is append-only, so the full block ``j`` of turn ``k``'s prompt is the same block in
every later turn of ``s``: its id is ``block_id(seed, 3, s, j)`` (a block wholly inside the shared system prompt is
the group's, as in :mod:`kvcap.workload.reuse`). A prompt's partial last block gets an id of its own turn, so it
matches nothing. Sessions share nothing but a group prefix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from kvcap.specs.lengths import LengthDist
from kvcap.workload.loadplan import LoadPlan
from kvcap.workload.reuse import block_id

SESSION_STREAM = 3_000_017
"""Seeds a session's length draws, apart from every other stream of the seed."""
SESSION_BLOCK, PARTIAL_BLOCK, GROUP_BLOCK = 3, 4, 1
"""The ``kind`` part of a block id: a session's full block, a turn's partial last block, a group prefix's block
(the same kind as :mod:`kvcap.workload.reuse`'s, so the two workloads name a group prefix alike)."""


@dataclass(frozen=True)
class Turn:
    """Turn ``turn`` (1 for the first) of session ``session``: the tokens before its question (shared prefix and
    history), its question and its planned answer."""

    session: int
    turn: int
    history_tokens: int
    question_tokens: int
    output_tokens: int
    group: int | None = None

    @property
    def input_tokens(self) -> int:
        return self.history_tokens + self.question_tokens


@dataclass(frozen=True)
class SessionPlan:
    """The session workload of one seed: (session, turn) → prompt lengths, and a turn's block hash ids."""

    seed: int
    turns: int
    think_time_s: float
    question_dist: LengthDist
    output_dist: LengthDist
    prefix_tokens: int = 0
    groups: int = 0

    @cached_property
    def _memo(self) -> dict[int, tuple[tuple[int, int], ...]]:
        return {}

    def lengths(self, session: int) -> tuple[tuple[int, int], ...]:
        """(question tokens, answer tokens) of each turn of ``session``, first turn first: drawn from
        (seed, session), answers first (as :meth:`SharedPrefixPlan.lengths` draws a slot's output first)."""
        memo = self._memo
        got = memo.get(session)
        if got is None:
            rng = np.random.default_rng((self.seed, SESSION_STREAM, session))
            out = self.output_dist.sample(self.turns, rng)
            questions = self.question_dist.sample(self.turns, rng)
            got = tuple((int(q), int(o)) for q, o in zip(questions.tolist(), out.tolist(), strict=True))
            if len(memo) >= 4096:  # sessions in progress are few; finished ones are not asked for again
                memo.pop(next(iter(memo)))
            memo[session] = got
        return got

    def group_of(self, session: int) -> int | None:
        return session % self.groups if self.groups else None

    def turn(self, session: int, turn: int) -> Turn:
        """Turn ``turn`` (1-based) of ``session``."""
        if not 1 <= turn <= self.turns:
            raise ValueError(f"turn {turn} outside 1..{self.turns}")
        lengths = self.lengths(session)
        history = self.prefix_tokens + sum(q + a for q, a in lengths[: turn - 1])
        question, answer = lengths[turn - 1]
        return Turn(session=session, turn=turn, history_tokens=history, question_tokens=question,
                    output_tokens=answer, group=self.group_of(session))

    def hash_ids(self, t: Turn, block_tokens: int) -> tuple[int, ...]:
        """Ids of the turn's ``block_tokens``-token prompt blocks: full ones the session's (or its group's, within
        the shared prefix), the partial last one the turn's own."""
        n_full = t.input_tokens // block_tokens
        shared = min(n_full, self.prefix_tokens // block_tokens) if t.group is not None else 0
        ids = [block_id(self.seed, GROUP_BLOCK, t.group, j) for j in range(shared)] if t.group is not None else []
        ids += [block_id(self.seed, SESSION_BLOCK, t.session, j) for j in range(shared, n_full)]
        if t.input_tokens % block_tokens:
            ids.append(block_id(self.seed, PARTIAL_BLOCK, t.session, t.turn))
        return tuple(ids)

    def request_index(self, session: int, turn: int) -> int:
        """The request index of a turn within its level: sessions' turns numbered in order, from 0."""
        return session * self.turns + turn - 1


def session_plan(seed: int, turns: int, think_time_s: float, question_dist: LengthDist, output_dist: LengthDist,
                 prefix_tokens: int = 0, groups: int = 0) -> SessionPlan | None:
    """The plan of a session workload (``turns`` ≥ 2), None for single requests."""
    if turns < 2:
        return None
    return SessionPlan(seed=seed, turns=turns, think_time_s=think_time_s, question_dist=question_dist,
                       output_dist=output_dist, prefix_tokens=prefix_tokens if groups else 0, groups=groups)


def session_quota(requests: int | None, turns: int) -> int | None:
    """Sessions a level with a request count starts in its measured window: ``requests`` counts turns, rounded up
    to whole sessions (every started session sends all its turns)."""
    return None if requests is None else math.ceil(requests / turns)


def session_schedule_plan(plan: LoadPlan, turns: int) -> LoadPlan:
    """An open loop's plan for its session arrivals: a request count (turns) becomes whole sessions, as the closed
    loop counts it (:func:`session_quota`); the schedule is otherwise the same generator and seed."""
    return replace(plan, requests=session_quota(plan.requests, turns))


def session_parts(turns: int, think_time_s: float, prefix_tokens: int) -> dict[str, object]:
    """Manifest keys stating what a session's prompt is made of (both ``bench`` and ``sim`` write them)."""
    head = f"{prefix_tokens} shared prefix tokens + " if prefix_tokens else ""
    return {"workload.turns": turns, "workload.think_time": think_time_s,
            "workload.prompt": (f"turn k of {turns}: {head}every earlier turn's workload.input_tokens question and "
                                "workload.output_tokens planned answer + workload.input_tokens of its own")}
