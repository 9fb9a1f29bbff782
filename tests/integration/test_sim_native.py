"""The compiled simulator (issue 14: ``setup.py`` builds ``kvcap/sim`` with mypyc) is the same simulator as its
sources: the same records, telemetry and level lines, byte for byte, on every engine path — closed and open loop,
a real trace with prefix caching, parking and preemption in a remote tier, host offload, llama.cpp's slots with a
measured step cost — and a build that does not match the sources is never loaded.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvcap.sim
from kvcap.sim import native
from tests.conftest import ROOT

DATA = ROOT / "data"
SEED = ROOT / "scenarios" / "seed-reference.yaml"
VOLATILE = ("wall_s", "realtime_factor", "native")
"""Level-line keys that differ between two runs of the same simulation (wall time) or name the build."""


def _sim(out: Path, pure: bool, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KVCAP_PURE"} | ({"KVCAP_PURE": "1"} if pure else {})
    p = subprocess.run([sys.executable, "-m", "kvcap", "sim", *args, "--out", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stderr


def _levels(out: Path) -> list[dict]:
    lines = [json.loads(line) for line in (out / "levels.jsonl").read_text().splitlines()]
    for lv in lines:
        for key in VOLATILE:
            lv["sim"].pop(key)
    return lines


def _trace(tmp_path: Path) -> Path:
    """The first 300 requests of Mooncake's conversation trace (prefix hash ids), as it is published."""
    path = tmp_path / "mooncake-300.jsonl"
    with gzip.open(DATA / "traces" / "mooncake_conversation_trace.jsonl.gz", "rt") as f:
        path.write_text("".join(line for _, line in zip(range(300), f)))
    return path


def _llamacpp(tmp_path: Path) -> Path:
    path = tmp_path / "llamacpp.yaml"
    path.write_text(yaml.safe_dump({"serving": {
        "engine": "llamacpp", "max_num_seqs": 8, "kv_tokens": 8 * 1024, "kv_unified": False,
        "step_cost": {"base": "10ms", "per_decode": "2ms", "per_prefill_token": "0.02ms"}},
        "workload": {"input_tokens": "uniform:32,400", "output_tokens": "uniform:8,64"}}))
    return path


