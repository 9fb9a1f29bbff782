"""Scenario files: the validated description of a cluster, a model, how it is served, the workload, the load
plan and the SLO. ``plan``, ``sim`` and ``bench`` manifests all speak these dotted keys (``cluster.nodes``,
``serving.max_num_seqs``…), so an A/B's fixed variables have one vocabulary.

Quantities accept unit strings (``24GiB``, ``100Gbps``, ``500ms``) and are held in base units.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from kvcap.errors import InputError
from kvcap.specs.calibration import CalibrationSection
from kvcap.specs.fields import Bandwidth, Duration, Fraction, Size, Strict, validation_message, without_defaults
from kvcap.specs.load import MOONCAKE_BLOCK_TOKENS, LoadSpec, WorkloadSpec, displaced_by_overrides
from kvcap.units import parse_size

DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
WeightsDtype = Literal["fp32", "fp16", "bf16", "fp8", "int8", "int4"]
KvDtype = Literal["auto", "fp32", "fp16", "bf16", "fp8"]


class GpuRef(Strict):
    preset: str = "rtx4090"
    memory: Size | None = None
    memory_bandwidth: Bandwidth | None = None
    bf16_tflops: float | None = Field(default=None, gt=0)
    fp8_tflops: float | None = Field(default=None, gt=0)


class LinkRef(Strict):
    """A link by preset name and/or explicit figures (explicit figures win)."""

    preset: str | None = None
    bandwidth: Bandwidth | None = None
    latency: Duration | None = None


class SharedStorageSpec(Strict):
    """A KV store shared by every replica: what one replica writes, any other finds. Its read and write
    bandwidths are the store's own, shared by all the copies in flight to or from it."""

    capacity: Size
    read_bandwidth: Bandwidth
    write_bandwidth: Bandwidth
    latency: Duration = 0.0
    """Added to each copy (a file open, an object GET)."""


class ClusterSpec(Strict):
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=1, ge=1)
    gpu: GpuRef = GpuRef()
    host_memory: Size | None = None
    """Physical host RAM per node."""
    host_link: LinkRef = LinkRef()
    """GPU↔host path (PCIe) per GPU; default: the GPU's PCIe generation, x16."""
    interconnect: LinkRef = LinkRef(preset="eth-100g")
    """Node NIC to the other nodes / the remote memory pool, per node."""
    remote_memory: Size | None = None
    """Size of the distributed/remote memory pool available to the KV cache, whole cluster."""
    remote_memory_bandwidth: Bandwidth | None = None
    """The pool's own aggregate bandwidth (a memory server's NIC); default: only the nodes' NICs limit it."""
    shared_storage: SharedStorageSpec | None = None
    """A storage tier every replica reaches over its node's NICs (a shared file system or object store, as llm-d's
    and LMCache's shared storage): used by ``kv_offload`` values with ``storage``."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @model_serializer(mode="wrap")
    def _quiet_storage(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``shared_storage`` appears only where set: a cluster without one serialises as it did before."""
        data: dict[str, Any] = handler(self)
        if data.get("shared_storage", 0) is None:
            del data["shared_storage"]
        return data


class ModelRef(Strict):
    preset: str | None = None
    config: str | None = None
    weights_dtype: WeightsDtype | None = None
    """Default: the checkpoint's own dtype (fp8 for DeepSeek-V3, else its torch_dtype)."""
    kv_dtype: KvDtype = "auto"
    """'auto' = the 16-bit dtype of the weights (vLLM's default)."""
    num_parameters: int | None = Field(default=None, gt=0)

    @property
    def ref(self) -> str:
        if self.config:
            return self.config
        return self.preset or "llama-3.1-8b"


KvOffload = Literal["none", "host", "remote", "host+remote", "storage", "host+storage", "remote+storage",
                    "host+remote+storage"]
TierProfile = Literal["default", "vllm_cpu", "lmcache", "hicache", "kvbm"]
HicacheWritePolicy = Literal["write_through", "write_through_selective", "write_back"]
Engine = Literal["vllm", "llamacpp"]


