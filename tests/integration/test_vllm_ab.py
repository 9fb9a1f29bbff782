"""The article's first answer on a real engine: more KV room (vLLM's ``--num-gpu-blocks-override``) lets more
requests decode at once. ``kvcap ab`` starts and stops each arm's real vLLM (CPU build) itself; the control's
pool holds two requests, so it is diagnosed as bound by KV capacity at block granularity, and the treatment's
larger pool is a performance gain."""

from __future__ import annotations

import json

import pytest
import yaml

from kvcap.procs import free_port
from kvcap.rundir import RunDir
from tests.conftest import run_cli
from tests.vllm_cpu import MODEL_NAME, VllmConfig, shell_command

pytestmark = pytest.mark.vllm

# 512 tokens in + 64 out = 5 blocks of 128 a request: 11 usable blocks hold 2, 47 hold the batch cap of 8
ARMS = {"control": 12, "treatment": 48}


def test_more_kv_room_on_real_vllm_is_a_performance_gain(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    arms = []
    for name, blocks in ARMS.items():
        port = free_port()
        sock = tmp_path.parent / f"s{port}"  # a short path for vLLM's sockets
        sock.mkdir(exist_ok=True)
        cfg = VllmConfig(blocks=blocks, max_num_seqs=8, max_model_len=1024)
        arms.append({"name": name, "url": f"http://127.0.0.1:{port}", "command": shell_command(home, cfg, port, sock),
                     "start_timeout": 300, "vary": {"serving.kv_blocks": blocks}})
    exp = {"name": "kv-room", "model": MODEL_NAME, "fixed": {"model.name": MODEL_NAME}, "arms": arms,
           "load": {"concurrency": [2, 4, 8], "warmup": "1s", "duration": "8s", "repeats": 1},
           "workload": {"input_tokens": 512, "output_tokens": 64}, "slo": {"ttft_p95": "2s", "tpot_p95": "200ms"}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    p = run_cli("ab", str(path), "--out", str(tmp_path / "ab"), "--json", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout)
    # the server's own word on what ran at once: 2 in the small pool, up to the cap of 8 in the large one
    running = {arm: max(t["value"] for t in RunDir(tmp_path / "ab" / arm).telemetry()
                        if t["name"] == "server.requests_running") for arm in ARMS}
    assert running == {"control": 2, "treatment": 8}
    assert result["verdict"] == "performance-scaling"
    assert not any("tier" in w for w in result.get("warnings", [])), result["warnings"]  # no tier in either arm
    # the control's pool, read from vLLM's cache_config_info, has no room for a third request
    compare = json.loads((tmp_path / "ab" / "compare.json").read_text())
    assert "kv_capacity" in [f["bound"] for f in compare["diagnosis"] if f["arm"] == "control"], compare["diagnosis"]
