"""Prompts that hit a target token count, the same for the same seed in every level, repeat and arm.

A prompt is ``[lead word][shared group prefix][request nonce][body]``, words of :data:`WORDS` only. The body
depends only on (seed, request index), so two arms and all levels send the same prompt set (its hash goes in the
manifest). The nonce (three words) depends on the run, level and repeat, so no server prompt cache can carry work
over from one level, repeat or arm to the next — unless shared prefixes are asked for, which are shared on purpose
(within a level), as KV offload exists for. The constant lead word keeps what a chat template or a tokenizer's
start-of-text rule does to the first word the same for every prompt, so it is a constant overhead.

How tokens are counted (:class:`TokenCounter`): one word one token (kvcap's test server); a local HF
``tokenizer.json`` (exact for that tokenizer); or each word's cost as the *server* counts it, measured before the
run (``kvcap.loadgen.lengths``), so prompts are built to the server's own count. The tokens a server adds to
every prompt (BOS, chat template) are the factory's ``overhead``: prompts are built to the target minus it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from kvcap.errors import InputError
from kvcap.specs.lengths import LengthDist
from kvcap.workload.reuse import SharedPrefixPlan, shared_prefix_plan
from kvcap.workload.sessions import SessionPlan, session_plan
from kvcap.workload.words import WORDS, block_text

LEAD = WORDS[0]
"""The first word of every generated prompt."""


def tag_words(*parts: object, k: int = 3) -> str:
    """``k`` words from the hash of ``parts``: a nonce made of prompt words, so every counter can count it
    (142³ ≈ 2.9 million values; only the same request index in two levels, repeats or runs must not collide)."""
    digest = hashlib.blake2s(repr(parts).encode(), digest_size=2 * k).digest()
    return " ".join(WORDS[int.from_bytes(digest[2 * j: 2 * j + 2], "big") % len(WORDS)] for j in range(k))


class TokenCounter:
    """Counts and cuts text in tokens: one per word, each word's cost as the server counts it (``costs``, aligned
    with :data:`WORDS`; other words count one), or a local HF tokenizer.json (exact)."""

    def __init__(self, tokenizer_path: str | None = None, costs: tuple[int, ...] | None = None):
        self.path = tokenizer_path
        self._tok: Any = None
        self._costs: dict[str, int] = dict(zip(WORDS, costs, strict=True)) if costs else {}
        self._filler = min(WORDS, key=self.cost)
        if tokenizer_path:
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise InputError("--tokenizer needs the 'tokenizers' package: pip install 'kvcap[tokenizer]'") from None
            p = Path(tokenizer_path)
            if p.is_dir():
                p = p / "tokenizer.json"
            if not p.is_file():
                raise InputError(f"tokenizer file {str(p)!r} not found")
            try:
                self._tok = Tokenizer.from_file(str(p))
            except Exception as exc:
                raise InputError(f"cannot load tokenizer {str(p)!r}: {exc}") from None

    @property
    def exact(self) -> bool:
        """True for a local tokenizer: it can count any text (output too), not only prompt words."""
        return self._tok is not None

    def cost(self, word: str) -> int:
        return self._costs.get(word, 1)

    def count(self, text: str) -> int:
        if self._tok is None:
            return sum(self._costs.get(w, 1) for w in text.split()) if self._costs else len(text.split())
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def fit(self, text: str, n: int) -> str:
        """``text`` cut (or padded with words) to exactly ``n`` tokens where the tokenizer allows it."""
        if self._tok is None:
            return self._fit_words(text.split(), n)
        ids = self._tok.encode(text, add_special_tokens=False).ids
        while len(ids) < n:
            ids = ids + ids
        out = self._tok.decode(ids[:n])
        for _ in range(4):  # decode/encode does not always round-trip; nudge toward n
            got = self.count(out)
            if got == n:
                break
            ids_now = self._tok.encode(out, add_special_tokens=False).ids
            out = self._tok.decode(ids_now[: max(1, len(ids_now) - (got - n))]) if got > n else out + " the" * (n - got)
        return out

    def _fit_words(self, words: list[str], n: int) -> str:
        """Words in order while they fit (a word that costs more than what is left is skipped), then the cheapest
        word as filler: exact whenever some word costs one token."""
        if not self._costs:  # one word one token
            return " ".join(words[:n] + [self._filler] * (n - len(words)))
        out, left, cost = [], n, self._costs.get
        for w in words:
            if left <= 0:
                break
            c = cost(w, 1)
            if c <= left:
                out.append(w)
                left -= c
        c = self.cost(self._filler)
        out += [self._filler] * (left // c)
        return " ".join(out)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: text or chat messages, target lengths, and where it came from."""

    index: int
    prompt: str
    input_tokens: int
    output_tokens: int
    group: int | None = None
    messages: list[dict[str, str]] | None = None
    session: int | None = None
    """A multi-turn session's id and the turn (1-based) this request is; None for single requests."""
    turn: int | None = None


