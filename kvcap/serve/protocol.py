"""The OpenAI wire format the front end speaks: request validation, SSE frames, usage blocks and error bodies.

Why a module of its own: what a client sees byte for byte (vLLM's field order, ids, ``[DONE]``) is decided
here and nowhere else, so the handlers only choose *when* to send and the format can be tested without a
server. The tokenizer is deliberately trivial: one token per whitespace-separated word (or, as a second known
tokenizer, ``chars4``: a word of n characters is ⌈n/4⌉ tokens), and output token ``i`` is the word ``"w{i} "``, so
a client re-counting words gets the true count.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any


class BadRequest(Exception):
    """A request the front end refuses before generating: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.err_type = status, message, err_type


@dataclass(frozen=True)
class ApiConfig:
    """What the API promises, whatever engine is behind it: the model id, its context length, how many tokens
    one SSE event carries and (``eos_after``) when generation stops on its own unless ``ignore_eos``."""

    model_name: str = "fake-model"
    tokens_per_chunk: int = 1
    eos_after: int | None = None
    max_model_len: int = 131072
    tokenizer: str = "words"
    """How prompt text is counted (:data:`TOKENIZERS`): a second tokenizer lets tests check that a client sizes
    its prompts by the server's count, not its own."""
    prompt_overhead: int = 0
    """Tokens added to every text prompt's count, as a BOS token or a chat template adds them."""
    tokenize: bool = True
    """Serve ``POST /tokenize`` (vLLM's shape); without it a client can only learn counts from ``usage``."""


TOKENIZERS = ("words", "chars4")


@dataclass
class Job:
    """One parsed generation request and its planned outcome (the front end decides the length up front)."""

    chat: bool
    stream: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    n_out: int
    finish_reason: str
    include_usage: bool
    t_arrival: float
    created: int
    index: int = -1
    block_hashes: list[int] | None = None
    """The prompt's chained block hashes when the engine caches prefixes (else None: nothing was hashed)."""


def count_text(text: str, tokenizer: str = "words") -> int:
    """Tokens of ``text``: one per whitespace-separated word, or ⌈characters/4⌉ per word (``chars4``)."""
    if tokenizer == "chars4":
        return sum(-(-len(w) // 4) for w in text.split())
    return len(text.split())


def count_prompt(body: dict[str, Any], chat: bool, cfg: ApiConfig | None = None) -> int:
    """Prompt tokens of a completions (``prompt``) or chat (``messages``) body by ``cfg``'s tokenizer (one token
    per word by default), plus its ``prompt_overhead`` for text (token ids are counted as they are)."""
    tokenizer, overhead = (cfg.tokenizer, cfg.prompt_overhead) if cfg is not None else ("words", 0)
    if chat:
        return _count_messages(body.get("messages"), tokenizer) + overhead
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)  # token ids
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise BadRequest(400, "prompt must be a string or a list of one string (batched prompts unsupported)")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest(400, "prompt must be a string")
    return count_text(prompt, tokenizer) + overhead


SPECIAL_TOKEN = "<|special{}|>"
"""The text of the ``i``-th of the ``prompt_overhead`` tokens put before every text prompt (a BOS token, a chat
template's): the same for every prompt, so they hash into the first block like any shared prefix."""


def text_tokens(text: str, tokenizer: str = "words") -> list[str]:
    """The tokens of ``text`` that :func:`count_text` counts: the words, or each word's 4-character pieces."""
    if tokenizer == "chars4":
        return [w[i:i + 4] for w in text.split() for i in range(0, len(w), 4)]
    return text.split()


def prompt_token_words(body: dict[str, Any], chat: bool, cfg: ApiConfig | None = None) -> list[str]:
    """The prompt as the token sequence that :func:`count_prompt` counts (as long as its count), for hashing its
    blocks: the overhead tokens first (text prompts), then the words of the prompt or of each message's content in
    order; token ids as their decimal text. Call only on a body :func:`parse_job` accepted."""
    tokenizer, overhead = (cfg.tokenizer, cfg.prompt_overhead) if cfg is not None else ("words", 0)
    special = [SPECIAL_TOKEN.format(i) for i in range(overhead)]
    if chat:
        out = special
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, str):
                out += text_tokens(content, tokenizer)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict):
                        out += text_tokens(str(part.get("text", "")), tokenizer)
        return out
    prompt = body["prompt"]
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return [str(t) for t in prompt]
        prompt = prompt[0]
    return special + text_tokens(prompt, tokenizer)


def _count_messages(messages: Any, tokenizer: str) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadRequest(400, "messages must be a non-empty list")
    n = 0
    for m in messages:
        if not isinstance(m, dict):
            raise BadRequest(400, "each message must be an object")
        content = m.get("content")
        if isinstance(content, str):
            n += count_text(content, tokenizer)
        elif isinstance(content, list):  # OpenAI content parts: count the text ones
            n += sum(count_text(str(p.get("text", "")), tokenizer) for p in content if isinstance(p, dict))
        elif content is not None:
            raise BadRequest(400, "message content must be a string")
    return n


