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

from .conftest import ROOT

DATA = ROOT / "data"
SEED = ROOT / "scenarios" / "seed-reference.yaml"
VOLATILE = ("wall_s", "realtime_factor", "native")
"""Level-line keys that differ between two runs of the same simulation (wall time) or name the build."""


def _sim(out: Path, pure: bool, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVCAP_PURE"} | ({"KVCAP_PURE": "1"} if pure else {})
    p = subprocess.run([sys.executable, "-m", "kvcap", "sim", *args, "--out", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-2000:]


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
    _sim(tmp_path / "native", False, *args)
    _sim(tmp_path / "pure", True, *args)
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
    """The README's test command builds it (a C compiler and Python's headers are there): the byte-for-byte test
    above compares two builds only when this holds. False here: a source changed since the last
    ``pip install -e .`` (``./scripts/test`` reinstalls), or the build failed (``pip install -v`` says why)."""
    assert kvcap.sim.NATIVE, "kvcap.sim runs from its sources: reinstall (pip install -e .) to compile it"


def test_a_build_that_does_not_match_its_sources_is_not_loaded(tmp_path: Path) -> None:
    """The guard on a copy of the manifest and sources: one changed byte in one source, a missing source, a
    damaged manifest, ``KVCAP_PURE`` — each means the sources; the sources themselves load then (subprocess)."""
    sim_dir = Path(kvcap.sim.__file__).parent
    manifest = json.loads((sim_dir / "_native.json").read_text())
    assert set(manifest["sources"]) >= {"engine", "replica", "policy_vllm", "run"}
    copy = tmp_path / "sim"
    copy.mkdir()
    for name in manifest["sources"]:
        shutil.copy(sim_dir / f"{name}.py", copy / f"{name}.py")
    (copy / "_native.json").write_text(json.dumps(manifest))
    assert native.built_from_these_sources(copy)
    source = copy / "replica.py"
    text = source.read_bytes()
    source.write_bytes(text.replace(b"def load(self)", b"def load(self) ", 1))
    assert hashlib.sha256(source.read_bytes()).hexdigest() != manifest["sources"]["replica"]
    assert not native.built_from_these_sources(copy)
    source.write_bytes(text)
    (copy / "kv.py").unlink()
    assert not native.built_from_these_sources(copy)
    shutil.copy(sim_dir / "kv.py", copy / "kv.py")
    (copy / "_native.json").write_text("{not json")
    assert not native.built_from_these_sources(copy)
    (copy / "_native.json").write_text(json.dumps(manifest | {"group": "kvcap.sim._nowhere"}))
    assert not native.built_from_these_sources(copy)
    (copy / "_native.json").write_text(json.dumps(manifest))
    assert native.built_from_these_sources(copy)
    os.environ["KVCAP_PURE"] = "1"
    try:
        assert not native.built_from_these_sources(copy)
    finally:
        del os.environ["KVCAP_PURE"]
    probe = ("import kvcap.sim, kvcap.sim.replica, kvcap.sim.engine as e; "
             "print(kvcap.sim.NATIVE, kvcap.sim.replica.__file__, e.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env=os.environ | {"KVCAP_PURE": "1"}, check=True).stdout.split()
    assert out[0] == "False" and out[1].endswith("replica.py") and out[2].endswith("engine.py")
