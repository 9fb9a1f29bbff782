"""The engine's faster paths (issue 14) must change no figure: each is checked against the general route it stands
in for, to the bit — a span's step ends summed in Python, one roofline line where it clearly leads, a mixed step's
shape summed in one pass, the step time without its breakdown, a decoder's blocks without a call each, records
built without ``round`` on their zeros, and ``round_to`` in place of ``round``."""

from __future__ import annotations

import dataclasses
import math
import random
import struct

import numpy as np
import pytest

from kvcap.sim.batch_shape import BatchShape
from kvcap.sim.cost import _PY_STEPS, CostModel
from kvcap.sim.cost_empirical import EmpiricalCost
from kvcap.sim.kv import BlockPool
from kvcap.sim.replica import _mixed_shape
from kvcap.sim.request import SimRequest
from kvcap.sim.rounding import round_to
from kvcap.sim.run import record_of
from kvcap.specs.hardware import load_gpu
from kvcap.specs.model import load_model


def _general_step_times(cm: CostModel, batch: BatchShape, steps: int) -> np.ndarray:
    """The span's step times as the simulator computed them before: both lines, their maximum."""
    n, ctx = batch.n_decode, batch.decode_context_tokens
    fpair, fkv, ftok = cm._attn.full_pair_s, cm._attn.full_context_s, cm._attn.full_token_s
    c0, m0 = fpair * ctx, fkv * ctx + ftok * n
    i = np.arange(steps, dtype=float)
    return (cm.iteration_time(batch).total_s - max(c0, m0)) + np.maximum(c0 + fpair * n * i, m0 + fkv * n * i)


def _spans() -> list[tuple[BatchShape, int]]:
    rng = random.Random(14)
    spans = [(BatchShape.decode_only([rng.randrange(1, 40_000) for _ in range(rng.randrange(1, 300))]),
              rng.randrange(1, 3 * _PY_STEPS)) for _ in range(150)]
    spans += [(BatchShape.decode_only([c] * n), k) for c in (1, 100, 2000, 30_000) for n in (1, 7, 64, 512)
              for k in (1, 2, _PY_STEPS, _PY_STEPS + 1, 500)]
    return spans


@pytest.mark.parametrize("model", ["llama-2-7b", "llama-3.1-8b", "mistral-7b"])
@pytest.mark.parametrize("gpu", ["rtx4090", "a100-80gb"])
@pytest.mark.parametrize("compute_heavy", [False, True])
def test_span_step_ends_are_the_general_cumsum_to_the_bit(model: str, gpu: str, compute_heavy: bool) -> None:
    """Short spans summed in Python and one-line spans equal t0 + cumsum(max of both lines), float for float.
    Real decode attention is memory-bound throughout; ``compute_heavy`` prices a query-key pair at 1.5× a context
    token's read, so the compute line leads some spans and the lines cross inside others."""
    cm = CostModel(load_model(model), load_gpu(gpu), weights_dtype="fp16")
    if compute_heavy:
        cm._attn = dataclasses.replace(cm._attn, full_pair_s=1.5 * cm._attn.full_context_s)
    for batch, k in _spans():
        times = cm.decode_step_times(batch, k)
        if not cm._attn.sliding_pair_s:  # full attention only: sliding-window models price each step, unchanged
            assert times.tobytes() == _general_step_times(cm, batch, k).tobytes()
        expected = times.cumsum()
        expected += 123.456789
        assert cm.decode_step_ends(batch, k, 123.456789).tobytes() == expected.tobytes()
        assert cm.step_time(batch) == cm.iteration_time(batch).total_s


def test_empirical_span_step_ends_are_its_cumsum() -> None:
    cost = EmpiricalCost(load_model("llama-3.1-8b"), base=0.02, per_decode=0.003, per_prefill_token=1e-4,
                         per_context_token=1e-6)
    batch = BatchShape.decode_only([100, 300, 50])
    assert cost.decode_step_ends(batch, 40, 7.5).tolist() == (7.5 + cost.decode_step_times(batch, 40).cumsum()).tolist()
    assert cost.step_time(batch) == cost.iteration_time(batch).total_s