def _int_field(body: dict[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(400, f"{key} must be an integer")
    return v


def parse_job(cfg: ApiConfig, body: Any, chat: bool, t_arrival: float) -> Job:
    """Validate like vLLM and decide the output length and finish reason up front; raises :class:`BadRequest`."""
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != cfg.model_name:
        raise BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")
    if body.get("n", 1) != 1:
        raise BadRequest(400, "n > 1 is not supported by the fake server")
    prompt_tokens = count_prompt(body, chat, cfg)
    max_tokens = _int_field(body, "max_completion_tokens" if chat and "max_tokens" not in body else "max_tokens", 16)
    assert max_tokens is not None
    if max_tokens < 1:
        raise BadRequest(400, f"max_tokens must be at least 1, got {max_tokens}.")
    min_tokens = _int_field(body, "min_tokens", 0) or 0
    if min_tokens < 0 or min_tokens > max_tokens:
        raise BadRequest(400, f"min_tokens must be in [0, max_tokens], got {min_tokens}")
    if prompt_tokens + max_tokens > cfg.max_model_len:
        raise BadRequest(400, f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                              f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                              f"{max_tokens} in the completion). Please reduce the length of the messages or "
                              f"completion.")
    n_out, finish = max_tokens, "length"
    if cfg.eos_after is not None and not body.get("ignore_eos", False):
        eos_at = max(cfg.eos_after, min_tokens, 1)
        if eos_at < max_tokens:
            n_out, finish = eos_at, "stop"
    opts = body.get("stream_options")
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return Job(chat=chat, stream=bool(body.get("stream", False)), model=cfg.model_name, prompt_tokens=prompt_tokens,
               max_tokens=max_tokens, n_out=n_out, finish_reason=finish, include_usage=include_usage,
               t_arrival=t_arrival, created=int(time.time()))


# ------------------------------------------------------------------------------------------- generated text

_WORDS: list[str] = []


def token_text(i: int) -> str:
    """Text of output token ``i``: one whitespace-delimited word, so the fake tokenizer counts it as one."""
    while len(_WORDS) <= i:
        _WORDS.extend(f"w{k} " for k in range(len(_WORDS), max(2 * len(_WORDS), 1024)))
    return _WORDS[i]


def tokens_text(start: int, stop: int) -> str:
    """Text of output tokens ``start`` … ``stop - 1``."""
    return "".join(token_text(i) for i in range(start, stop))


def usage_block(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """vLLM's usage object. ``prompt_tokens_details`` only with cached tokens: vLLM adds it only when started with
    ``--enable-prompt-tokens-details`` and only for a request that found some (the caller passes 0 otherwise)."""
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                         "completion_tokens": completion_tokens}
    if cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def response_id(job: Job) -> str:
    return ("chatcmpl-fake" if job.chat else "cmpl-fake") + f"{job.index:024d}"


def completion_body(job: Job, n_out: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The whole (non-streaming) response of a request that produced ``n_out`` tokens (``cached_tokens``: see
    :func:`usage_block`)."""
    text = tokens_text(0, n_out)
    if job.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": job.finish_reason, "stop_reason": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": job.finish_reason,
                  "stop_reason": None}
        obj = "text_completion"
    return {"id": response_id(job), "object": obj, "created": job.created, "model": job.model, "choices": [choice],
            "usage": usage_block(job.prompt_tokens, n_out, cached_tokens)}


# --------------------------------------------------------------------------------------------------- SSE frames

DONE = b"data: [DONE]\n\n"


class SseFrames:
    """Byte templates for one request's SSE events: only the token text and finish reason are spliced in, so a
    stream of thousands of events costs one ``join`` each."""

    def __init__(self, job: Job) -> None:
        model = json.dumps(job.model)
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        head = f'{{"id":"{response_id(job)}","object":"{obj}","created":{job.created},"model":{model},'
        self.head = head
        if job.chat:
            self.pre = f'data: {head}"choices":[{{"index":0,"delta":{{"content":"'.encode()
            self.mid = b'"},"logprobs":null,"finish_reason":'
        else:
            self.pre = f'data: {head}"choices":[{{"index":0,"text":"'.encode()
            self.mid = b'","logprobs":null,"finish_reason":'
        self.post = b"}]}\n\n"

    def chunk(self, text: str, finish: str | None) -> bytes:
        fr = b"null" if finish is None else b'"' + finish.encode() + b'"'
        return b"".join((self.pre, text.encode(), self.mid, fr, self.post))

    def role(self) -> bytes:
        """The chat stream's first event: the assistant role, no content."""
        return (f'data: {self.head}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                f'"logprobs":null,"finish_reason":null}}]}}\n\n').encode()

    def usage(self, job: Job, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        u = usage_block(job.prompt_tokens, completion_tokens, cached_tokens)
        return f'data: {self.head}"choices":[],"usage":{json.dumps(u, separators=(",", ":"))}}}\n\n'.encode()


def error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    """OpenAI-style error JSON, as vLLM sends it."""
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}
