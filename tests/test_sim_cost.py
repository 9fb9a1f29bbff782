"""The per-iteration cost model against measured A100 kernels, the article's arithmetic and its own invariants."""

from __future__ import annotations

import csv
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from kvcap.errors import InputError
from kvcap.plan import weights_bytes
from kvcap.sim.cost import (
    BatchShape,
    CostModel,
    all_reduce_time,
    cost_model,
    default_tp_link,
    iteration_time,
    load_calibration,
)
from kvcap.specs.hardware import load_gpu, load_link
from kvcap.specs.model import load_model

ROOT = Path(__file__).resolve().parents[1]
VIDUR = Path(__file__).resolve().parents[2] / "shared" / "data" / "vidur"
GEMMS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
PRESET = {"Meta-Llama-3-8B": "llama-3-8b", "Llama-2-7b-hf": "llama-2-7b"}
SLACK = 0.002  # the documented errors are rounded to 3 significant digits


@pytest.fixture(scope="module")
def a100():
    return load_gpu("a100-80gb")


@pytest.fixture(scope="module")
def llama31():
    return load_model("llama-3.1-8b")


def measured(model: str) -> tuple[dict[str, str], dict[tuple[int, int], tuple[float, float]]]:
    """Vidur's per-layer (GEMM s, elementwise s) by (num_tokens, tp); duplicated rows averaged, as the fit."""
    with (VIDUR / "a100" / "meta-llama" / model / "mlp.csv").open() as f:
        rows = list(csv.DictReader(f))
    groups: dict[tuple[int, int], list[dict[str, str]]] = defaultdict(list)
    for r in rows:
        groups[(int(r["num_tokens"]), int(r["num_tensor_parallel_workers"]))].append(r)

    def ms(rs: list[dict[str, str]], ops: tuple[str, ...]) -> float:
        return sum(sum(float(r[f"time_stats.{op}.median"]) for r in rs) / len(rs) for op in ops) * 1e-3

    return rows[0], {k: (ms(rs, GEMMS), ms(rs, ELEMS)) for k, rs in groups.items()}


# ------------------------------------------------------------------------------------------------ calibration


def test_calibration_files_and_defaults(a100):
    calib = load_calibration(a100)
    assert calib.gpu == "a100-80gb" and calib.defaulted_from is None
    assert load_calibration("a100-40gb") is calib  # same chip family, same file
    borrowed = load_calibration(load_gpu("h100-sxm"))
    assert borrowed.defaulted_from == "a100" and borrowed.gpu == "h100-sxm"
    assert borrowed.compute_efficiency == calib.compute_efficiency
    assert borrowed.memory_efficiency == calib.memory_efficiency
    # attention kernels are not in the data: they borrow the GEMM efficiencies
    assert calib.attention_compute_efficiency is None and calib.attn_compute_efficiency == calib.compute_efficiency
    assert calib.attn_memory_efficiency == calib.memory_efficiency
    assert 0.5 < calib.compute_efficiency < 0.9 and 0.5 < calib.memory_efficiency < 0.95


def test_yaml_is_what_the_script_fits():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "calibrate_cost_model.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("tokens", [1, 64, 512, 4096])
def test_reproduces_measured_gemm_time_llama3_tp1(a100, tokens):
    head, table = measured("Meta-Llama-3-8B")
    model = load_model("llama-3-8b")
    assert (model.num_attention_heads, model.num_kv_heads, model.hidden_size, model.intermediate_size,
            model.vocab_size) == (int(head["n_head"]), int(head["n_kv_head"]), int(head["n_embd"]),
                                  int(head["n_expanded_embd"]), int(head["vocab_size"]))
    calib = load_calibration(a100)
    documented = calib.fit["errors"]["Meta-Llama-3-8B"]["tp1"]["gemm"]
    gemm, _ = CostModel(model, a100).layer_times(tokens)
    err = gemm / table[(tokens, 1)][0] - 1
    assert abs(err) <= documented["max"] + SLACK
    assert err == pytest.approx(calib.fit["llama3_8b_tp1_gemm_per_layer"][f"t{tokens}"]["error"], abs=SLACK)
    if tokens >= 64:  # away from the weight-streaming floor the fit is within a few percent
        assert abs(err) < 0.05


