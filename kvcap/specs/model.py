"""Model specs read from a Hugging Face ``config.json`` (bundled presets are such files too).

One parser for both, so a preset can never disagree with the rule applied to a
user's own config. The spec records the *shape* of the model — which layers hold
per-token KV (full or sliding-window attention, MLA latents), which hold a fixed
per-sequence state (SSM / linear attention), and the parameter count; the KV
arithmetic itself lives in :mod:`kvcap.plan`.
"""

from __future__ import annotations

import difflib
import json
import math
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kvcap.errors import InputError

LayerKind = Literal["full", "sliding", "ssm", "linear"]
"""full/sliding hold per-token KV; ssm (Mamba) and linear (Gated DeltaNet) hold a fixed state per sequence."""


class MoESpec(BaseModel):
    model_config = ConfigDict(frozen=True)
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_intermediate_size: int = 0
    moe_layers: int


class ModelSpec(BaseModel):
    """The serving-relevant shape of a decoder-only LLM."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention: Literal["gqa", "mla"] = "gqa"
    mla_kv_lora_rank: int = 0
    mla_rope_head_dim: int = 0
    layer_kinds: tuple[LayerKind, ...]
    sliding_window: int | None = None
    ssm_state_elements: int = 0
    """Elements of recurrent + convolution state one sequence holds in one ssm/linear layer."""
    moe: MoESpec | None = None
    num_parameters: int
    parameters_source: Literal["preset", "config", "estimated"]
    native_dtype: str = "bf16"
    max_position_embeddings: int | None = None

    @property
    def attention_layers(self) -> int:
        return sum(k in ("full", "sliding") for k in self.layer_kinds)

    @property
    def attention_kind(self) -> str:
        if self.attention == "mla":
            return "MLA"
        if self.num_kv_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def embedding_parameters(self) -> int:
        """Input embedding plus (untied) LM head: usually kept in 16-bit by quantized checkpoints."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def active_parameters(self) -> int:
        """Parameters touched per token (all of them for dense models; routed experts only for MoE)."""
        if self.moe is None:
            return self.num_parameters
        idle = self.moe.num_experts - self.moe.experts_per_token
        idle_params = self.moe.moe_layers * idle * 3 * self.hidden_size * self.moe.expert_intermediate_size
        return max(self.num_parameters - idle_params, 0)


PRESET_DIR = "models"


