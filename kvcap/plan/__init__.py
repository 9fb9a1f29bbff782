"""Capacity arithmetic, in four rooms: :mod:`~kvcap.plan.memory` (what one GPU holds: KV bytes, weights,
activations, the engine's memory budget), :mod:`~kvcap.plan.inputs` (a scenario resolved into specs),
:mod:`~kvcap.plan.capacity` (``plan``: per GPU, per tier, rates, Little's law, link budgets) and
:mod:`~kvcap.plan.fit` (the smallest parallelism that fits when the weights do not). The names other packages use
are importable from here."""

from kvcap.plan.capacity import LinkBudget, PlanResult, Tier, plan
from kvcap.plan.fit import FitOption
from kvcap.plan.inputs import PlanInputs, resolve
from kvcap.plan.memory import (
    DTYPE_BYTES,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_element_bytes,
    kv_heads_per_gpu,
    kv_layer_bytes_per_token,
    round_up,
    ssm_state_bytes,
    weights_bytes,
)

__all__ = ["DTYPE_BYTES", "FitOption", "LinkBudget", "PlanInputs", "PlanResult", "Tier", "kv_bytes_per_sequence",
           "kv_bytes_per_token", "kv_element_bytes", "kv_heads_per_gpu", "kv_layer_bytes_per_token", "plan", "resolve",
           "round_up", "ssm_state_bytes", "weights_bytes"]
