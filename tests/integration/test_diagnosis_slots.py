"""The batch/slot cap over real HTTP: the project's batching server with 4 slots at twice as many users.

Truths from its step model (step = 20 ms + 3 ms × batch): at c=8 exactly 4 run and 4 wait, TPOT grows from
c=1 to c=4 (23 → 32 ms) and stays there to c=8. Its KV usage figure is the share of slots in use, so it reads
100% at the cap: the slot count from the manifest (``serving.max_num_seqs``) is what names the cap.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.servers import start_fake_server

SLOTS = 4


def test_twice_the_slots_is_the_slot_cap_not_compute(tmp_path):
    out = tmp_path / "run"
    with start_fake_server(slots=SLOTS, step_a="20ms", step_b="3ms") as srv:
        p = run_cli("bench", "--url", srv.url, "--out", str(out), "--quiet", "--concurrency", f"1,{SLOTS},{2 * SLOTS}",
                    "--input-tokens", "16", "--output-tokens", "24", "--warmup", "1s", "--duration", "3s",
                    "--metrics-url", srv.url + "/metrics", "--fixed", f"serving.max_num_seqs={SLOTS}", timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    top = next(lv for lv in summary["levels"] if lv["level"] == 2 * SLOTS)
    assert top["server_running_max"] == SLOTS and top["server_waiting_mean"] == pytest.approx(SLOTS, abs=1.0)
    low = next(lv for lv in summary["levels"] if lv["level"] == 1)
    assert top["tpot_ms"]["p50"] / low["tpot_ms"]["p50"] >= 1.3          # what "compute" would have read
    assert [d["bound"] for d in summary["diagnosis"]] == ["batch_cap"]
    assert (f"from c={2 * SLOTS} requests queue" in summary["diagnosis"][0]["evidence"]
            and f"{SLOTS} run at once, the engine's limit ({SLOTS} from serving.max_num_seqs)"
            in summary["diagnosis"][0]["evidence"])
