"""A tiny random-weights llama-architecture GGUF that real llama.cpp loads and runs.

No model hub is reachable from tests, so this writes a complete model file with
PyPI's ``gguf`` package: F32 tensors (a few hundred KiB), an embedded
SentencePiece-style (``tokenizer.ggml.model = "llama"``) vocabulary and a
ChatML chat template. The text it generates is garbage, but it is a real
model: llama-server loads it, batches it, fills KV cache and streams tokens.

Vocabulary layout (fixed, independent of ``seed``; see :data:`TINY_VOCAB`):

* ``0 <unk>``, ``1 <s>`` (BOS), ``2 </s>`` (EOS)
* ``3..258``: byte-fallback tokens ``<0x00>``..``<0xFF>``
* ``"▁"`` plus one piece per printable ASCII character ``!``..``~``
* every prefix of ``"▁" + word`` for each word in :data:`TINY_WORDS`, so a
  space-separated run of those words tokenizes to exactly one token per word
  (e.g. ``"the cat"`` -> ``▁the``, ``▁cat``); other ASCII text still
  tokenizes, character by character, and anything else via bytes
* ``<|im_start|>``, ``<|im_end|>`` (control tokens used by the chat template;
  llama.cpp treats ``<|im_end|>`` as an end-of-generation token)

The weights are shaped so that sampling never picks "bad" tokens: residual
dimension 0 carries a constant that no layer writes to, and the output rows of
``<unk>``, ``<s>``, the chat control tokens and the bytes ``0x80..0xFF`` have a
large negative weight on it. Their logits are therefore ~-40 below the rest,
so every generated token decodes to complete, printable-ish UTF-8 text and
the server emits one stream chunk per token. EOS is left alone by default
(random, ~0.1 % per step); ``eos_logit_bias > 0`` makes EOS the overwhelmingly
likely next token, which is how a test proves ``ignore_eos`` is honoured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: Whole words that are single tokens (as ``"▁" + word``) in the tiny vocab.
TINY_WORDS: tuple[str, ...] = tuple(
    ["the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "with", "as", "his",
     "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "not", "but", "what", "some", "we", "can",
     "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said", "an", "each", "she", "which",
     "do", "their", "time", "if", "will", "way", "about", "many", "then", "them", "write", "would", "like", "so",
     "these", "her", "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go", "come",
     "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water", "than", "call", "first", "who",
     "may", "down", "side", "been", "now", "find", "any", "new", "work", "part", "take", "get", "place", "made", "live",
     "where", "after", "back", "little", "only", "round", "man", "year", "came", "show", "every", "good", "me", "give",
     "our", "under", "name", "very", "through", "just", "form", "sentence", "great", "think", "say", "help", "low",
     "line", "differ", "turn", "cause", "much", "mean", "before", "move", "right", "boy", "old", "too", "same", "tell",
     "does", "set", "three", "want", "air", "well", "also", "play", "small", "end", "put", "home", "read", "hand",
     "port", "large", "spell", "add", "even", "land", "here", "must", "big", "high", "such", "follow", "act", "why",
     "ask", "men", "change", "went", "light", "kind", "off", "need", "house", "picture", "try", "us", "again", "animal",
     "point", "mother", "world", "near", "build", "self", "earth", "father", "head", "stand", "own", "page", "should",
     "country", "found", "answer", "school", "grow", "study", "still", "learn", "plant", "cover", "food", "sun", "four",
     "between", "state", "keep", "eye", "never", "last", "let", "thought", "city", "tree", "cross", "farm", "hard",
     "start", "might", "story", "saw", "far", "sea", "draw", "left", "late", "run", "while", "press", "close", "night",
     "real", "life", "few", "north", "open", "seem", "together", "next", "white", "children", "begin", "got", "walk",
     "example", "ease", "paper", "group", "always", "music", "those", "both", "mark", "often", "letter", "until",
     "mile", "river", "car", "feet", "care", "second", "book", "carry", "took", "science", "eat", "room", "friend",
     "began", "idea", "fish", "mountain", "stop", "once", "base", "hear", "horse", "cut", "sure", "watch", "color",
     "face", "wood", "main", "enough", "plain", "girl", "usual", "young", "ready", "above", "ever", "red", "list",
     "though", "feel", "talk", "bird", "soon", "body", "dog", "family", "direct", "pose", "leave", "song", "measure",
     "door", "product", "black", "short", "numeral", "class", "wind", "question", "happen", "complete", "ship", "area",
     "half", "rock", "order", "fire", "south", "problem", "piece", "told", "knew", "pass", "since", "top", "whole",
     "king", "space", "heard", "best", "hour", "better", "true", "during", "hundred", "five", "remember", "step",
     "early", "hold", "west", "ground", "interest", "reach", "fast", "verb", "sing", "listen", "six", "table", "travel",
     "less", "morning", "ten", "simple", "several", "vowel", "toward", "war", "lay", "against", "pattern", "slow",
     "center", "love", "person", "money", "serve", "appear", "road", "map", "rain", "rule", "govern", "pull", "cold",
     "notice", "voice", "unit", "power", "town", "fine", "certain", "fly", "fall", "lead", "cry", "dark", "machine",
     "note", "wait", "plan", "figure", "star", "box", "noun", "field", "rest", "correct", "able", "pound", "done",
     "beauty", "drive", "stood", "contain", "front", "teach", "week", "final", "gave", "green", "quick", "develop",
     "ocean", "warm", "free", "minute", "strong", "special", "mind", "behind", "clear", "tail", "produce", "fact",
     "street", "inch", "multiply", "nothing", "course", "stay", "wheel", "full", "force", "blue", "object", "decide",
     "surface", "deep", "moon", "island", "foot", "system", "busy", "test", "record", "boat", "common", "gold",
     "possible", "plane", "stead", "dry", "wonder", "laugh", "thousand", "ago", "ran", "check", "game", "shape",
     "equate", "hot", "miss", "brought", "heat", "snow", "tire", "bring", "yes", "distant", "fill", "east", "paint",
     "language", "among", "cat"]
)

SPACE = "\u2581"  # SentencePiece's word-boundary marker

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class TinyVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    ids: dict[str, int] = field(repr=False)
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    im_start_id: int = -1
    im_end_id: int = -1

    def __len__(self) -> int:
        return len(self.tokens)

    def word_id(self, word: str) -> int:
        """Token id of ``"▁" + word`` (one of :data:`TINY_WORDS`)."""
        return self.ids[SPACE + word]

    def suppressed_ids(self) -> list[int]:
        """Ids that the tiny model never samples (see module docstring)."""
        bad = [self.unk_id, self.bos_id, self.im_start_id, self.im_end_id]
        bad += [self.ids[f"<0x{b:02X}>"] for b in range(0x80, 0x100)]
        return bad


def build_vocab() -> TinyVocab:
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [_UNKNOWN, _CONTROL, _CONTROL]
    scores: list[float] = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(_BYTE)
        scores.append(0.0)

    pieces: list[str] = [SPACE] + [chr(c) for c in range(0x21, 0x7F)]
    seen = set(pieces)
    for word in TINY_WORDS:
        full = SPACE + word
        for i in range(2, len(full) + 1):
            p = full[:i]
            if p not in seen:
                seen.add(p)
                pieces.append(p)
    # SentencePiece scores: the tokenizer merges the highest-scoring pair first;
    # longer pieces score higher, so greedy merging reaches whole words.
    for p in pieces:
        tokens.append(p)
        types.append(_NORMAL)
        scores.append(float(len(p)) - 100.0)

    im_start_id = len(tokens)
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [_CONTROL, _CONTROL]
    scores += [0.0, 0.0]
    ids = {t: i for i, t in enumerate(tokens)}
    assert len(ids) == len(tokens), "duplicate token in tiny vocab"
    return TinyVocab(tokens=tokens, scores=scores, types=types, ids=ids,
                     im_start_id=im_start_id, im_end_id=im_start_id + 1)


#: The vocabulary embedded in every tiny GGUF (fixed; does not depend on seed).
TINY_VOCAB: TinyVocab = build_vocab()


def write_tiny_llama_gguf(
    path: Path,
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ff: int = 128,
    ctx: int = 2048,
    seed: int = 0,
    eos_logit_bias: float = 0.0,
) -> Path:
    """Write a random-weights llama GGUF to ``path`` and return ``path``.

    Same arguments -> byte-identical file. ``ctx`` becomes
    ``llama.context_length`` (the training context: llama-server warns, but
    still runs, when ``--ctx-size`` per slot exceeds it).
    """
    import gguf  # test-only dependency

    if hidden % n_heads or n_heads % n_kv_heads:
        raise ValueError("hidden must be divisible by n_heads, n_heads by n_kv_heads")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = TINY_VOCAB
    n_vocab = len(vocab)
    head_dim = hidden // n_heads
    rng = np.random.default_rng(seed)

    def rand(*shape: int, fan_in: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * (gain / np.sqrt(fan_in))).astype(np.float32)

    # numpy shapes are ggml's ne[] reversed: (rows=out_features, cols=in_features).
    tensors: list[tuple[str, np.ndarray]] = []
    embd = rng.standard_normal((n_vocab, hidden)).astype(np.float32)
    embd[:, 0] = 2.0  # constant "bias" channel that no layer writes to
    tensors.append(("token_embd.weight", embd))
    for i in range(n_layers):
        wo = rand(hidden, n_heads * head_dim, fan_in=n_heads * head_dim, gain=0.5)
        wo[0, :] = 0.0
        down = rand(hidden, ff, fan_in=ff, gain=0.5)
        down[0, :] = 0.0
        tensors += [
            (f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32)),
            (f"blk.{i}.attn_q.weight", rand(n_heads * head_dim, hidden, fan_in=hidden)),
            (f"blk.{i}.attn_k.weight", rand(n_kv_heads * head_dim, hidden, fan_in=hidden)),
            (f"blk.{i}.attn_v.weight", rand(n_kv_heads * head_dim, hidden, fan_in=hidden)),
            (f"blk.{i}.attn_output.weight", wo),
            (f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32)),
            (f"blk.{i}.ffn_gate.weight", rand(ff, hidden, fan_in=hidden)),
            (f"blk.{i}.ffn_up.weight", rand(ff, hidden, fan_in=hidden)),
            (f"blk.{i}.ffn_down.weight", down),
        ]
    tensors.append(("output_norm.weight", np.ones(hidden, dtype=np.float32)))
    out = rand(n_vocab, hidden, fan_in=hidden, gain=2.0)
    out[:, 0] = 0.0
    out[vocab.suppressed_ids(), 0] = -20.0
    out[vocab.eos_id, 0] = float(eos_logit_bias)
    tensors.append(("output.weight", out))

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"kvcap-tiny-llama-L{n_layers}-H{hidden}-s{seed}")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)

    w.add_tokenizer_model("llama")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_unk_token_id(vocab.unk_id)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)

    for name, arr in tensors:
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def words_prompt(n_words: int, *, offset: int = 0) -> str:
    """A prompt of ``n_words`` vocabulary words: exactly ``n_words`` tokens (+1 BOS)."""
    return " ".join(TINY_WORDS[(offset + i) % len(TINY_WORDS)] for i in range(n_words))
