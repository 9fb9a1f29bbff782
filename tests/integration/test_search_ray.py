"""`kvcap search --ray` on a real 2-node Ray cluster on 127.0.0.1 (started and stopped by the test): the issue's grid
runs as Ray tasks spread over both nodes and writes the same points.jsonl, byte for byte, as local processes."""

from __future__ import annotations

import json

from tests.conftest import run_cli
from tests.integration.test_search import SCENARIO, search
from tests.ray_cluster import free_ports, needs_ray, ray_cluster


@needs_ray
def test_ray_on_two_nodes_writes_the_same_points_as_local_processes(tmp_path):
    local_out, ray_out = tmp_path / "local", tmp_path / "ray"
    local, _ = search(local_out, "--jobs", "2")
    with ray_cluster(tmp_path / "cluster", nodes=2, num_cpus=2) as cluster:
        on_ray, _ = search(ray_out, "--ray", cluster.address)
        nodes = cluster.node_ids()
    assert (ray_out / "points.jsonl").read_bytes() == (local_out / "points.jsonl").read_bytes()
    for key in ("recommended", "pareto", "ranked", "effects"):
        assert on_ray[key] == local[key]
    assert on_ray["executor"] == f"ray {cluster.address}" and on_ray["finished"] == 8
    ran_on = {json.loads(x)["node"] for x in (ray_out / "timings.jsonl").read_text().splitlines()}
    assert ran_on == set(nodes) and len(nodes) == 2  # spread over both nodes
    for row in json.loads("[" + ",".join((ray_out / "points.jsonl").read_text().splitlines()) + "]"):
        assert (ray_out / row["run_dir"] / "summary.json").is_file()  # shipped back from the node that ran it


@needs_ray
def test_a_ray_head_that_does_not_answer_fails_in_one_line_before_anything_is_written(tmp_path):
    port = free_ports(1)[0]
    p = run_cli("search", str(SCENARIO), "--grid", "model.kv_dtype=fp16,fp8", "--ray", f"127.0.0.1:{port}",
                "--out", str(tmp_path / "s"), timeout=60)
    assert p.returncode == 1 and p.stderr.strip().splitlines() == [
        f"kvcap search: error: cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused"]
    assert not (tmp_path / "s").exists()
