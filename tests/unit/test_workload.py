"""Workload generation: lengths, arrivals, prompts (exact with a real tokenizer), datasets and real traces."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from kvcap.errors import InputError
from kvcap.specs.lengths import parse_length
from kvcap.workload.arrivals import arrival_offsets, parse_arrival
from kvcap.workload.prompts import PromptFactory, TokenCounter, load_dataset
from kvcap.workload.trace import read_trace
from tests.conftest import DATA


def test_length_distributions_are_clamped_and_have_their_moments():
    rng = np.random.default_rng(0)
    assert parse_length("1024").sample(3, rng).tolist() == [1024] * 3
    u = parse_length("uniform:10,20").sample(20_000, rng)
    assert u.min() == 10 and u.max() == 20 and u.mean() == pytest.approx(15, abs=0.1)
    n = parse_length("normal:100,30").sample(20_000, rng)
    assert n.min() >= 1 and n.mean() == pytest.approx(100, rel=0.02)
    ln = parse_length("lognormal:1024,400").sample(50_000, rng)
    assert ln.mean() == pytest.approx(1024, rel=0.02) and ln.std() == pytest.approx(400, rel=0.05)
    for bad in ("0", "uniform:5", "gauss:1,2", "uniform:9,3", "lognormal:-1,2"):
        with pytest.raises(InputError):
            parse_length(bad)


def test_arrivals_rate_cv_and_determinism():
    for spec, cv in (("poisson", 1.0), ("gamma:cv=2", 2.0), ("constant", 0.0)):
        kind, c = parse_arrival(spec)
        t = arrival_offsets(kind, c, 50.0, 200.0, seed=(1, 2))
        gaps = np.diff(t)
        assert len(t) / 200.0 == pytest.approx(50.0, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, abs=0.1)
        assert np.array_equal(t, arrival_offsets(kind, c, 50.0, 200.0, seed=(1, 2)))
    assert len(arrival_offsets("poisson", 1.0, 5.0, 0.0, seed=0, max_n=37)) == 37
    with pytest.raises(InputError):
        parse_arrival("gamma:k=2")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvcap.workload.words import WORDS

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["[UNK]"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [" ".join(WORDS[i: i + 20]) for i in range(0, len(WORDS), 3)] + ["0123456789abcdef: [] System context"]
    tok.train_from_iterator(text * 5, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_prompts_hit_the_target_exactly_with_a_tokenizer(tokenizer_json):
    counter = TokenCounter(tokenizer_json)
    f = PromptFactory(seed=3, input_dist=parse_length("uniform:50,300"), output_dist=parse_length(8), counter=counter,
                      run_id="r")
    for i in range(40):
        r = f.request(i, level=4, repeat=1)
        assert counter.count(r.prompt) == r.input_tokens
    g = PromptFactory(seed=3, input_dist=parse_length(200), output_dist=parse_length(8), counter=counter, run_id="r",
                      prefix_tokens=64, prefix_groups=4)
    assert all(counter.count(g.request(i, 2).prompt) == 64 + 200 == g.request(i, 2).input_tokens for i in range(8))


def test_same_bodies_everywhere_fresh_nonce_per_level_repeat_and_run():
    def make(run_id, seed=0):
        return PromptFactory(seed=seed, input_dist=parse_length(30), output_dist=parse_length(4), run_id=run_id)
    a, b = make("run-a"), make("run-b")
    assert a.identity() == b.identity() != make("run-a", seed=1).identity()
    p = {(lvl, rep): a.request(5, level=lvl, repeat=rep).prompt for lvl in (1, 2) for rep in (0, 1)}
    assert len(set(p.values())) == 4  # a prompt cache cannot carry work from one level or repeat to the next
    bodies = {" ".join(x.split()[4:]) for x in p.values()}  # after the lead word and the three-word nonce
    assert len(bodies) == 1  # ... but the request is the same request
    assert a.request(5, 1).prompt != b.request(5, 1).prompt
    shared = PromptFactory(seed=0, input_dist=parse_length(40), output_dist=parse_length(4), run_id="x",
                           prefix_tokens=10, prefix_groups=2)
    r0, r2 = shared.request(0, 1).prompt.split(), shared.request(2, 1).prompt.split()
    assert len(r0) == len(r2) == 10 + 40  # the prefix and the prompt's own tokens add up
    assert r0[:10] == r2[:10] and r0[10:] != r2[10:]  # same group: lead, level tag and prefix words are identical
    assert r0[4:10] != shared.request(1, 1).prompt.split()[4:10]  # another group, another prefix


def test_dataset_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "hello there world", "output_tokens": 7}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi you"}]}) + "\n")
    rows = load_dataset(str(path))
    f = PromptFactory(seed=0, input_dist=parse_length(1), output_dist=parse_length(5), dataset=rows, run_id="r")
    r0, r1 = f.request(0), f.request(1)
    assert r0.output_tokens == 7 and r0.prompt.endswith("hello there world") and r0.input_tokens == 3
    assert r1.messages is not None and r1.messages[0]["content"].endswith("hi you") and r1.output_tokens == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    with pytest.raises(InputError, match="line 1"):
        load_dataset(str(bad))


def test_real_traces_read():
    conv = read_trace(str(DATA / "traces" / "splitwise_conv.csv.gz"))
    assert len(conv) == 19_366
    assert np.mean([r.input_tokens for r in conv]) == pytest.approx(1155, rel=0.01)
    assert np.mean([r.output_tokens for r in conv]) == pytest.approx(211, rel=0.01)
    moon = read_trace(str(DATA / "traces" / "mooncake_conversation_trace.jsonl.gz"), limit=500)
    assert len(moon) == 500 and moon[0].arrival_s == 0 and moon[0].hash_ids
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(moon))


def test_prompt_cache_is_bounded_and_rebuilt_bodies_are_the_same(monkeypatch):
    """A long run must not keep every prompt body: past the bound they are rebuilt from (seed, i), identically."""
    import kvcap.workload.prompts as prompts

    monkeypatch.setattr(prompts, "CACHE_BYTES", 50_000)
    f = prompts.PromptFactory(seed=1, input_dist=parse_length(64), output_dist=parse_length(4))
    first = [f.body(i) for i in range(200)]
    assert 0 < f._cached_bytes <= 50_000 and len(f._cache) < 200
    # each entry counts its overhead, not only its characters (~400 chars of text + ENTRY_BYTES)
    assert len(f._cache) <= 50_000 // (prompts.ENTRY_BYTES + 64 * 2)
    fresh = prompts.PromptFactory(seed=1, input_dist=parse_length(64), output_dist=parse_length(4))
    assert [f.body(i) for i in range(200)] == first == [fresh.body(i) for i in range(200)]
