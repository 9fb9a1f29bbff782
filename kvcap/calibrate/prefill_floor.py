"""The least time a prompt can take when the server computes it: what tells a prefix-cache hit from a prefill.

Why: a profile whose prompts the server found in its prefix cache (vLLM V1 caches by default; a benchmark that
re-sends its prompts hits it) answers TTFT faster than any GPU could compute them, and a fit on it prices
prefill as a cache hit. The floor is the prompt's FLOPs — 2 × the parameters a token passes through (embeddings
aside) × its tokens — at the GPU's dense 16-bit peak; a measured TTFT below it was (partly) served from the cache.
"""

from __future__ import annotations

from kvcap.specs.hardware import load_gpu
from kvcap.specs.model import load_model
from kvcap.specs.scenario import Scenario


def prefill_floor_s(scenario: Scenario, prompt_tokens: float) -> float:
    """Seconds ``prompt_tokens`` take at the peak FLOPs of the scenario's GPU (fp16 where the weights are fp16
    and the GPU states it, else bf16) for its model: no real prefill of them is faster."""
    model = load_model(scenario.model.ref, scenario.model.num_parameters)
    gpu = load_gpu(scenario.cluster.gpu.preset)
    fp16 = scenario.model.weights_dtype == "fp16" and gpu.fp16_tflops
    peak = (gpu.fp16_tflops if fp16 else gpu.bf16_tflops) * 1e12
    return 2 * (model.active_parameters - model.embedding_parameters) * prompt_tokens / peak