@cache
def preset_names() -> tuple[str, ...]:
    root = resources.files("kvcap.specs.presets").joinpath(PRESET_DIR)
    return tuple(sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json")))


def close_matches(name: str, choices: tuple[str, ...] | list[str]) -> str:
    key = name.lower()
    prefixed = [c for c in choices if c.startswith(key) or key.startswith(c)]
    near = prefixed + [c for c in difflib.get_close_matches(key, choices, n=3, cutoff=0.5) if c not in prefixed]
    near = near[:3]
    if near:
        return f"did you mean {', '.join(near)}?"
    return f"known: {', '.join(choices)}"


def load_model(ref: str, num_parameters: int | None = None) -> ModelSpec:
    """A preset name (``llama-3.1-8b``) or a path to a config.json (or a folder holding one)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists() or "/" in ref:
        if not path.is_file():
            raise InputError(f"model config {str(path)!r} not found")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"model config {str(path)!r} is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise InputError(f"model config {str(path)!r} must hold a JSON object")
        name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        return model_from_config(cfg, name=name, source=str(path),
                                 num_parameters=num_parameters)
    key = ref.lower()
    if key not in preset_names():
        raise InputError(f"unknown model {ref!r}: {close_matches(key, preset_names())}")
    text = resources.files("kvcap.specs.presets").joinpath(PRESET_DIR).joinpath(f"{key}.json").read_text()
    return model_from_config(json.loads(text), name=key, source=f"preset:{key}", num_parameters=num_parameters)


def _get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def _need_int(cfg: dict[str, Any], key: str, source: str, *alts: str) -> int:
    value = _get(cfg, key, *alts)
    if value is None:
        raise InputError(f"model config {source!r} lacks {key!r}")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"model config {source!r}: {key!r} must be a positive integer, got {value!r}")
    return value


def _layer_kinds(cfg: dict[str, Any], n_layers: int, model_type: str, source: str) -> tuple[list[str], int | None]:
    """Per-layer kind and the sliding window (None when no layer slides)."""
    window = _get(cfg, "sliding_window")
    layer_types = cfg.get("layer_types") or cfg.get("layers_block_type")
    kinds: list[str]
    if layer_types:
        if len(layer_types) != n_layers:
            raise InputError(f"model config {source!r}: layer_types has {len(layer_types)} entries "
                             f"for {n_layers} layers")
        table = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding",
                 "linear_attention": "linear", "mamba": "ssm", "mamba2": "ssm"}
        try:
            kinds = [table[t] for t in layer_types]
        except KeyError as exc:
            raise InputError(f"model config {source!r}: unknown layer type {exc.args[0]!r}") from None
    elif cfg.get("attn_layer_period"):  # Jamba: one attention layer every period, at offset
        period, offset = int(cfg["attn_layer_period"]), int(cfg.get("attn_layer_offset", 0))
        kinds = ["full" if i % period == offset else "ssm" for i in range(n_layers)]
    elif cfg.get("full_attention_interval"):  # Qwen3-Next: Gated DeltaNet with full attention every k-th layer
        k = int(cfg["full_attention_interval"])
        kinds = ["full" if (i + 1) % k == 0 else "linear" for i in range(n_layers)]
    elif window is None or cfg.get("use_sliding_window") is False:
        kinds = ["full"] * n_layers
    elif cfg.get("sliding_window_pattern") or model_type in ("gemma3", "gemma3_text"):
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        kinds = ["sliding" if (i + 1) % pattern else "full" for i in range(n_layers)]
    elif model_type == "gemma2":  # alternating local/global, local first
        kinds = ["sliding" if (i + 1) % 2 else "full" for i in range(n_layers)]
    elif cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:  # Qwen2 style
        first = int(cfg["max_window_layers"])
        kinds = ["sliding" if i >= first else "full" for i in range(n_layers)]
    else:  # Mistral v0.1: every layer slides
        kinds = ["sliding"] * n_layers
    if "sliding" in kinds:
        if not isinstance(window, int) or window <= 0:
            raise InputError(f"model config {source!r}: sliding layers need a positive 'sliding_window'")
    else:
        window = None
    return kinds, window


def _ssm_state_elements(cfg: dict[str, Any], hidden: int, kinds: list[str]) -> int:
    if "ssm" in kinds:
        d_inner = int(_get(cfg, "mamba_expand", default=2)) * hidden
        d_state = int(_get(cfg, "mamba_d_state", "state_size", default=16))
        d_conv = int(_get(cfg, "mamba_d_conv", "conv_kernel", default=4))
        return d_inner * d_state + d_inner * (d_conv - 1)
    if "linear" in kinds:
        k_heads = int(_get(cfg, "linear_num_key_heads", default=16))
        v_heads = int(_get(cfg, "linear_num_value_heads", default=32))
        k_dim = int(_get(cfg, "linear_key_head_dim", default=128))
        v_dim = int(_get(cfg, "linear_value_head_dim", default=128))
        kernel = int(_get(cfg, "linear_conv_kernel_dim", default=4))
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        return v_heads * k_dim * v_dim + conv_dim * (kernel - 1)
    return 0


def _moe(cfg: dict[str, Any], n_layers: int, intermediate: int) -> MoESpec | None:
    experts = _get(cfg, "num_local_experts", "n_routed_experts", "num_experts")
    if not experts or int(experts) <= 1:
        return None
    per_tok = int(_get(cfg, "num_experts_per_tok", "num_experts_per_token", default=2))
    expert_inter = int(_get(cfg, "moe_intermediate_size", default=intermediate))
    shared = int(_get(cfg, "shared_expert_intermediate_size", default=0))
    if not shared and cfg.get("n_shared_experts"):
        shared = int(cfg["n_shared_experts"]) * expert_inter
    if cfg.get("first_k_dense_replace") is not None:
        moe_layers = n_layers - int(cfg["first_k_dense_replace"])
    elif cfg.get("expert_layer_period"):
        period, offset = int(cfg["expert_layer_period"]), int(cfg.get("expert_layer_offset", 0))
        moe_layers = sum(1 for i in range(n_layers) if i % period == offset)
    else:
        step = int(_get(cfg, "decoder_sparse_step", default=1))
        moe_layers = sum(1 for i in range(n_layers) if (i + 1) % step == 0)
    return MoESpec(num_experts=int(experts), experts_per_token=per_tok, expert_intermediate_size=expert_inter,
                   shared_intermediate_size=shared, moe_layers=moe_layers)


def _native_dtype(cfg: dict[str, Any]) -> str:
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    if method in ("awq", "gptq", "marlin"):
        return "int4" if int(quant.get("bits", 4)) == 4 else "int8"
    dtype = str(_get(cfg, "torch_dtype", "dtype", default="bfloat16"))
    # engines serve fp32 checkpoints in 16-bit (vLLM "auto"), so fp32 is not a serving default
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"}.get(dtype, "bf16")


def model_from_config(cfg: dict[str, Any], name: str, source: str, num_parameters: int | None = None) -> ModelSpec:
    """Build a ModelSpec from a parsed HF config; every rule for KV-relevant shape is here."""
    meta = cfg.get("kvcap") or {}
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers (Gemma 3, Llava…): the language model
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    model_type = str(cfg.get("model_type", "unknown"))
    hidden = _need_int(cfg, "hidden_size", source, "d_model", "n_embd")
    n_layers = _need_int(cfg, "num_hidden_layers", source, "n_layer", "num_layers")
    heads = _need_int(cfg, "num_attention_heads", source, "n_head")
    kv_heads = _get(cfg, "num_key_value_heads", "num_kv_heads", "multi_query_group_num", default=heads)
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        raise InputError(f"model config {source!r}: num_key_value_heads={kv_heads!r} must divide "
                         f"num_attention_heads={heads}")
    head_dim = _get(cfg, "head_dim")
    if head_dim is None:
        if hidden % heads:
            raise InputError(f"model config {source!r}: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}; give head_dim")
        head_dim = hidden // heads
    vocab = _need_int(cfg, "vocab_size", source, "padded_vocab_size")
    intermediate = int(_get(cfg, "intermediate_size", "ffn_hidden_size", "n_inner", default=4 * hidden))
    kinds, window = _layer_kinds(cfg, n_layers, model_type, source)
    mla = cfg.get("kv_lora_rank") is not None
    spec_kwargs: dict[str, Any] = dict(
        name=name, source=source, model_type=model_type, hidden_size=hidden, intermediate_size=intermediate,
        num_layers=n_layers, num_attention_heads=heads, num_kv_heads=int(kv_heads), head_dim=int(head_dim),
        vocab_size=vocab, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),  # HF default: tied
        attention="mla" if mla else "gqa",
        mla_kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        mla_rope_head_dim=int(cfg.get("qk_rope_head_dim") or 0) if mla else 0,
        layer_kinds=tuple(kinds), sliding_window=window,
        ssm_state_elements=_ssm_state_elements(cfg, hidden, kinds),
        moe=_moe(cfg, n_layers, intermediate), native_dtype=_native_dtype(cfg),
        max_position_embeddings=cfg.get("max_position_embeddings"),
    )
    if num_parameters is not None:
        count, how = int(num_parameters), "config"
    elif isinstance(meta.get("num_parameters"), int):
        count, how = int(meta["num_parameters"]), "preset"
    else:
        count, how = 0, "estimated"
    spec = ModelSpec(num_parameters=max(count, 1), parameters_source=how, **spec_kwargs)
    if how == "estimated":
        spec = spec.model_copy(update={"num_parameters": estimate_parameters(spec, cfg)})
    return spec


def estimate_parameters(spec: ModelSpec, cfg: dict[str, Any]) -> int:
    """Parameter count from the shapes, for configs that do not state it (norms and biases ignored)."""
    h, hd = spec.hidden_size, spec.head_dim
    total = spec.embedding_parameters
    if spec.attention == "mla":
        nope = int(cfg.get("qk_nope_head_dim") or hd)
        rope = spec.mla_rope_head_dim
        v_dim = int(cfg.get("v_head_dim") or hd)
        q_lora = cfg.get("q_lora_rank")
        q_out = spec.num_attention_heads * (nope + rope)
        q = h * q_lora + q_lora * q_out if q_lora else h * q_out
        attn = (q + h * (spec.mla_kv_lora_rank + rope)
                + spec.mla_kv_lora_rank * spec.num_attention_heads * (nope + v_dim)
                + spec.num_attention_heads * v_dim * h)
    else:
        attn = h * spec.num_attention_heads * hd * 2 + h * spec.num_kv_heads * hd * 2
    total += attn * spec.attention_layers
    if spec.ssm_state_elements:
        if "ssm" in spec.layer_kinds:
            d_inner = int(cfg.get("mamba_expand", 2)) * h
            d_state = int(cfg.get("mamba_d_state", 16))
            dt_rank = int(cfg.get("mamba_dt_rank") or math.ceil(h / 16))
            per = (h * 2 * d_inner + d_inner * int(cfg.get("mamba_d_conv", 4))
                   + d_inner * (dt_rank + 2 * d_state) + dt_rank * d_inner + d_inner * d_state + d_inner * h)
        else:
            kh, vh = int(cfg.get("linear_num_key_heads", 16)), int(cfg.get("linear_num_value_heads", 32))
            kd, vd = int(cfg.get("linear_key_head_dim", 128)), int(cfg.get("linear_value_head_dim", 128))
            per = h * (2 * kh * kd + 2 * vh * vd) + h * 2 * vh + vh * vd * h
        total += per * (spec.num_layers - spec.attention_layers)
    mlp_dense = 3 * h * spec.intermediate_size
    if spec.moe is None:
        total += mlp_dense * spec.num_layers
    else:
        moe = spec.moe
        per_moe = (moe.num_experts * 3 * h * moe.expert_intermediate_size + 3 * h * moe.shared_intermediate_size
                   + h * moe.num_experts)
        total += per_moe * moe.moe_layers + mlp_dense * (spec.num_layers - moe.moe_layers)
    return int(total)