class StepCost(Strict):
    """A measured per-iteration time (``kvcap calibrate`` fits it) that replaces the roofline cost model:
    step = base + per_decode·sequences sampling + per_prefill_token·prompt tokens + per_context_token·decode KV
    + per_waiting·sequences sampling·requests waiting;
    ``per_request`` is no step's: each request's fixed time outside the engine loop."""

    base: Duration = 0.0
    per_decode: Duration = 0.0
    """Per sequence that samples a token in the step (decoders and prompts finishing their prefill)."""
    per_prefill_token: Duration = 0.0
    per_context_token: Duration = 0.0
    """Per KV token the step's decoders attend to (the sum of their context lengths). Durations refuse negatives."""
    per_request: Duration = 0.0
    """Fixed time each request spends before the scheduler sees it (HTTP, tokenisation, chat template): it delays
    the first token and takes no engine time, so it does not grow with the batch as prefill does."""
    floor: Duration = 0.0
    """A step (a forward pass) takes at least this long; the line above applies where it is longer. The roofline's
    shape: at small batches something the batch does not change (reading the weights, a thread pool's sync) sets
    the step, so a line through small batches alone understates what each sequence costs at large ones. 0: none."""
    per_waiting: Duration = 0.0
    """Per sequence that samples × request waiting at the server for a slot: what each token sent costs for every
    connection queued beside it. llama.cpp's server wakes every waiting HTTP thread for each result it sends
    (``server_response::send`` → ``notify_all``), so a queue at the door slows the steps of those being served.
    0: no such cost (vLLM's front end is asynchronous)."""


VLLM_NULL_BLOCKS = 1
"""Blocks of vLLM's pool no request can hold: ``cache_config_info``'s ``num_gpu_blocks`` counts the null block
its block pool keeps back (``BlockPool.null_block``), so the usable pool is one block less."""

HOST_TIER_DEFAULTS: dict[str, Any] = {"host_kv_tokens": None, "host_kv_scope": "node", "kv_tier_profile": "default",
                                      "hicache_write_policy": "write_through"}
"""ServingSpec keys left out of its serialisation at these values (see ``ServingSpec._quiet_defaults``)."""


