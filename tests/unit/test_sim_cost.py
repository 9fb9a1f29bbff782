"""The per-iteration cost model's behaviour: the article's arithmetic, bounds, TP, chunking, sliding windows,
closed-form decode spans, the cached pure function and its speed (fit: test_sim_cost_calibration.py; operator
shapes: test_sim_cost_shapes.py)."""

from __future__ import annotations

import time

import pytest

from kvcap.errors import InputError
from kvcap.sim.batch_shape import BatchShape
from kvcap.sim.calibration_io import load_calibration
from kvcap.sim.cost import CostModel, cost_model, iteration_time
from kvcap.specs.hardware import load_gpu, load_link
from kvcap.specs.model import load_model


@pytest.fixture(scope="module")
def a100():
    return load_gpu("a100-80gb")


@pytest.fixture(scope="module")
def llama31():
    return load_model("llama-3.1-8b")


# ------------------------------------------------------------------------------------------------- behaviour


def test_article_kv_read_per_step(a100, llama31):
    # 24 decoding sequences × 1,280 tokens × 128 KiB ≈ 3.75 GiB of KV read per step
    cost = iteration_time(llama31, a100, BatchShape.of(decode=[1280] * 24))
    assert cost.kv_read_bytes == 24 * 1280 * 131072
    assert cost.kv_read_bytes / 2**30 == pytest.approx(3.75)
    assert cost.kv_write_bytes == 24 * 131072


def test_decode_is_memory_bound_and_prefill_compute_bound(a100, llama31):
    decode = iteration_time(llama31, a100, BatchShape.of(decode=[1024] * 8))
    assert decode.bound == "memory" and decode.compute_s == 0
    prefill = iteration_time(llama31, a100, BatchShape.of(prefill=[(4096, 0)]))
    assert prefill.bound == "compute" and prefill.compute_s > 5 * prefill.memory_s
    # batch-1 decode streams the weights once: TPOT ≈ weights / achieved bandwidth, a little over
    one = iteration_time(llama31, a100, BatchShape.of(decode=[512]))
    stream = one.weight_read_bytes / (a100.memory_bandwidth_bytes_s * load_calibration(a100).memory_efficiency)
    assert stream < one.total_s < 1.25 * stream


def test_doubling_decode_contexts_raises_only_kv_read(a100, llama31):
    short = iteration_time(llama31, a100, BatchShape.of(decode=[1000] * 16))
    long = iteration_time(llama31, a100, BatchShape.of(decode=[2000] * 16))
    assert long.kv_read_bytes == 2 * short.kv_read_bytes
    for part in ("gemm_s", "elem_s", "comm_s", "overhead_s", "weight_read_bytes", "kv_write_bytes", "act_bytes"):
        assert getattr(long, part) == getattr(short, part), part
    assert long.attn_s > short.attn_s
    assert long.total_s - short.total_s == pytest.approx(long.attn_s - short.attn_s)


def test_tensor_parallel_halves_gemm_and_adds_comm(a100, llama31):
    for batch in (BatchShape.of(prefill=[(4096, 0)]), BatchShape.of(decode=[1024] * 8)):
        one = iteration_time(llama31, a100, batch)
        two = iteration_time(llama31, a100, batch, tp=2)
        assert 0.45 < two.gemm_s / one.gemm_s < 0.62
        assert one.comm_s == 0 and one.comm_bytes == 0
        assert two.comm_s > 0 and two.comm_bytes > 0
        assert two.kv_read_bytes == one.kv_read_bytes / 2  # 8 KV heads split over 2 GPUs
    # two all-reduces per layer of tokens × hidden × 2 bytes; in a ring each GPU sends 2(p-1)/p of each
    prefill = iteration_time(llama31, a100, BatchShape.of(prefill=[(4096, 0)]), tp=2)
    assert prefill.comm_bytes == 2 * 32 * (4096 * 4096 * 2) * (2 * 1 / 2)
    # a slower link costs more
    pcie = iteration_time(llama31, a100, BatchShape.of(prefill=[(4096, 0)]), tp=2, tp_link=load_link("pcie4-x16"))
    assert pcie.comm_s > 5 * prefill.comm_s


