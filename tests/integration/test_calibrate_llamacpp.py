"""`kvcap calibrate` on a REAL llama.cpp server (issue 12): fit on ``--parallel 4`` at c = 1, 2, 4, then predict
``--parallel 8`` (twice the context) at c = 4, 8 and compare with what `kvcap bench` measures on that server.

The model is the tests' random-weights GGUF, made a little larger (4 layers, width 256) so that a decode step
takes milliseconds: with the 2-layer default a step is ~0.2 ms and the client's own per-token work (SSE parsing
on a shared 2-core machine, send delays up to 10 ms measured) is as large as the server's, which no server model
should absorb.

Why unified KV and outputs of varied length: both keep the measurement to what the step costs, not to where
the closed loop's phase happened to fall.
- With split KV (an explicit ``--parallel``) llama.cpp runs a forward pass per run of consecutive busy slot ids
  and takes the least recently used slot. Which slots four users of eight hold then depends on the order they
  finished in: 1.80 and 2.59 ms TPOT on two fresh servers, one bench after the other. The simulator follows
  both rules (``policy_llamacpp``, tested against known truths in ``test_sim_profiles``), but no profile can
  say which order a real run will fall into. ``--kv-unified`` runs one pass a step wherever the users sit.
- Users asking for equal outputs finish together and send again together. Whether the server then takes their
  prompts in one step (lockstep: TPOT is a pure decode step) or a few at a time (each prompt lands in the
  others' steps: TPOT +25%) depends on the client's send delays against the server's wake-up. Runs fell one
  way on one machine (2.2 ms at c = 8) and the other way on the CI machine (2.7 ms). Outputs of 16–48 tokens put
  every run out of lockstep, in the simulator as on the server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tests.llamacpp import llama_server
from tests.starvation import OtherCpu, judge_unless_starved, starved
from tests.tiny_gguf import write_tiny_llama_gguf

pytestmark = pytest.mark.llamacpp

SHAPE = {"n_layers": 4, "hidden": 256, "n_heads": 4, "n_kv_heads": 2, "ff": 768}
CTX_PER_SLOT = 512
LENGTHS = ("--input-tokens", "48", "--output-tokens", "uniform:16,48")
UNIFIED = ("--kv-unified",)
NO_CACHE = ("--extra-body", '{"cache_prompt": false}')
TOLERANCE = 0.15


def bench(url: str, out: Path, levels: str, load: str = "--concurrency") -> dict:
    p = run_cli("bench", "--url", url, "--out", str(out), "--quiet", "--json", "--metrics-url", url + "/metrics",
                *NO_CACHE, *LENGTHS, load, levels, "--warmup", "1s", "--duration", "4s", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return {lv["level"]: lv for lv in json.loads(p.stdout)["levels"]}


def mean_of(a: dict, b: dict) -> dict:
    """Two benches of one server, level by level: the mean throughput and TPOT p50."""
    return {c: {"output_tok_s": (a[c]["output_tok_s"] + b[c]["output_tok_s"]) / 2,
                "tpot_ms": {"p50": (a[c]["tpot_ms"]["p50"] + b[c]["tpot_ms"]["p50"]) / 2}} for c in a}


BRACKETS = 3
STEADY = 0.10
"""A bracket whose two benches of one server differ by more than this (TPOT p50, any level) drifted."""
SHARED_CORES = 0.3
"""Other processes using more than this many cores on average during a bracket: the servers did not have the
host's cores, and a server with twice the slots needs them differently than the profile did (a core taken
elsewhere moved the 8-slot prediction by +17% where the bracket itself read steady)."""


def drift_of(a: dict, b: dict, levels: tuple[int, ...]) -> float:
    return max(abs(b[c]["tpot_ms"]["p50"] / a[c]["tpot_ms"]["p50"] - 1) for c in levels)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The profile (--parallel 4) taken twice, around two benches of the server to predict (--parallel 8), each on
    a fresh server: both are centred on the same moment, the fit takes both profiles and the measurement is the
    mean of both benches. This shared machine drifts (two benches of one configuration have differed by 13%, and
    by up to 60% with split KV). A bracket whose two profiles or two benches differ by more than 10% at any level
    is no measurement and is taken again, at most three times; then the prediction check says so and stands
    aside: no tolerance of 15% can be judged against a server measured ±20%. The same holds for a bracket during
    which other processes kept more than :data:`SHARED_CORES` of the host busy."""
    root = tmp_path_factory.mktemp("cal-llamacpp")
    gguf = write_tiny_llama_gguf(root / "tiny.gguf", **SHAPE)
    for attempt in range(BRACKETS):
        here = root / f"bracket{attempt}"
        others = OtherCpu()
        with llama_server(gguf, parallel=4, ctx_size=4 * CTX_PER_SLOT, extra_args=UNIFIED) as url:
            first = bench(url, here / "p4-first", "1,2,4")
        with llama_server(gguf, parallel=8, ctx_size=8 * CTX_PER_SLOT, extra_args=UNIFIED) as url:
            before = bench(url, here / "p8-before", "4,8")
        with llama_server(gguf, parallel=8, ctx_size=8 * CTX_PER_SLOT, extra_args=UNIFIED) as url:
            after = bench(url, here / "p8-after", "4,8")
        with llama_server(gguf, parallel=4, ctx_size=4 * CTX_PER_SLOT, extra_args=UNIFIED) as url:
            second = bench(url, here / "p4-second", "1,2,4")
        drift = max(drift_of(first, second, (1, 2, 4)), drift_of(before, after, (4, 8)))
        shared = others.cores()
        print(f"bracket {attempt}: TPOT p50 of the two profiles "
              + ", ".join(f"c={c} {first[c]['tpot_ms']['p50']:.3f} / {second[c]['tpot_ms']['p50']:.3f}" for c in first)
              + "; of the two 8-slot benches "
              + ", ".join(f"c={c} {before[c]['tpot_ms']['p50']:.3f} / {after[c]['tpot_ms']['p50']:.3f}" for c in before)
              + f" ms (drift {drift:.0%}; other processes {shared:.2f} cores)")
        if drift <= STEADY and shared <= SHARED_CORES:
            break
    measured = mean_of(before, after)
    steady = drift <= STEADY and shared <= SHARED_CORES
    root = here
    scenario = root / "calibrated.yaml"
    p = run_cli("calibrate", str(root / "p4-first"), str(root / "p4-second"), "--kv-unified", "--out",
                str(scenario), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    return {"root": root, "scenario": scenario, "fit": json.loads(p.stdout), "measured": measured,
            "steady": steady, "drift": drift, "shared": shared}


def test_calibrate_takes_slots_and_kv_pool_from_the_servers_props(runs):
    fit = runs["fit"]
    assert fit["engine"] == "llamacpp"
    assert fit["slots"] == 4 and fit["slots_source"] == "server /props total_slots"
    # /props n_ctx per slot × total_slots: with unified KV a slot may fill the whole --ctx-size
    assert fit["kv_tokens"] == 4 * (4 * CTX_PER_SLOT)
    assert yaml.safe_load(runs["scenario"].read_text())["serving"]["kv_unified"] is True
    assert all(v["value_s"] >= 0 for v in fit["step_cost"].values())
    # c = 1, 2, 4 on 4 slots never queued: what a queue costs was not measured, and the scenario says so
    assert any("no fitted level queued requests for the 4 slots" in x for x in fit["limits"])


def test_calibrated_llamacpp_predicts_twice_the_slots_within_15pct(runs):
    if not runs["steady"]:
        pytest.xfail(f"the machine drifted {runs['drift']:.0%} or other processes took {runs['shared']:.2f} cores "
                     f"within each of {BRACKETS} brackets (two profiles around two benches of the 8-slot server): "
                     "no steady measurement to judge 15% against")
    sim = run_cli("sim", str(runs["scenario"]), "--set", "serving.max_num_seqs=8",
                  "--set", f"serving.kv_tokens={8 * (8 * CTX_PER_SLOT)}", "--concurrency", "4,8", *LENGTHS,
                  "--out", str(runs["root"] / "sim8"), "--quiet", "--json")
    assert sim.returncode == 0, sim.stderr[-2000:]
    predicted = {lv["level"]: lv for lv in json.loads(sim.stdout)["levels"]}
    for c in (4, 8):
        p, m = predicted[c], runs["measured"][c]
        print(f"c={c}: throughput {p['output_tok_s']:.1f} predicted / {m['output_tok_s']:.1f} measured "
              f"({p['output_tok_s'] / m['output_tok_s'] - 1:+.1%}), TPOT p50 {p['tpot_ms']['p50']:.3f} / "
              f"{m['tpot_ms']['p50']:.3f} ms ({p['tpot_ms']['p50'] / m['tpot_ms']['p50'] - 1:+.1%})")
        assert p["output_tok_s"] == pytest.approx(m["output_tok_s"], rel=TOLERANCE), c
        assert p["tpot_ms"]["p50"] == pytest.approx(m["tpot_ms"]["p50"], rel=TOLERANCE), c


QUEUE_TOLERANCE = 0.20
"""How close the c = 128 prediction from a c = 64 profile must come. The cost of a queue on this shared 2-core
machine is not a smooth line: one ladder on one server read its pure step +6.6, +7.9, +9.0, +22.5, +32.8, +33.4%
over c = 8 at 8, 23, 39, 55, 88 and 120 waiting, and c = 64 alone read +15…+29% over six runs, which a
prediction at twice the queue carries twice over (+2.7…+15.3% on throughput at c = 128 over ten runs)."""


def test_a_queue_at_the_door_slows_the_steps_and_calibrate_measures_it(tmp_path):
    """llama.cpp's server wakes every connection waiting on its results for each result it sends
    (``server_response::send`` → ``notify_all``), so requests queued for a slot slow the steps of those being
    served: on this machine, 8 slots, the pure decode step goes from ~2.0 ms alone to ~2.8–3.0 ms with 120
    waiting, and c = 128 delivers 20–25% less than c = 8. Fit on c = 1, 2, 4, 8 and c = 64 (56 waiting: a level
    well past the slots, where the cost stands above the run-to-run noise) of one server; predict c = 128, held
    out: throughput and TPOT p50 within :data:`QUEUE_TOLERANCE`, and closer than the same scenario without
    ``per_waiting`` (which says +27…+41%).

    128 streams on one client process: a host that starves it (one core busy is enough) delivers less than the
    server could, which no server model predicts. Such a run is taken again, and if every one was starved, the
    test says so (:mod:`tests.starvation`) rather than judge a truth that was never measured."""
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf", **SHAPE)

    def measure(attempt: int) -> tuple[tuple[Path, dict], str | None]:
        here = tmp_path / f"attempt{attempt}"
        with llama_server(gguf, parallel=8, ctx_size=8 * CTX_PER_SLOT, extra_args=UNIFIED) as url:
            bench(url, here / "profile", "1,2,4,8,64")
            measured = bench(url, here / "closed", "8,128")
        why = [f"{name}: {reason}" for name in ("profile", "closed")
               if (reason := starved(json.loads((here / name / "summary.json").read_text())))]
        return (here, measured), "; ".join(why) or None

    judge_unless_starved(measure, lambda data: _queue_prediction_holds(*data), attempts=2)


def _queue_prediction_holds(tmp_path: Path, measured: dict) -> None:
    """Calibrate on the profile, then predict c = 128 with and without ``per_waiting`` against what was measured."""
    scenario = tmp_path / "calibrated.yaml"
    p = run_cli("calibrate", str(tmp_path / "profile"), "--kv-unified", "--out", str(scenario), "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    fit = json.loads(p.stdout)
    per_waiting = fit["step_cost"]["per_waiting"]["value_s"]
    assert not any("no fitted level queued" in x for x in fit["limits"])
    slowdown = 1 - measured[128]["output_tok_s"] / measured[8]["output_tok_s"]
    print(f"per_waiting {per_waiting * 1e6:.2f} µs; measured: c=128 delivers {slowdown:.0%} less than c=8")
    if slowdown > TOLERANCE:  # the queue costs something here: the fit must have seen it
        assert per_waiting > 0

    def predict(*sets: str) -> dict:
        out = tmp_path / f"sim{len(sets)}"
        sim = run_cli("sim", str(scenario), *sets, "--concurrency", "128", *LENGTHS, "--warmup", "1s", "--duration",
                      "4s", "--out", str(out), "--quiet", "--json")
        assert sim.returncode == 0, sim.stderr[-2000:]
        return json.loads(sim.stdout)["levels"][0]

    m, p_, without = measured[128], predict(), predict("--set", "serving.step_cost.per_waiting=0")
    for name, got in (("with per_waiting", p_), ("without", without)):
        print(f"c=128 {name}: throughput {got['output_tok_s']:.1f} predicted / {m['output_tok_s']:.1f} measured "
              f"({got['output_tok_s'] / m['output_tok_s'] - 1:+.1%}), TPOT p50 {got['tpot_ms']['p50']:.3f} / "
              f"{m['tpot_ms']['p50']:.3f} ms ({got['tpot_ms']['p50'] / m['tpot_ms']['p50'] - 1:+.1%})")
    assert p_["output_tok_s"] == pytest.approx(m["output_tok_s"], rel=QUEUE_TOLERANCE)
    assert p_["tpot_ms"]["p50"] == pytest.approx(m["tpot_ms"]["p50"], rel=QUEUE_TOLERANCE)
    if slowdown > TOLERANCE:
        assert abs(p_["output_tok_s"] / m["output_tok_s"] - 1) < abs(without["output_tok_s"] / m["output_tok_s"] - 1)