@pytest.mark.parametrize("window", [None, 4096])
def test_mixed_step_shape_is_the_general_shape(window: int | None) -> None:
    rng = random.Random(5)
    for _ in range(200):
        prefills = [(SimRequest(rid=i, arrival=0.0, prompt=9000, max_out=1, kv=rng.randrange(0, 8000)),
                     rng.randrange(0 if rng.random() < 0.1 else 1, 2048)) for i in range(rng.randrange(1, 4))]
        decoders = [SimRequest(rid=9 + i, arrival=0.0, prompt=1, max_out=1, kv=rng.randrange(1, 9000))
                    for i in range(rng.randrange(0, 40))]
        general = BatchShape.of(prefill=[(c, r.kv) for r, c in prefills], decode=[r.kv for r in decoders],
                                window=window)
        assert _mixed_shape(prefills, decoders, window) == general


@pytest.mark.parametrize("custom", [False, True])
def test_decoder_blocks_to_take_are_private_need(custom: bool) -> None:
    """The inlined ceil(T / block) (or the model's own blocks_for) minus blocks held, shared prefix included."""
    pool = BlockPool(10_000, 16, 32, (lambda t: -(-min(t, 4096) // 16)) if custom else None)
    rng = random.Random(3)
    reqs = [SimRequest(rid=i, arrival=0.0, prompt=500, max_out=500, kv=rng.randrange(1, 5000),
                       blocks=rng.randrange(0, 300), shared=tuple(range(rng.choice([0, 0, 3]))))
            for i in range(100)]
    for steps in (1, 2, 17, 300):
        assert pool._more_blocks(reqs, steps) == [pool.private_need(r, r.kv + steps) if not r.shared else
                                                  pool.blocks_for(r.kv + steps) - r.blocks
                                                  - len(r.shared) * pool.hash_blocks for r in reqs]


def test_a_record_without_parked_or_copy_time_is_unchanged() -> None:
    req = SimRequest(rid=1, arrival=0.25, prompt=10, max_out=2, tags={"mode": "concurrency", "level": 1,
                                                                      "repeat": 0, "phase": "measure"})
    req.out, req.t_sched, req.t_first, req.chunks = 2, 0.5, 0.75, [np.array([0.75]), np.array([1.0])]
    rec = record_of(req, 10.0)
    assert (rec["parked_ms"], rec["copy_ms"]) == (round(0.0 * 1e3, 3), round(0.0 * 1e3, 3))
    assert str(rec["parked_ms"]) == "0.0" and rec["itl_ms"] == [250.0] and rec["queue_ms"] == 250.0
    req.parked_s, req.copy_s = 0.0012345, 1e-7
    rec = record_of(req, 10.0)
    assert (rec["parked_ms"], rec["copy_ms"]) == (round(1.2345, 3), round(1e-4, 3))


def test_round_to_is_round_bit_for_bit() -> None:
    """Random magnitudes from 1e-8 to 1e13, both signs, every digit count the records use; values at a decimal half
    and one ulp either side of it (where the arithmetic must give way to the builtin); zeros of both signs, huge,
    infinite and NaN — the same bits as ``round`` (the compiled build's C arithmetic included, when it runs)."""
    rng = random.Random(11)
    values: list[tuple[float, int]] = []
    for _ in range(200_000):
        k = rng.randrange(7)
        values.append((rng.choice((1.0, -1.0)) * 10 ** rng.uniform(-8, 13), k))
        half = (rng.randrange(10**9) + 0.5) / 10**k
        values += [(half, k), (math.nextafter(half, 0.0), k), (math.nextafter(half, math.inf), k), (-half, k)]
    for x in (0.0, -0.0, 1e-20, -1e-20, 0.0004999, -0.0005, 2.675, 1.0005, 0.1 + 0.2, 1e12, 1e300, math.inf,
              -math.inf, math.nan):
        values += [(x, k) for k in range(7)]
    pack = struct.Struct("d").pack
    differ = [(x, k) for x, k in values if pack(round_to(x, k)) != pack(round(x, k))
              and not (math.isnan(x) and math.isnan(round_to(x, k)))]
    assert not differ, differ[:5]
