"""KV rules against hand-computed values: GQA/MHA, head_dim, MLA, sliding windows, hybrid SSM, weights."""

import json

import pytest

from kvcap.errors import InputError
from kvcap.plan import kv_bytes_per_sequence, kv_bytes_per_token, ssm_state_bytes, weights_bytes
from kvcap.specs.model import load_model, model_from_config, preset_names

BASE = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "vocab_size": 32000}


def spec(**over):
    return model_from_config({**BASE, **over}, name="t", source="test")


# ---- ground truth from the public configs (bytes per token at 16-bit)
@pytest.mark.parametrize(("name", "b16"), [
    ("llama-3-8b", 131_072), ("llama-3.1-8b", 131_072), ("qwen2.5-7b", 57_344), ("llama-3.1-70b", 327_680),
    ("qwen3-8b", 147_456), ("deepseek-v2-lite", 31_104), ("llama-2-7b", 524_288), ("deepseek-v3", 70_272),
    ("mistral-7b", 131_072), ("mixtral-8x7b", 131_072), ("qwen3-32b", 262_144),
])
def test_preset_kv_bytes_per_token(name, b16):
    m = load_model(name)
    assert kv_bytes_per_token(m, 2.0) == b16


def test_fp8_kv_halves():
    assert kv_bytes_per_token(load_model("llama-3-8b"), 1.0) == 65_536


def test_all_presets_load():
    names = preset_names()
    assert len(names) >= 14
    for n in names:
        m = load_model(n)
        assert m.num_parameters > 1e9 and m.parameters_source == "preset"
        assert m.attention_layers >= 1


# ---- the rules, one by one, on small synthetic configs
def test_mha_when_kv_heads_absent():
    m = spec()
    assert m.num_kv_heads == 32 and m.attention_kind == "MHA"
    assert kv_bytes_per_token(m, 2.0) == 2 * 32 * 32 * 128 * 2


def test_gqa_and_explicit_head_dim_wins():
    m = spec(num_key_value_heads=8, head_dim=256)  # Gemma/Qwen3 style: head_dim ≠ hidden/heads
    assert m.attention_kind == "GQA"
    assert kv_bytes_per_token(m, 2.0) == 2 * 32 * 8 * 256 * 2


def test_tensor_parallel_splits_kv_heads_and_replicates_below_one():
    m = spec(num_key_value_heads=8)
    assert kv_bytes_per_token(m, 2.0, tp=4) == 2 * 32 * 2 * 128 * 2
    assert kv_bytes_per_token(m, 2.0, tp=16) == 2 * 32 * 1 * 128 * 2  # one head per rank, replicated


def test_mla_latent_not_doubled_not_split():
    m = spec(kv_lora_rank=512, qk_rope_head_dim=64, num_key_value_heads=32, num_hidden_layers=61)
    assert m.attention == "mla"
    assert kv_bytes_per_token(m, 2.0) == 61 * 576 * 2 == 70_272
    assert kv_bytes_per_token(m, 2.0, tp=8) == 70_272


def test_sliding_window_all_layers():
    m = spec(num_key_value_heads=8, sliding_window=4096)
    per_tok = 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_sequence(m, 1000, 2.0, block_size=1) == 1000 * per_tok
    assert kv_bytes_per_sequence(m, 10_000, 2.0, block_size=1) == 4096 * per_tok


def test_qwen2_use_sliding_window_false_means_full():
    m = spec(num_key_value_heads=4, sliding_window=131072, use_sliding_window=False, max_window_layers=28)
    assert m.sliding_window is None and set(m.layer_kinds) == {"full"}


def test_sliding_pattern_gemma3():
    m = spec(model_type="gemma3_text", num_hidden_layers=12, num_key_value_heads=4, head_dim=256,
             sliding_window=1024, sliding_window_pattern=6)
    assert m.layer_kinds.count("full") == 2 and m.layer_kinds[5] == "full"
    per_layer = 2 * 4 * 256 * 2
    assert kv_bytes_per_sequence(m, 8192, 2.0, block_size=16) == per_layer * (2 * 8192 + 10 * 1024)


