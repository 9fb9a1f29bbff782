"""Write a tiny random-weights Hugging Face Llama that real vLLM (CPU build) loads and serves.

No model hub is reachable from tests, so the model is made here: a Llama config small enough to serve fast on
one core, random weights from a fixed seed, and a word-level tokenizer made with ``tokenizers`` (no training
corpus needed: the vocabulary is given). Every word of kvcap's prompt vocabulary is one token (``▁word``,
Metaspace, so text decodes with its spaces), so a prompt of N words is N tokens plus BOS; the special tokens
are never generated, so every generated token is a word that streams as text.

This file runs under the vLLM venv's interpreter (torch, transformers, tokenizers), not the project's:

    VENV_PYTHON tests/tiny_hf_llama.py OUT_DIR WORDS_JSON

``tests/vllm_cpu.py`` calls it and caches the folder by this file's hash.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>"]
#: A chat template in plain words: role, colon, content, one message per line.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
EXTRA = ["user", "assistant", "system", ":", ".", ",", "?"] + [str(d) for d in range(10)]


def write_tokenizer(out: Path, words: list[str]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = SPECIAL + sorted({"▁" + w for w in [*words, *EXTRA]})
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "model_max_length": 8192, "chat_template": CHAT_TEMPLATE}))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return len(pieces)


def write_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # sharp logits (std ~5) and zero rows for <unk>, <s>, </s>: their logit is 0, below the best of the other
        # words' almost surely, so neither greedy nor sampled text ever gets stuck on a token that decodes to ""
        model.lm_head.weight.mul_(15.0)
        model.lm_head.weight[: len(SPECIAL)] = 0.0
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def main() -> None:
    out, words_json = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = write_tokenizer(out, json.loads(words_json.read_text()))
    write_model(out, vocab_size)


if __name__ == "__main__":
    main()