def test_quadratic_prefill_attention_and_chunking(a100, llama31):
    cm = cost_model(llama31, a100)
    short = cm.iteration_time(BatchShape.of(prefill=[(2048, 0)]))
    long = cm.iteration_time(BatchShape.of(prefill=[(2048, 6144)]))  # same chunk after 6k of context
    pairs_short, pairs_long = 2048 * 2049 / 2, 6144 * 2048 + 2048 * 2049 / 2
    attn_flops = 4 * 32 * 32 * 128
    assert long.flops - short.flops == pytest.approx(attn_flops * (pairs_long - pairs_short))
    assert long.kv_read_bytes == 6144 * 131072 and short.kv_read_bytes == 0
    assert long.gemm_s == short.gemm_s and long.attn_s > short.attn_s


def test_sliding_window_caps_kv_reads(a100):
    mistral = load_model("mistral-7b")  # every layer slides
    window = mistral.sliding_window
    inside = iteration_time(mistral, a100, BatchShape.of(decode=[window] * 4, window=window))
    beyond = iteration_time(mistral, a100, BatchShape.of(decode=[4 * window] * 4, window=window))
    assert beyond.kv_read_bytes == inside.kv_read_bytes and beyond.total_s == inside.total_s


def test_closed_form_decode_span(a100, llama31):
    cm = cost_model(llama31, a100)
    for n, ctx in ((24, 1280), (1, 100), (256, 4000)):
        batch = BatchShape.of(decode=[ctx] * n)
        loop = sum(cm.iteration_time(BatchShape(n_decode=n, decode_context_tokens=n * ctx + i * n)).total_s
                   for i in range(300))
        assert cm.decode_steps_time(batch, 300) == pytest.approx(loop, rel=1e-12)
    assert cm.decode_steps_time(BatchShape.of(decode=[5] * 3), 0) == 0
    with pytest.raises(ValueError):
        cm.decode_steps_time(BatchShape.of(prefill=[(10, 0)], decode=[5]), 10)
    gemma = load_model("gemma-2-9b")  # half the layers slide: summed step by step
    g = cost_model(gemma, a100)
    start = BatchShape.of(decode=[4000] * 2, window=gemma.sliding_window)
    manual = sum(g.iteration_time(BatchShape(n_decode=2, decode_context_tokens=8000 + 2 * i,
                                             decode_window_tokens=min(8000 + 2 * i, 2 * gemma.sliding_window))
                                  ).total_s for i in range(200))
    assert g.decode_steps_time(start, 200) == pytest.approx(manual, rel=1e-12)


def test_pure_function_is_the_cached_cost_model(a100, llama31):
    batch = BatchShape.of(prefill=[(300, 0)], decode=[700] * 5)
    assert cost_model(llama31, a100, tp=2) is cost_model(llama31, a100, tp=2)
    assert iteration_time(llama31, a100, batch, tp=2) == CostModel(llama31, a100, tp=2).iteration_time(batch)
    empty = iteration_time(llama31, a100, BatchShape())
    assert empty.total_s == 0 and empty.kv_read_bytes == 0
    with pytest.raises(InputError):
        iteration_time(llama31, a100, batch, weights_dtype="int3")
    with pytest.raises(InputError):
        iteration_time(llama31, a100, batch, kv_dtype="fp4")
    with pytest.raises(InputError):
        CostModel(llama31, a100, tp=0)


def test_every_preset_costs_sensibly(a100):
    from kvcap.specs.model import preset_names
    for name in preset_names():
        model = load_model(name)
        batch = BatchShape.of(prefill=[(512, 1024)], decode=[2048] * 16, window=model.sliding_window)
        cost = iteration_time(model, a100, batch, tp=8)
        parts = cost.gemm_s + cost.attn_s + cost.elem_s + cost.comm_s + cost.overhead_s
        assert cost.total_s == pytest.approx(parts) and cost.total_s > 0, name
        assert cost.weight_read_bytes > 0 and cost.kv_read_bytes > 0 and cost.flops > 0, name


def test_cost_is_cheap(a100, llama31):
    batch = BatchShape.of(prefill=[(512, 0)], decode=[1280] * 24)
    iteration_time(llama31, a100, batch)
    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        iteration_time(llama31, a100, batch)
    rate = n / (time.perf_counter() - start)
    assert rate > 20_000  # docs/cost-model.md reports ~350k/s; this only catches an accidental O(batch)
