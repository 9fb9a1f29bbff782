"""The simulator's hot path (issue 14) takes shortcuts that must change no figure: a pure-decode step's shape built
without the per-sequence conversions, and a cost model that remembers the terms of a step that depend only on its
token and row counts. Each is checked against the general route, to the bit."""

from __future__ import annotations

import pytest

from kvcap.sim import cost as cost_mod
from kvcap.sim.batch_shape import BatchShape
from kvcap.sim.cost import CostModel
from kvcap.specs.hardware import load_gpu
from kvcap.specs.model import load_model


@pytest.mark.parametrize("window", [None, 0, 100, 4096])
def test_decode_only_is_the_general_shape(window: int | None) -> None:
    for contexts in ([], [5], [1030, 99, 4000], list(range(1, 300, 7))):
        assert BatchShape.decode_only(contexts, window) == BatchShape.of(decode=contexts, window=window)


@pytest.mark.parametrize("model", ["llama-2-7b", "mistral-7b", "gemma-2-9b"])
def test_remembered_step_terms_give_the_same_costs(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every field of every IterationCost equals the uncached model's, for prefills, mixed steps and decodes."""
    shapes = [BatchShape.of(prefill=[(c, ctx)], decode=[1024 + d for d in range(n)])
              for c in (1, 17, 512, 2048) for ctx in (0, 300) for n in (0, 1, 9)]
    shapes += [BatchShape.decode_only([1000 + 3 * j for j in range(n)]) for n in (1, 8, 64, 256)]
    cached = CostModel(load_model(model), load_gpu("rtx4090"), weights_dtype="fp16")
    first = [cached.iteration_time(s) for s in shapes]
    again = [cached.iteration_time(s) for s in shapes]  # from the cache now
    monkeypatch.setattr(cost_mod, "LINEAR_CACHE", 0)
    plain = CostModel(load_model(model), load_gpu("rtx4090"), weights_dtype="fp16")
    fresh = [plain.iteration_time(s) for s in shapes]
    assert not plain._linear and cached._linear
    assert first == again == fresh
    for s in shapes[-4:]:
        assert (cached.decode_step_times(s, 40) == plain.decode_step_times(s, 40)).all()