@pytest.mark.parametrize("model", ["Meta-Llama-3-8B", "Llama-2-7b-hf"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_documented_errors_hold_on_every_row(a100, model, tp):
    _, table = measured(model)
    cm = CostModel(load_model(PRESET[model]), a100, tp=tp)
    doc = load_calibration(a100).fit["errors"][model][f"tp{tp}"]
    errs: dict[str, list[float]] = {"gemm": [], "elementwise": [], "layer": []}
    for (tokens, t_tp), (g_meas, e_meas) in table.items():
        if t_tp != tp:
            continue
        g, e = cm.layer_times(tokens)
        errs["gemm"].append(abs(g / g_meas - 1))
        errs["elementwise"].append(abs(e / e_meas - 1))
        errs["layer"].append(abs((g + e) / (g_meas + e_meas) - 1))
    assert len(errs["gemm"]) == doc["rows"]
    for part, values in errs.items():
        values.sort()
        assert values[len(values) // 2] <= doc[part]["median"] + SLACK, part
        assert values[-1] <= doc[part]["max"] + SLACK, part
    assert doc["gemm"]["median"] < 0.08 and doc["layer"]["max"] < 0.3


def test_all_reduce_against_measured(a100):
    calib = load_calibration(a100)
    sizes: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    with (VIDUR / "network" / "a100_pairwise_nvlink" / "all_reduce.csv").open() as f:
        for r in csv.DictReader(f):
            sizes[int(r["num_workers"])][int(r["size"])].append(float(r["time_stats.all_reduce.median"]) * 1e-3)
    nvlink, pcie = default_tp_link(a100, calib), load_link("pcie4-x16")
    for workers, link, key in ((2, nvlink, "tp2_nvlink"), (4, pcie, "tp4_pairwise_nvlink_as_pcie4")):
        big = sorted(abs(all_reduce_time(s, workers, link, calib) / (sum(ts) / len(ts)) - 1)
                     for s, ts in sizes[workers].items() if s >= 2**20)
        doc = calib.fit["all_reduce"][key]["from_1MiB"]
        assert big[len(big) // 2] <= doc["median"] + SLACK and big[-1] <= doc["max"] + SLACK
    assert calib.fit["all_reduce"]["tp2_nvlink"]["from_1MiB"]["median"] < 0.05


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


def test_weight_bytes_agree_with_plan(a100, llama31):
    cost = iteration_time(llama31, a100, BatchShape.of(prefill=[(256, 0)]))
    untied_input_embedding = llama31.vocab_size * llama31.hidden_size * 2
    assert cost.weight_read_bytes == pytest.approx(weights_bytes(llama31, "bf16") - untied_input_embedding)
    tied = load_model("gemma-3-4b")
    assert tied.tie_word_embeddings
    assert iteration_time(tied, a100, BatchShape.of(decode=[10])).weight_read_bytes == pytest.approx(
        weights_bytes(tied, "bf16"), rel=1e-3)
    int4 = iteration_time(llama31, a100, BatchShape.of(decode=[10]), weights_dtype="int4")
    assert int4.weight_read_bytes == pytest.approx(weights_bytes(llama31, "int4") - untied_input_embedding)
    assert int4.gemm_s < 0.5 * iteration_time(llama31, a100, BatchShape.of(decode=[10])).gemm_s


def test_moe_reads_only_the_experts_it_touches(a100):
    mixtral = load_model("mixtral-8x7b")
    all_layers = weights_bytes(mixtral, "bf16") - mixtral.vocab_size * mixtral.hidden_size * 2
    one = iteration_time(mixtral, a100, BatchShape.of(decode=[100]))
    many = iteration_time(mixtral, a100, BatchShape.of(prefill=[(2048, 0)]))
    assert one.weight_read_bytes < 0.4 * all_layers  # 2 of 8 experts plus attention
    assert many.weight_read_bytes == pytest.approx(all_layers, rel=1e-6)
    assert one.flops == pytest.approx(2 * mixtral.active_parameters, rel=0.05)


def test_quadratic_prefill_attention_and_chunking(a100, llama31):
    cm = cost_model(llama31, a100)
    short = cm.iteration_time(BatchShape.of(prefill=[(2048, 0)]))
    long = cm.iteration_time(BatchShape.of(prefill=[(2048, 6144)]))  # same chunk after 6k of context
    pairs_short, pairs_long = 2048 * 2049 / 2, 6144 * 2048 + 2048 * 2049 / 2
    attn_flops = 4 * 32 * 32 * 128
    assert long.flops - short.flops == pytest.approx(attn_flops * (pairs_long - pairs_short))
    assert long.kv_read_bytes == 6144 * 131072 and short.kv_read_bytes == 0
    assert long.gemm_s == short.gemm_s and long.attn_s > short.attn_s


def test_batch_shape_totals():
    shape = BatchShape.of(prefill=[(100, 0), (50, 200)], decode=[10, 20, 30])
    assert (shape.n_prefill_tokens, shape.n_prefill_seqs, shape.prefill_context_tokens) == (150, 2, 200)
    assert shape.prefill_attn_pairs == 100 * 101 / 2 + 200 * 50 + 50 * 51 / 2
    assert (shape.n_decode, shape.decode_context_tokens, shape.n_tokens, shape.n_sampled) == (3, 60, 153, 5)
    windowed = BatchShape.of(prefill=[(100, 0), (50, 200)], decode=[10, 20, 300], window=64)
    assert windowed.decode_window_tokens == 10 + 20 + 64
    assert windowed.prefill_window_context_tokens == 0 + 64
    brute = sum(min(i, 64) for i in range(1, 101)) + sum(min(200 + i, 64) for i in range(1, 51))
    assert windowed.prefill_window_attn_pairs == brute
    merged = shape + windowed
    assert merged.n_decode == 6 and merged.decode_window_tokens == 60 + 94
    assert (shape + BatchShape()).decode_window_tokens is None


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