CASES = {
    "closed loop, remote tier: parks and preempts": lambda tmp: (
        str(SEED), "--set", "serving.kv_offload=remote", "--concurrency", "48,96", "--requests", "300",
        "--warmup", "0s", "--repeats", "1"),
    "open loop, host tier, cancelled past the drain": lambda tmp: (
        str(SEED), "--set", "serving.kv_offload=host", "--rate", "3,40", "--duration", "20s", "--warmup", "2s",
        "--repeats", "1"),
    "Mooncake trace, prefix caching, kv-aware routing": lambda tmp: (
        str(SEED), "--trace", str(_trace(tmp)), "--set", "serving.kv_offload=remote", "--set",
        "serving.routing=kv_aware", "--set", "model.preset=llama-3.1-8b", "--set", "model.weights_dtype=bf16",
        "--set", "cluster.gpu.preset=a100-80gb", "--set", "cluster.remote_memory=4TiB", "--warmup", "0s"),
    "llama.cpp slots, measured step cost": lambda tmp: (
        str(_llamacpp(tmp)), "--concurrency", "4,12", "--requests", "200", "--warmup", "0s", "--repeats", "1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_compiled_simulator_writes_what_its_sources_write(tmp_path: Path, case: str) -> None:
    args = CASES[case](tmp_path)
    said = _sim(tmp_path / "native", False, *args), _sim(tmp_path / "pure", True, *args)
    assert "Python sources" not in said[0] and "ran from its Python sources, about half as fast: KVCAP_PURE" in said[1]
    for name in ("requests.jsonl", "telemetry.jsonl"):
        native_bytes, pure_bytes = (tmp_path / "native" / name).read_bytes(), (tmp_path / "pure" / name).read_bytes()
        assert native_bytes.count(b"\n") > 100
        assert native_bytes == pure_bytes, name
    assert _levels(tmp_path / "native") == _levels(tmp_path / "pure")
    built = [json.loads(line)["sim"]["native"] for line in (tmp_path / "native" / "levels.jsonl").read_text().split()]
    assert set(built) == {kvcap.sim.NATIVE}
    assert {json.loads(line)["sim"]["native"] for line in (tmp_path / "pure" / "levels.jsonl").read_text().split()} \
        == {False}


def test_the_test_environment_runs_the_compiled_simulator() -> None:
    """The README's test command builds it (and installs a C compiler and Python's headers where missing): the
    byte-for-byte test above compares two builds only when this holds. False here: a source changed since the last
    ``pip install -e .`` (``./scripts/test`` reinstalls), or the build failed (``pip install -v`` says why)."""
    if native.pure_asked():
        pytest.skip("KVCAP_PURE asks for the sources")
    assert kvcap.sim.NATIVE, "kvcap.sim runs from its sources: reinstall (pip install -e .) to compile it"


def _copy(tmp_path: Path) -> Path:
    """Every ``kvcap`` source and this ABI's manifest, as an installed tree would hold them; its ``kvcap/sim``."""
    src = Path(kvcap.sim.__file__).resolve().parents[1]
    assert (src / "sim" / native.MANIFEST).exists(), "no compiled build: reinstall (pip install -e .) to compile it"
    dst = tmp_path / "kvcap"
    for path in src.rglob("*.py"):
        (dst / path.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dst / path.relative_to(src))
    shutil.copy(src / "sim" / native.MANIFEST, dst / "sim" / native.MANIFEST)
    return dst / "sim"


def test_a_build_that_does_not_match_its_sources_is_not_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard on a copy of the tree: one changed byte in a compiled source or in a module whose types it was
    compiled against, a missing source, a compiled module the manifest does not list, a damaged manifest, a
    library that does not load, ``KVCAP_PURE`` — each means the sources; they load then (subprocess)."""
    monkeypatch.delenv("KVCAP_PURE", raising=False)
    here = _copy(tmp_path)
    manifest = json.loads((here / native.MANIFEST).read_text())
    assert {"kvcap/sim/engine.py", "kvcap/sim/replica.py", "kvcap/plan/memory.py"} <= set(manifest["sources"])
    assert set(manifest["modules"]) >= {"engine", "replica", "policy_vllm", "run", "rounding"}
    assert native.built_from_these_sources(here)
    for rel in ("sim/replica.py", "plan/memory.py"):
        source = here.parent / rel
        text = source.read_bytes()
        source.write_bytes(text + b" ")
        assert hashlib.sha256(source.read_bytes()).hexdigest() != manifest["sources"][f"kvcap/{rel}"]
        assert not native.built_from_these_sources(here), rel
        source.write_bytes(text)
        assert native.built_from_these_sources(here)
    (here / "kv.py").rename(here / "kv.off")
    assert not native.built_from_these_sources(here)
    (here / "kv.off").rename(here / "kv.py")
    stray = here / f"dropped{native.SUFFIX}"  # a module an earlier build compiled and this one does not
    stray.write_bytes(b"")
    assert not native.built_from_these_sources(here)
    stray.unlink()
    (here / native.MANIFEST).write_text("{not json")
    assert not native.built_from_these_sources(here)
    (here / native.MANIFEST).write_text(json.dumps(manifest | {"group": "kvcap.sim._nowhere"}))
    assert not native.built_from_these_sources(here)
    (here / native.MANIFEST).write_text(json.dumps(manifest))
    assert native.built_from_these_sources(here)
    monkeypatch.setenv("KVCAP_PURE", "0")
    assert native.built_from_these_sources(here)
    monkeypatch.setenv("KVCAP_PURE", "1")
    assert not native.built_from_these_sources(here)
    probe = ("import kvcap.sim, kvcap.sim.replica, kvcap.sim.engine as e; "
             "print(kvcap.sim.NATIVE, kvcap.sim.replica.__file__, e.__file__)")
    elsewhere = tmp_path / "elsewhere"  # not beside the copy: the installed kvcap is imported
    elsewhere.mkdir()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=elsewhere,
                         env=os.environ | {"KVCAP_PURE": "1"}, check=True).stdout.split()
    assert out[0] == "False" and out[1].endswith("replica.py") and out[2].endswith("engine.py")


@pytest.mark.parametrize("pure", [False, True])
def test_a_command_that_simulated_says_when_the_sources_ran(tmp_path: Path, pure: bool) -> None:
    """``kvcap demo`` (and ``ab``, ``search``, ``sim``): a note on stderr when the sources ran, none otherwise; the
    verdict the same either way (the compiled build is only faster)."""
    env = {k: v for k, v in os.environ.items() if k != "KVCAP_PURE"} | ({"KVCAP_PURE": "1"} if pure else {})
    p = subprocess.run([sys.executable, "-m", "kvcap", "demo", "--out", str(tmp_path / "demo"), "--json",
                        "--set", "load.concurrency=[8,64]", "--set", "load.repeats=1", "--set", "load.duration=20s"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    said = "kvcap demo: note: the simulator ran from its Python sources, about half as fast: KVCAP_PURE is set"
    assert said in p.stderr if pure else "Python sources" not in p.stderr
    both = json.loads(p.stdout)
    assert both["reference"]["verdict"] and both["prefix_reuse"]["verdict"]
