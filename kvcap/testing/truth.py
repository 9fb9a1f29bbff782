"""Closed-form truths of the batching engine for a closed loop of clients, to check measurements against.

Why: a load generator is trusted only once what it measures matches what is known; these are the known values
for :class:`kvcap.testing.engines.BatchingEngine` (its module docstring gives the step rules they follow).
In short: with ``c >= 2N`` closed-loop clients every step has batch ``N`` and every inter-token gap is exactly
``A + B*N``; with ``2 <= c <= N`` each client's next request arrives just *after* the boundary that freed its
slot, so it sits out one step per request (the closed-loop bubble) and a cycle of ``L`` output tokens takes
exactly ``(L+1)*A + B*c*L``.
"""

from __future__ import annotations

from typing import Any


def batching_truth(concurrency: int, slots: int, a: float, b: float, output_tokens: int) -> dict[str, Any]:
    """Steady-state truths of the batching mode for a closed loop of ``concurrency`` clients.

    Assumes: each client keeps exactly one streaming request outstanding and sends the next one as soon as the
    previous ends (no think time), all requests ask for ``output_tokens = L`` tokens with EOS ignored, no
    prefill cost (``--prefill-per-token 0``), no faults, and a network delay small against one step (but > 0,
    so a new request lands just after the step boundary that ended its predecessor). Times in seconds; TTFT is
    from the server's arrival, i.e. excludes the network and client overhead.

    Regimes (``c`` = concurrency, ``N`` = slots, ``S`` = step time):

    * ``c == 1``: the engine is idle when each request lands, so it starts at once: ``S = a + b``, TTFT = S,
      TPOT = S, throughput = 1/S. Exact.
    * ``2 <= c <= N``: each request sits out the step it arrived in (its slot was freed at the boundary just
      before), so every client cycles through ``L + 1`` steps of which it runs ``L``. Exact, whatever the
      clients' phases: e2e = ``(L+1)*a + b*c*L``, throughput = ``c*L / e2e``. A full-batch gap is ``a + b*c``;
      because other clients' sit-out steps can fall inside a request's decode window, a request's TPOT lies in
      ``[a + b*c - b*(c-1)/(L-1), a + b*c]`` (returned as ``tpot_s_min``/``tpot_s``) and the mean TTFT (about
      two steps: the rest of the arrival step, then the first step) in ``[2a + b*c, 2a + 2*b*c - b]``
      (``ttft_s_steady`` is the lower end, ``ttft_s_max`` the upper).
    * ``c > N``: the queue never empties, so batches stay at ``N``: every gap is ``S = a + b*N`` (TPOT exact),
      throughput = ``N / S``, and by Little's law the mean e2e is ``c*L*S/N`` and mean TTFT
      ``S * (L*(c/N - 1) + 1)``, i.e. one step plus a queue wait of ``(c/N - 1)`` service times (``L*S``).
      Exact for ``c >= 2N``; for ``N < c < 2N`` exact only once no more than ``c - N`` requests finish at any one
      boundary (requests admitted together finish together, so a synchronized start can leave short batches
      for a while) — ``exact`` is False there.
    """
    c, n, length = int(concurrency), int(slots), int(output_tokens)
    if c < 1 or n < 1 or length < 1:
        raise ValueError("concurrency, slots and output_tokens must be >= 1")
    if c == 1:
        s = a + b
        return {"regime": "idle_start", "exact": True, "batch": 1.0, "step_s": s, "tpot_s": s, "tpot_s_min": s,
                "ttft_s_steady": s, "ttft_s_max": s, "e2e_s": length * s, "queue_s": 0.0,
                "throughput_tok_s": 1.0 / s}
    if c <= n:
        e2e = (length + 1) * a + b * c * length
        tpot = a + b * c
        tpot_min = tpot - (b * (c - 1) / (length - 1) if length > 1 else 0.0)
        return {"regime": "bubble", "exact": True, "batch": c * length / (length + 1), "step_s": tpot,
                "tpot_s": tpot, "tpot_s_min": tpot_min, "ttft_s_steady": 2 * a + b * c,
                "ttft_s_max": 2 * a + 2 * b * c - b, "e2e_s": e2e, "queue_s": None,
                "throughput_tok_s": c * length / e2e}
    s = a + b * n
    e2e = c * length * s / n
    ttft = s * (length * (c / n - 1) + 1)
    return {"regime": "queued", "exact": c >= 2 * n, "batch": float(n), "step_s": s, "tpot_s": s,
            "tpot_s_min": s, "ttft_s_steady": ttft, "ttft_s_max": ttft, "e2e_s": e2e, "queue_s": ttft - s,
            "throughput_tok_s": n / s}