class ServingSpec(Strict):
    engine: Engine = "vllm"
    """Scheduling rules: ``vllm`` (paged KV, continuous batching) or ``llamacpp`` (fixed slots, split KV)."""
    tensor_parallel: int = Field(default=1, ge=1)
    pipeline_parallel: int = Field(default=1, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    chunked_prefill: bool = True
    gpu_memory_utilization: Fraction = 0.9
    block_size: int = Field(default=16, ge=1)
    enable_prefix_caching: bool = True
    hash_block_tokens: int = Field(default=MOONCAKE_BLOCK_TOKENS, ge=1)
    """Prompt tokens each of a trace's ``hash_ids`` stands for: Mooncake's traces hash 512-token blocks; a replay
    that hashes its prompts as vLLM does (``benchmarks/published.py``'s sessions) uses ``block_size``."""
    kv_offload: KvOffload = "none"
    host_kv_capacity: Size | None = None
    """Host RAM given to offloaded KV, per node (``host_kv_scope: node``; default half of cluster.host_memory) or
    per replica (``host_kv_scope: replica``)."""
    host_kv_tokens: int | None = Field(default=None, ge=1)
    """The host tier's capacity in KV tokens instead of bytes (per node or per replica, as ``host_kv_scope``
    says): what a pool stated in tokens (or vLLM's ``num_cpu_blocks`` × block size) holds."""
    host_kv_scope: Literal["node", "replica"] = "node"
    """Who shares a host tier: ``node`` (one pool per node, its replicas share it) or ``replica`` (each engine
    instance has a pool of its own, as vLLM's native CPU offloading gives each instance its
    ``cpu_bytes_to_use`` / ``kv_offloading_size``)."""
    kv_tier_profile: TierProfile = "default"
    """Whose rules store and find prefixes in the offload tiers (:class:`kvcap.sim.tiers.TierRules`): ``vllm_cpu``
    (vLLM's native OffloadingConnector: host only, per instance), ``lmcache`` (256-token chunks, every tier,
    looked up CPU then remote then storage), ``hicache`` (SGLang, with ``hicache_write_policy``), ``kvbm``
    (Dynamo: write-through to host and on to storage); ``default``: the first tier only, a hit always loaded."""
    hicache_write_policy: HicacheWritePolicy = "write_through"
    """``kv_tier_profile: hicache``: when a block reaches host memory — ``write_through`` as computed,
    ``write_through_selective`` on its second use, ``write_back`` when the GPU evicts it."""
    runtime_overhead: Size = 650 * 2**20
    """Non-KV, non-weight, non-activation GPU memory (CUDA/cuBLAS/NCCL workspaces, allocator slack, graphs)."""
    reserve: int = Field(default=0, ge=0)
    """Extra per-GPU safety margin (bytes) kept out of the KV pool."""
    offload_admission: Literal["tiers", "hbm"] = "tiers"
    """With an offload tier: ``tiers`` admits past HBM (prefill, first token, park the KV in the tier until HBM has
    room for the whole sequence to decode); ``hbm`` keeps vLLM's rule (tiers hold preempted KV and prefixes)."""
    routing: Literal["round_robin", "least_loaded", "kv_aware", "prefix_aware"] = "least_loaded"
    """How requests are spread over replicas (kv_aware: the longest cached prefix, then the least loaded;
    prefix_aware: llm-d's endpoint picker, a sum of queue, KV-utilisation, GPU-prefix, tier-prefix and
    cold-request scorers, see :mod:`kvcap.sim.engine`)."""
    kv_tokens: int | None = Field(default=None, ge=1)
    """KV pool per replica in tokens, when known (vLLM num_gpu_blocks × block_size, llama.cpp --ctx-size):
    replaces the memory arithmetic; llamacpp splits it evenly over its max_num_seqs slots."""
    kv_unified: bool = False
    """llamacpp only: one KV pool for all slots (``--kv-unified``, llama.cpp's default when ``--parallel`` is left
    to auto), so a step is one forward pass whatever slots are busy; False: split KV (an explicit ``--parallel``),
    a pass per run of consecutive busy slots."""
    step_cost: StepCost | None = None
    """A measured step time that replaces the roofline cost model (None: the roofline)."""

    @model_validator(mode="after")
    def _slots_fit(self) -> ServingSpec:
        if self.engine == "llamacpp" and self.kv_tokens is not None and self.kv_tokens < self.max_num_seqs:
            raise ValueError(f"kv_tokens={self.kv_tokens} is fewer than the {self.max_num_seqs} llamacpp slots "
                             "(each slot needs at least one token)")
        return self

    @model_validator(mode="after")
    def _host_tier_sized(self) -> ServingSpec:
        host = "host" in self.tiers
        if self.host_kv_tokens is not None and self.host_kv_capacity is not None:
            raise ValueError("host_kv_capacity and host_kv_tokens both size the host tier: give one")
        if not host and (self.host_kv_scope != "node" or self.host_kv_tokens is not None):
            raise ValueError(f"host_kv_scope / host_kv_tokens describe a host tier, but kv_offload={self.kv_offload} "
                             "has none (use kv_offload host or host+remote)")
        if self.host_kv_scope == "replica" and self.host_kv_capacity is None and self.host_kv_tokens is None:
            raise ValueError("a per-replica host tier needs its size: host_kv_capacity (bytes per replica) or "
                             "host_kv_tokens")
        return self

    @model_validator(mode="after")
    def _tier_profile_fits(self) -> ServingSpec:
        offload = [t for t in self.tiers if t != "hbm"]  # none: the profile has nothing to apply to (an A/B control)
        per_instance_host = "host" in offload and self.host_kv_scope == "replica"
        if self.kv_tier_profile == "vllm_cpu" and offload and not per_instance_host:
            raise ValueError("kv_tier_profile=vllm_cpu is vLLM's per-instance CPU pool: use kv_offload host with "
                             "host_kv_scope: replica and its size (host_kv_tokens or host_kv_capacity)")
        if self.hicache_write_policy != "write_through" and self.kv_tier_profile != "hicache":
            raise ValueError("hicache_write_policy applies to kv_tier_profile=hicache only")
        return self

    @model_serializer(mode="wrap")
    def _quiet_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The host tier's scope and token size appear (in manifests, A/B fixed variables) only where set: a
        scenario that uses neither serialises as it did before they existed."""
        return without_defaults(handler(self), HOST_TIER_DEFAULTS)

    @field_validator("reserve", mode="before")
    @classmethod
    def _reserve(cls, v: Any) -> int:
        return 0 if v in (0, "0", None) else parse_size(v, "serving.reserve")

    @property
    def tiers(self) -> tuple[str, ...]:
        return ("hbm", *[t for t in self.kv_offload.split("+") if t != "none"])


class Scenario(Strict):
    name: str = "scenario"
    description: str = ""
    cluster: ClusterSpec = ClusterSpec()
    model: ModelRef = ModelRef()
    serving: ServingSpec = ServingSpec()
    workload: WorkloadSpec = WorkloadSpec()
    load: LoadSpec = LoadSpec()
    slo: dict[str, str] = Field(default_factory=dict)
    calibration: CalibrationSection | None = None
    """What ``kvcap calibrate`` fitted this scenario from (runs, coefficients, fit table); the simulator ignores it."""

    @model_validator(mode="after")
    def _shared_storage_makes_sense(self) -> Scenario:
        sv, cl = self.serving, self.cluster
        if "storage" in sv.tiers and cl.shared_storage is None:
            raise ValueError(f"kv_offload={sv.kv_offload} uses a shared storage tier: describe it in "
                             "cluster.shared_storage (capacity, read_bandwidth, write_bandwidth)")
        replicas = cl.gpus // (sv.tensor_parallel * sv.pipeline_parallel)
        if "storage" in sv.tiers and cl.nodes == 1 and replicas <= 1:
            raise ValueError("a shared storage tier needs more than one replica to share it (one node, one "
                             "replica here): use a host tier instead")
        return self

    @field_validator("slo", mode="before")
    @classmethod
    def _slo_strings(cls, v: Any) -> Any:
        return {str(k): str(x) for k, x in (v or {}).items()}


def parse_set(items: list[str] | None) -> dict[str, Any]:
    """``["cluster.nodes=8", "load.concurrency=[8,16]"]`` → {dotted key: YAML-parsed value}."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise InputError(f"--set expects dotted.key=value, got {item!r}")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys into a nested dict (a copy); intermediate mappings are created as needed."""
    result: dict[str, Any] = _deep_copy(data)
    for dotted, value in overrides.items():
        node = result
        parts = dotted.split(".")
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = {} if nxt is None else None
                if nxt is None:
                    raise InputError(f"cannot set {dotted!r}: {part!r} is not a section")
                node[part] = nxt
            node = nxt
        node[parts[-1]] = value
    return result


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def read_yaml(path: str | Path, what: str = "scenario") -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} file {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{what} file {str(p)!r} is not valid YAML: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InputError(f"{what} file {str(p)!r} must hold a mapping at the top level")
    return data


def build_scenario(data: dict[str, Any], where: str = "scenario") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise InputError(validation_message(exc, where)) from None


def load_scenario(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Scenario:
    return load_scenario_noting(path, overrides)[0]


def load_scenario_noting(path: str | Path | None,
                         overrides: dict[str, Any] | None = None) -> tuple[Scenario, list[str]]:
    """The scenario with overrides applied, and a line for each file key an override replaced (for the manifest)."""
    return scenario_noting(read_yaml(path) if path else {}, overrides, where=str(path or "input"))


def scenario_noting(data: dict[str, Any], overrides: dict[str, Any] | None = None,
                    where: str = "input") -> tuple[Scenario, list[str]]:
    """``load_scenario_noting`` from a file's data already read (``kvcap search`` ships it to every worker)."""
    overrides, notes = with_displaced(data, overrides or {})
    return build_scenario(apply_overrides(data, overrides), where=where), notes


def with_displaced(data: dict[str, Any], overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Overrides plus the file's load keys they replace (cleared), and why each was cleared."""
    displaced = displaced_by_overrides(data, overrides)
    return {**overrides, **dict.fromkeys(displaced)}, list(displaced.values())
