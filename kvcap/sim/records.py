"""A finished simulated request as a run-directory record (``rundir.RequestRecord``), as ``bench`` writes one.

Why apart from the level run: the record's fields are the contract ``analyze`` reads for both sources, and
``serve-sim`` writes its log with the same function; it runs once per request, so it stays one dict literal.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcap.rundir import RequestRecord, tpot_ms
from kvcap.sim.policy_llamacpp import REQUESTED_OUT
from kvcap.sim.request import SimRequest
from kvcap.sim.rounding import round_to


def _ms(t_s: float | None) -> float | None:
    return None if t_s is None else round_to(t_s * 1e3, 3)


def record_of(req: SimRequest, offset: float, record_itl: bool = True, itl_array: bool = False) -> RequestRecord:
    """A finished simulated request as a ``rundir.RequestRecord`` (times in ms from its arrival). ``itl_array``:
    the ITLs stay one numpy vector (``RunWriter`` serialises it as is) instead of a list of Python floats.

    Built once per request, so as one dict literal (no update) and without ``round`` calls on the zeros most
    requests carry (``round(0.0, 3)`` is ``0.0``: the same record); ``round_to`` is ``round``, faster."""
    tags = req.tags
    arrival = req.arrival
    queue_ms = None if req.t_sched is None else round_to((req.t_sched - arrival) * 1e3, 3)
    if req.error is not None or req.out < req.max_out:
        return {"mode": tags["mode"], "level": tags["level"], "repeat": tags["repeat"], "phase": tags["phase"],
                "worker": 0, "index": req.rid, "start_s": round_to(offset + arrival, 6),
                "end_s": round_to(offset + (req.t_last or arrival), 6), "send_delay_ms": 0.0, "ok": False,
                "error": req.error or "cancelled", "status": 400 if req.error == "http_4xx" else None,
                "input_tokens": req.prompt, "output_tokens": req.out, "requested_output_tokens": req.max_out,
                "tokens_source": "sim", "ttft_ms": _ms(None if req.t_first is None else req.t_first - arrival),
                "tpot_ms": None, "e2e_ms": None, "itl_ms": [], "queue_ms": queue_ms,
                "finish_reason": None, "truncated": False, "early_stop": False, "retries": 0, "group": None}
    last = float(req.chunks[-1][-1])  # the last token's time (no need to join every token's for it)
    asked = tags.get(REQUESTED_OUT, req.max_out)  # more than max_out: a full slot context cut it short
    ttft = (req.t_first - arrival) * 1e3  # type: ignore[operator]
    e2e = (last - arrival) * 1e3
    n = req.out
    tpot = tpot_ms(ttft, e2e, n)
    parked, copy = req.parked_s, req.copy_s
    return {
        "mode": tags["mode"], "level": tags["level"], "repeat": tags["repeat"], "phase": tags["phase"],
        "worker": 0, "index": req.rid, "start_s": round_to(offset + arrival, 6),
        "end_s": round_to(offset + last, 6), "send_delay_ms": 0.0, "ok": True, "error": None, "status": 200,
        "input_tokens": req.prompt, "output_tokens": n, "requested_output_tokens": asked,
        "tokens_source": "sim", "ttft_ms": round_to(ttft, 3), "tpot_ms": None if tpot is None else round_to(tpot, 3),
        "e2e_ms": round_to(e2e, 3),
        "itl_ms": _itls(req.token_times(), itl_array) if record_itl else [],
        "queue_ms": queue_ms,
        "finish_reason": "length", "truncated": n < asked, "early_stop": False, "retries": 0, "group": None,
        "replica": req.replica, "preemptions": req.preemptions, "recomputed_tokens": req.recomputed,
        "parked_ms": round_to(parked * 1e3, 3) if parked else 0.0, "copy_ms": round_to(copy * 1e3, 3) if copy else 0.0,
        "prefix_hit_tokens": req.hit_hbm, "tier_hit_tokens": req.hit_tier,
    }


def _itls(times: np.ndarray, as_array: bool) -> Any:
    """Gaps between consecutive tokens in ms, rounded to the µs as every record's are."""
    itl = ((times[1:] - times[:-1]) * 1e3).round(3)  # np.round(np.diff(times) * 1e3, 3), without the wrappers
    return itl if as_array else itl.tolist()