def test_gemma2_alternates_local_first():
    m = spec(model_type="gemma2", num_hidden_layers=4, num_key_value_heads=8, head_dim=256, sliding_window=4096)
    assert m.layer_kinds == ("sliding", "full", "sliding", "full")


def test_layer_types_list():
    kinds = ["sliding_attention", "full_attention"] * 2
    m = spec(num_hidden_layers=4, layer_types=kinds, sliding_window=128)
    assert m.layer_kinds == ("sliding", "full", "sliding", "full")


def test_hybrid_jamba_only_attention_layers_hold_kv():
    m = spec(model_type="jamba", num_hidden_layers=32, num_key_value_heads=8, attn_layer_period=8,
             attn_layer_offset=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
    assert m.attention_layers == 4
    assert kv_bytes_per_token(m, 2.0) == 2 * 4 * 8 * 128 * 2
    d_inner = 2 * 4096
    state = 28 * (d_inner * 16 + d_inner * 3) * 2  # per sequence, fixed: no growth with tokens
    assert ssm_state_bytes(m) == state
    assert kv_bytes_per_sequence(m, 1600, 2.0, block_size=16) == 1600 * 2 * 4 * 8 * 128 * 2 + state


def test_weights_by_dtype_and_moe_counts_all_experts():
    m = load_model("mixtral-8x7b")
    assert m.moe is not None and m.moe.num_experts == 8
    assert weights_bytes(m, "bf16") == m.num_parameters * 2
    assert m.num_parameters > 46e9  # all experts, not the ~13B active
    assert 12e9 < m.active_parameters < 14e9
    emb = m.embedding_parameters
    assert weights_bytes(m, "int8") == pytest.approx((m.num_parameters - emb) + emb * 2)
    assert weights_bytes(m, "int4") < weights_bytes(m, "fp8") < weights_bytes(m, "bf16")


def test_parameter_estimate_matches_public_counts():
    # configs without a count get an estimate from their shapes
    for name, exact in (("llama-3.1-8b", 8_030_261_248), ("llama-2-7b", 6_738_415_616),
                        ("mistral-7b", 7_241_732_096)):
        m = load_model(name)
        cfg = json.loads(m.source and _preset_text(name))
        cfg.pop("kvcap", None)
        est = model_from_config(cfg, name=name, source="x")
        assert est.parameters_source == "estimated"
        assert est.num_parameters == pytest.approx(exact, rel=0.01)


def _preset_text(name):
    from importlib import resources
    return resources.files("kvcap.specs.presets").joinpath("models", f"{name}.json").read_text()


@pytest.mark.parametrize(("cfg", "fragment"), [
    ({"hidden_size": 4096}, "lacks 'num_hidden_layers'"),
    ({**BASE, "num_key_value_heads": 5}, "must divide"),
    ({**BASE, "hidden_size": -4}, "positive integer"),
    ({**BASE, "sliding_window": None, "layer_types": ["sliding_attention"] * 32}, "sliding_window"),
    ({**BASE, "layer_types": ["full_attention"] * 3}, "3 entries"),
])
def test_bad_configs(cfg, fragment):
    with pytest.raises(InputError, match=fragment):
        model_from_config(cfg, name="bad", source="bad.json")


def test_unknown_preset_suggests():
    with pytest.raises(InputError, match=r"did you mean llama-3\.1-8b"):
        load_model("llama3.1-8b")


def test_config_file_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_model(str(bad))
    with pytest.raises(InputError, match="not found"):
        load_model(str(tmp_path / "missing" / "config.json"))
    good = tmp_path / "m" / "config.json"
    good.parent.mkdir()
    good.write_text(json.dumps({**BASE, "num_key_value_heads": 8}))
    m = load_model(str(good.parent))
    assert m.name == "m" and m.parameters_source == "estimated"