CACHE_BYTES = 32_000_000
"""Prompt bodies kept for reuse by later levels and repeats (which send the same bodies again), at most about this
many bytes: bodies are rebuilt from (seed, i) past it, so a run's memory does not grow with its length."""
ENTRY_BYTES = 300
"""What a cached body costs beside its characters (the str header, the entry's tuple, key and dict slot): with
short prompts it is most of the cost, so counting characters alone would let short prompts overrun the bound."""


@dataclass
class PromptFactory:
    """Builds request ``i`` deterministically from (seed, i); the nonce varies by run/level/repeat."""

    seed: int
    input_dist: LengthDist
    output_dist: LengthDist
    counter: TokenCounter = field(default_factory=TokenCounter)
    prefix_tokens: int = 0
    prefix_groups: int = 0
    prompts_per_group: int | None = None
    unique_prefix: bool = True
    run_id: str = ""
    dataset: list[dict[str, Any]] | None = None
    overhead: int = 0
    """Tokens the server adds to every prompt (BOS, chat template): generated prompts are built to the target
    minus this, so the server's count is the target."""
    turns: int = 1
    """Turns per multi-turn session (:mod:`kvcap.workload.sessions`); 1: single requests."""
    think_time_s: float = 0.0
    _cache: dict[int, tuple[str, int, int, int | None, list | None]] = field(default_factory=dict)
    _cached_bytes: int = 0

    @cached_property
    def _words(self) -> np.ndarray:
        return np.array(WORDS)

    @cached_property
    def _prefixes(self) -> dict[int, str]:
        return {}

    def _group_prefix(self, group: int) -> str:
        """The ``prefix_tokens`` of group ``group``: the same words for every request of the group."""
        if group not in self._prefixes:
            rng = np.random.default_rng((self.seed, 1_000_003, group))
            text = " ".join(self._words[rng.integers(len(WORDS), size=self.prefix_tokens * 2)])
            self._prefixes[group] = self.counter.fit(text, self.prefix_tokens)
        return self._prefixes[group]

    def _target(self, input_tokens: int) -> int:
        return max(1, input_tokens - self.overhead)

    def body(self, i: int) -> tuple[str, int, int, int | None, list | None]:
        """(body text, input target, output target, group, messages) — independent of run, level, repeat."""
        if i in self._cache:
            return self._cache[i]
        rng = np.random.default_rng((self.seed, i))
        out_t = int(self.output_dist.sample(1, rng)[0])
        group = (i % self.prefix_groups) if self.prefix_groups else None
        messages = None
        if self.dataset is not None:
            row = self.dataset[i % len(self.dataset)]
            text = row.get("prompt") or ""
            messages = row.get("messages")
            if messages:
                text = "\n".join(str(m.get("content", "")) for m in messages)
            out_t = int(row.get("output_tokens") or row.get("max_tokens") or out_t)
            in_t = int(row.get("input_tokens") or self.counter.count(text))
        else:
            in_t = int(self.input_dist.sample(1, rng)[0])
            words = self._words[rng.integers(len(WORDS), size=in_t + 8)]
            text = " ".join(words)
        entry = (text, in_t, out_t, group, messages)
        cost = len(text) + ENTRY_BYTES
        if self._cached_bytes + cost <= CACHE_BYTES:
            self._cache[i] = entry
            self._cached_bytes += cost
        return entry

    @cached_property
    def shared(self) -> SharedPrefixPlan | None:
        """The shared-prefix groups of a generated workload (a dataset's rows keep their own text)."""
        if self.dataset is not None:
            return None
        return shared_prefix_plan(self.seed, self.prefix_tokens, self.prefix_groups, self.input_dist,
                                  self.output_dist, self.prompts_per_group)

    def _question(self, slot: int, tokens: int) -> str:
        if slot not in self._questions:
            rng = np.random.default_rng((self.seed, 2_000_003, slot))
            text = " ".join(self._words[rng.integers(len(WORDS), size=tokens + 8)])
            self._questions[slot] = self.counter.fit(text, tokens)
            if len(self._questions) > 4096:  # a cycle of slots is short; unique questions are not kept
                self._questions.pop(next(iter(self._questions)))
        return self._questions[slot]

    @cached_property
    def _questions(self) -> dict[int, str]:
        return {}

    def shared_request(self, plan: SharedPrefixPlan, i: int, level: float, repeat: int) -> RequestSpec:
        """Request ``i`` of a shared-prefix workload: ``[lead][level tag][group prefix]`` in exactly
        ``prefix_tokens`` (less the server's own ``overhead``, which precedes it), then the slot's question. No
        request nonce: a slot's prompt recurs on purpose; the level tag keeps levels, repeats and arms apart."""
        p = plan.prompt(i)
        head = [LEAD, tag_words(self.run_id, level, repeat)] if self.unique_prefix else [LEAD]
        head.append(self._group_prefix(p.group))
        prefix = self.counter.fit(" ".join(head), max(1, self.prefix_tokens - self.overhead))
        # fitted whole (a tokenizer may count the joint apart from the parts): the cut falls in the question
        prompt = self.counter.fit(f"{prefix} {self._question(p.slot, p.question_tokens)}", self._target(p.input_tokens))
        return RequestSpec(index=i, prompt=prompt, input_tokens=p.input_tokens, output_tokens=p.output_tokens,
                           group=p.group)

    @cached_property
    def sessions(self) -> SessionPlan | None:
        """The multi-turn sessions of a generated workload, None for single requests."""
        if self.dataset is not None:
            return None
        return session_plan(self.seed, self.turns, self.think_time_s, self.input_dist, self.output_dist,
                            self.prefix_tokens, self.prefix_groups)

    @cached_property
    def _session_parts(self) -> dict[tuple[int, float, int], list[str]]:
        return {}

    def _session_words(self, plan: SessionPlan, session: int, level: float, repeat: int) -> list[str]:
        """Session ``session``'s parts in order — its opening (lead word, tags, group prefix), then question 1,
        answer 1, question 2, … — each fitted to its token count, so turn ``k``'s prompt is the first ``2k``
        parts joined and every turn's words extend the last's. Kept while the session runs (a few hundred)."""
        key = (session, level, repeat)
        parts = self._session_parts.get(key)
        if parts is not None:
            return parts
        if len(self._session_parts) >= 1024:
            self._session_parts.pop(next(iter(self._session_parts)))
        run_tag = [tag_words(self.run_id, level, repeat)] if self.unique_prefix else []
        nonce = tag_words(self.seed, "session", session, *((self.run_id, level, repeat) if self.unique_prefix else ()))
        lengths = plan.lengths(session)
        if plan.prefix_tokens:
            group = plan.group_of(session)
            assert group is not None
            opening = self.counter.fit(" ".join([LEAD, *run_tag, self._group_prefix(group)]),
                                       max(1, plan.prefix_tokens - self.overhead))
            first_head, first_target = [nonce], lengths[0][0]
        else:  # the server's own tokens and the lead word come out of the first question
            opening = ""
            first_head, first_target = [LEAD, nonce], max(1, lengths[0][0] - self.overhead)
        parts = [opening]
        for k, (question, answer) in enumerate(lengths):
            head, target = (first_head, first_target) if k == 0 else ([], question)
            parts.append(self.counter.fit(" ".join([*head, self._session_text(session, 2 * k, target)]), target))
            parts.append(self.counter.fit(self._session_text(session, 2 * k + 1, answer), answer))
        self._session_parts[key] = parts
        return parts

    def _session_text(self, session: int, part: int, tokens: int) -> str:
        rng = np.random.default_rng((self.seed, 3_000_019, session, part))
        return " ".join(self._words[rng.integers(len(WORDS), size=tokens + 8)])

    def session_request(self, plan: SessionPlan, session: int, turn: int, level: float = 0,
                        repeat: int = 0) -> RequestSpec:
        """Turn ``turn`` of ``session``: its opening, every earlier question and planned answer, its question.
        The request's index is the plan's (``SessionPlan.request_index``)."""
        t = plan.turn(session, turn)
        parts = self._session_words(plan, session, level, repeat)
        prompt = " ".join(p for p in parts[: 2 * turn] if p)
        return RequestSpec(index=plan.request_index(session, turn), prompt=prompt, input_tokens=t.input_tokens,
                           output_tokens=t.output_tokens, group=t.group, session=session, turn=turn)

    def request(self, i: int, level: float = 0, repeat: int = 0) -> RequestSpec:
        if (plan := self.shared) is not None:
            return self.shared_request(plan, i, level, repeat)
        text, in_t, out_t, group, messages = self.body(i)
        parts = [LEAD]
        if group is not None:
            if self.unique_prefix:
                parts.append(tag_words(self.run_id, level, repeat))
            parts.append(self._group_prefix(group))
        if self.unique_prefix:
            parts.append(tag_words(self.run_id, level, repeat, i))
        parts.append(text)
        prompt = " ".join(parts)
        if self.dataset is None:  # cut the whole prompt, prefix and nonce included, to the target
            prompt = self.counter.fit(prompt, self._target(in_t))
        if messages:
            messages = [dict(m) for m in messages]
            first_user = next((m for m in messages if m.get("role") == "user"), messages[0])
            first_user["content"] = " ".join([*parts[:-1], str(first_user.get("content", ""))])
        return RequestSpec(index=i, prompt=prompt, input_tokens=in_t, output_tokens=out_t, group=group,
                           messages=messages)

    def trace_request(self, i: int, input_tokens: int, output_tokens: int, hash_ids: tuple[int, ...] = (),
                      level: float = 0, repeat: int = 0) -> RequestSpec:
        """A trace row as a request; rows sharing ``hash_ids`` blocks share prompt text block for block."""
        if hash_ids:
            blocks = self._blocks
            for h in hash_ids:
                if h not in blocks:
                    blocks[h] = block_text(self.seed, h)
            text = " ".join(blocks[h] for h in hash_ids)
            tag = tag_words(self.run_id, level, repeat) if self.unique_prefix else ""
        else:
            rng = np.random.default_rng((self.seed, i))
            text = " ".join(self._words[rng.integers(len(WORDS), size=input_tokens + 8)])
            tag = tag_words(self.run_id, level, repeat, i) if self.unique_prefix else ""
        prompt = self.counter.fit(" ".join(filter(None, (LEAD, tag, text))), self._target(input_tokens))
        return RequestSpec(index=i, prompt=prompt, input_tokens=input_tokens, output_tokens=output_tokens)

    @cached_property
    def _blocks(self) -> dict[int, str]:
        return {}

    def identity(self, n: int = 256) -> str:
        """Hash of the first ``n`` prompt bodies, their input targets and groups: equal across arms ⇔ the same
        prompt set. Only what names the prompts: output targets are ``workload.output_tokens``' (a dataset's own
        are the dataset's), and a dataset row's input target is its text's, however a tokenizer counts it."""
        h = hashlib.sha256()
        if (sessions := self.sessions) is not None:
            for s in range(max(1, n // sessions.turns)):  # the parts' words before any run's tags
                lengths = sessions.lengths(s)
                texts = [self._session_text(s, 2 * k + j, lengths[k][j]) for k in range(len(lengths)) for j in (0, 1)]
                h.update(json.dumps([texts, lengths, sessions.group_of(s)]).encode())
            h.update(json.dumps([self.turns, self.prefix_tokens, self.prefix_groups]).encode())
            return h.hexdigest()[:16]
        if (plan := self.shared) is not None:
            for i in range(n):
                p = plan.prompt(i)
                # the plan, not the fitted words: the same prompts whatever counts their tokens
                h.update(json.dumps([self.seed, p.group, p.slot, p.input_tokens]).encode())
            h.update(json.dumps([self.prefix_tokens, self.prefix_groups, self.prompts_per_group]).encode())
            return h.hexdigest()[:16]
        for i in range(n):
            text, in_t, _out_t, group, _ = self.body(i)
            h.update(json.dumps([text, in_t if self.dataset is None else None, group]).encode())
        if self.prefix_groups:
            h.update(json.dumps([self.prefix_tokens, self.prefix_groups]).encode())
        return h.hexdigest()[:16]


def load_dataset(path: str) -> list[dict[str, Any]]:
    """JSONL rows with ``prompt`` (or chat ``messages``) and optional ``output_tokens``/``max_tokens``."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"dataset {path!r} not found")
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise InputError(f"dataset {path!r} line {n} is not JSON") from None
        if not isinstance(row, dict) or not (isinstance(row.get("prompt"), str)
                                             or isinstance(row.get("messages"), list)):
            raise InputError(f"dataset {path!r} line {n}: needs a 'prompt' string or a 'messages' list")
        rows.append(row)
    if not rows:
        raise InputError(f"dataset {path!r} is empty")
    return rows
