"""Arrival processes as absolute offsets from a level's start (no drift: time i is fixed before the run)."""

from __future__ import annotations

import numpy as np

from kvcap.errors import InputError


def parse_arrival(text: str) -> tuple[str, float]:
    """``poisson`` | ``constant`` | ``gamma:cv=2`` → (kind, coefficient of variation)."""
    s = text.strip().lower()
    if s in ("poisson", "exponential"):
        return "poisson", 1.0
    if s in ("constant", "uniform", "fixed"):
        return "constant", 0.0
    if s.startswith("gamma"):
        _, _, arg = s.partition(":")
        key, _, val = arg.partition("=")
        try:
            cv = float(val)
        except ValueError:
            cv = -1.0
        if key.strip() != "cv" or cv <= 0:
            raise InputError(f"arrival {text!r}: write gamma:cv=X with X > 0")
        return "gamma", cv
    raise InputError(f"unknown arrival process {text!r}: use poisson, constant or gamma:cv=X")


def arrival_offsets(kind: str, cv: float, rate: float, duration_s: float, seed: int,
                    max_n: int | None = None) -> np.ndarray:
    """Arrival times in [0, duration_s) for mean ``rate`` req/s; at most ``max_n`` of them."""
    if rate <= 0:
        raise InputError(f"rate must be positive, got {rate:g}")
    rng = np.random.default_rng(seed)
    n = max_n if max_n is not None else int(rate * duration_s * 1.2 + 20)
    if kind == "constant":
        return (np.arange(n) / rate) if max_n is not None else np.arange(0.0, duration_s, 1.0 / rate)
    chunks: list[np.ndarray] = []
    total, last = 0, 0.0
    while True:
        if kind == "poisson":
            gaps = rng.exponential(1.0 / rate, size=n)
        else:
            shape = 1.0 / (cv * cv)
            gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
        t = last + np.cumsum(gaps)
        chunks.append(t)
        total += n
        last = float(t[-1])
        if (max_n is not None and total >= max_n) or (max_n is None and last >= duration_s):
            break
    out = np.concatenate(chunks)
    return out[:max_n] if max_n is not None else out[out < duration_s]
