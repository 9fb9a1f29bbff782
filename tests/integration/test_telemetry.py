"""Telemetry: the catalogs (from sample exposition text written from each engine's documented names), counter
rates across resets, source de-duplication, and a real Prometheus + node exporter stack scraping the project's
test server and a DCGM fixture exporter, queried by ``kvcap bench --prometheus`` and checked against the truth."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from kvcap.analysis.telemetry import dedupe_sources, series
from kvcap.analysis.telemetry_nodes import imbalance, node_figures
from kvcap.telemetry.catalog import counter_rates, detect_engine, entry, normalise
from kvcap.telemetry.prometheus import node_of, rows_from_matrix, selector
from kvcap.telemetry.scrape import RateTracker, parse_metrics, parse_target
from tests import prometheus_stack as stack
from tests.conftest import run_cli
from tests.servers import start_fake_server

SAMPLES = {
    "vllm": ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 7.0\n'
             '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 3.0\n'
             '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.82\n'
             '# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{model_name="m"} 5.0\n'
             '# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{model_name="m"} 1024.0\n'
             '# TYPE vllm:external_prefix_cache_hits counter\n'
             'vllm:external_prefix_cache_hits_total{model_name="m"} 512.0\n',
             {"server.requests_running": 7, "server.requests_waiting": 3, "server.kv_usage": 0.82,
              "server.preemptions_total": 5, "server.prefix_cache_hits_total": 1024,
              "server.offload_prefix_hits_total": 512}),
    "sglang": ('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 12\n'
               '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 4\n'
               '# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="m"} 0.5\n'
               '# TYPE sglang:hicache_host_used_tokens gauge\nsglang:hicache_host_used_tokens{model_name="m"} 9000\n'
               '# TYPE sglang:hicache_host_total_tokens gauge\n'
               'sglang:hicache_host_total_tokens{model_name="m"} 90000\n',
               {"server.requests_running": 12, "server.requests_waiting": 4, "server.kv_usage": 0.5,
                "server.kv_host_used_tokens": 9000, "server.kv_host_total_tokens": 90000}),
    "tgi": ("# TYPE tgi_queue_size gauge\ntgi_queue_size 2\n# TYPE tgi_batch_current_size gauge\n"
            "tgi_batch_current_size 6\n# TYPE tgi_batch_current_max_tokens gauge\ntgi_batch_current_max_tokens 4096\n",
            {"server.requests_waiting": 2, "server.requests_running": 6, "server.batch_max_tokens": 4096}),
    "llamacpp": ("# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
                 "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 1\n"
                 "# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 300\n"
                 "# TYPE llamacpp:n_decode_total counter\nllamacpp:n_decode_total 150\n",
                 {"server.requests_running": 2, "server.requests_waiting": 1, "server.generation_tokens_total": 300,
                  "server.decode_calls_total": 150}),
    "lmcache": ("# TYPE lmcache:num_hit_tokens counter\nlmcache:num_hit_tokens_total 2048\n"
                "# TYPE lmcache:retrieve_hit_rate gauge\nlmcache:retrieve_hit_rate 0.25\n"
                "# TYPE lmcache:local_cache_usage gauge\nlmcache:local_cache_usage 1.5e9\n"
                "# TYPE lmcache:remote_cache_usage gauge\nlmcache:remote_cache_usage 3e9\n",
                {"server.offload_hit_tokens_total": 2048, "server.offload_hit_rate": 0.25,
                 "server.kv_usage_host": 1.5e9, "server.kv_usage_remote": 3e9}),
    "dynamo_kvbm": ("# TYPE kvbm_offload_blocks_d2h counter\nkvbm_offload_blocks_d2h 40\n"
                    "# TYPE kvbm_onboard_blocks_h2d counter\nkvbm_onboard_blocks_h2d 30\n"
                    "# TYPE kvbm_matched_tokens counter\nkvbm_matched_tokens 4096\n",
                    {"server.offload_blocks_d2h_total": 40, "server.onboard_blocks_h2d_total": 30,
                     "server.offload_matched_tokens_total": 4096}),
    "dcgm": (stack.dcgm_page(0.0), {"gpu.util": 0.91, "gpu.mem_used_bytes": 20_000 * 2**20,
                                    "gpu.pcie_tx_bytes_s": 2.5e9}),
    "node_exporter": ('# TYPE node_network_speed_bytes gauge\nnode_network_speed_bytes{device="eth0"} 1.25e+10\n'
                      "# TYPE node_memory_MemAvailable_bytes gauge\nnode_memory_MemAvailable_bytes 6.4e10\n",
                      {"net.speed_bytes_s": 1.25e10, "host.mem_available_bytes": 6.4e10}),
}


@pytest.mark.parametrize("engine", sorted(SAMPLES))
def test_catalog_normalises_each_engines_names(engine):
    text, truth = SAMPLES[engine]
    rows = parse_metrics(text, 1.0, "metrics:test", node="n1")
    got = {r["name"]: r["value"] for r in rows if r["labels"].get("Hostname") in (None, "node-a")}
    for name, value in truth.items():
        assert got[name] == pytest.approx(value), name
    assert all(r["labels"]["raw"] and r["labels"]["node"] == "n1" for r in rows)
    if engine != "dcgm":  # the DCGM fixture page also carries a node-exporter counter
        assert detect_engine(r["labels"]["raw"] for r in rows) == engine
        assert all(r["labels"]["engine"] == engine for r in rows)


def test_catalog_units_and_unknown_names():
    assert entry("DCGM_FI_DEV_FB_USED").scale == 2**20 and entry("DCGM_FI_DEV_FB_USED").unit == "bytes"
    assert (entry("node_network_receive_bytes_total").rate
            and entry("node_network_receive_bytes_total").unit == "bytes/s")
    assert normalise("vllm:num_preemptions") == normalise("vllm:num_preemptions_total") == "server.preemptions_total"
    assert normalise("my_engine_queue") is None
    assert detect_engine(["foo", "bar"]) is None
    assert "DCGM_FI_DEV_GPU_UTIL" in selector() and "vllm:num_requests_running" in selector()


def test_counter_rates_survive_resets():
    pts = [(0.0, 100.0), (1.0, 200.0), (2.0, 300.0), (3.0, 50.0), (4.0, 150.0)]
    assert counter_rates(pts) == [(1.0, 100.0), (2.0, 100.0), (3.0, 50.0), (4.0, 100.0)]
    tracker = RateTracker()
    rows = []
    for t, v in pts:
        rows += tracker.apply([{"t_s": t, "source": "s", "name": "net.rx_bytes_s",
                                "labels": {"raw": "node_network_receive_bytes_total", "device": "eth0"}, "value": v}])
    assert [r["value"] for r in rows] == [100.0, 100.0, 50.0, 100.0]


def test_parse_target_labels_and_errors():
    assert parse_target("gpu-node-1=http://10.0.0.1:8000/metrics") == ("gpu-node-1", "http://10.0.0.1:8000/metrics")
    assert parse_target("http://10.0.0.1:8000/metrics") == ("10.0.0.1:8000", "http://10.0.0.1:8000/metrics")
    from kvcap.errors import InputError

    with pytest.raises(InputError):
        parse_target("node=ftp://x")


def test_sources_are_not_counted_twice_and_nodes_compare():
    rows = []
    for t in range(5):
        for src in ("metrics:http://a", "prometheus:http://p"):
            rows.append({"t_s": float(t), "source": src, "name": "server.requests_running",
                         "labels": {"node": "a"}, "value": 4.0})
        rows.append({"t_s": float(t), "source": "prometheus:http://p", "name": "gpu.util",
                     "labels": {"node": "a"}, "value": 0.9})
        rows.append({"t_s": float(t), "source": "prometheus:http://p", "name": "gpu.util",
                     "labels": {"node": "b"}, "value": 0.2})
    kept = dedupe_sources(rows)
    assert [v for _, v in series(kept, "server.requests_running")] == [4.0] * 5  # not 8
    per_node = node_figures(kept, 0, 10)
    assert per_node["a"]["gpu_util_mean"] == 0.9 and per_node["b"]["gpu_util_mean"] == 0.2
    assert imbalance(per_node) == {"metric": "gpu_util_mean", "hot": "a", "hot_value": 0.9, "cold": "b",
                                   "cold_value": 0.2}


def test_prometheus_matrix_rows_align_and_rate():
    result = [{"metric": {"__name__": "node_network_receive_bytes_total", "instance": "10.0.0.5:9100",
                          "job": "node", "device": "eth0"},
               "values": [[1000.0, "0"], [1001.0, "1000"], [1002.0, "3000"]]},
              {"metric": {"__name__": "DCGM_FI_DEV_GPU_UTIL", "instance": "10.0.0.5:9400", "job": "dcgm",
                          "Hostname": "gpu-a", "gpu": "0"}, "values": [[1001.0, "55"]]}]
    rows = rows_from_matrix(result, epoch_at_origin=990.0, source="prometheus:x")
    net = [r for r in rows if r["name"] == "net.rx_bytes_s"]
    assert [(r["t_s"], r["value"]) for r in net] == [(11.0, 1000.0), (12.0, 2000.0)]
    assert net[0]["labels"]["node"] == "10.0.0.5" and net[0]["labels"]["engine"] == "node_exporter"
    gpu = [r for r in rows if r["name"] == "gpu.util"]
    assert gpu[0]["value"] == 0.55 and gpu[0]["labels"]["node"] == "gpu-a"
    assert node_of({"instance": "[::1]:9100"}) == "[::1]:9100"


# ------------------------------------------------------------------------------------------ real Prometheus


@pytest.mark.prometheus
def test_bench_with_prometheus_dcgm_node_exporter(tmp_path):
    stack.require()
    slots, clients = 4, 8
    traffic_rate = 40e6
    with start_fake_server(slots=slots, step_a="20ms", step_b="1ms") as srv, stack.dcgm_fixture() as dcgm, \
            stack.node_exporter() as node, \
            stack.prometheus({"engine": [srv.url], "dcgm": [dcgm.url], "node": [node.url]}) as prom, \
            stack.LoopbackTraffic(traffic_rate) as traffic:
        out = tmp_path / "run"
        p = run_cli("bench", "--url", srv.url, "--concurrency", str(clients), "--input-tokens", "64",
                    "--output-tokens", "32", "--warmup", "2s", "--duration", "10s", "--prometheus", prom.url,
                    "--out", str(out), "--quiet", "--json", timeout=180)
        assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    rows = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines()]
    assert {r["source"].split(":", 1)[0] for r in rows} == {"prometheus"}
    assert summary["prometheus"]["rows"] == len(rows) > 100
    lv = summary["levels"][0]
    # the engine's own series, from Prometheus: running = slots, the rest wait; resident from telemetry
    assert lv["server_running_max"] == slots
    assert lv["server_waiting_mean"] == pytest.approx(clients - slots, abs=0.6)
    assert summary["capacity"]["resident"] == slots and summary["capacity"]["resident_source"] == "telemetry"
    # DCGM per node, exact, and the imbalance it shows
    nodes = lv["nodes"]
    assert nodes["node-a"]["gpu_util_mean"] == 0.91 and nodes["node-b"]["gpu_util_mean"] == 0.37
    assert nodes["node-a"]["gpu_mem_used_max_bytes"] == 20_000 * 2**20
    assert lv["imbalance"]["hot"] == "node-a"
    assert any(d["bound"] == "imbalance" for d in summary["diagnosis"])
    # node exporter: loopback bytes/s within 2% of what was sent, over the measured window
    manifest = json.loads((out / "manifest.json").read_text())
    w0, w1 = (json.loads((out / "levels.jsonl").read_text().splitlines()[0])[k]
              for k in ("measure_start_s", "measure_end_s"))
    lo = [r["value"] for r in rows if r["name"] == "net.rx_bytes_s" and r["labels"].get("device") == "lo"
          and w0 + 1 <= r["t_s"] <= w1 - 1]
    assert len(lo) >= 6
    assert float(np.mean(lo)) == pytest.approx(traffic.achieved, rel=0.02)
    # the fixture's counter resets every 4 s: rates never go negative and stay at its true rate
    fake = [r["value"] for r in rows if r["labels"].get("device") == "fake0"]
    assert fake and min(fake) >= 0
    assert float(np.median(fake)) == pytest.approx(stack.FAKE_NIC_RATE, rel=0.02)
    assert manifest["clock"]["epoch_at_origin"] > 1.6e9


@pytest.mark.prometheus
def test_bench_metrics_urls_label_nodes_and_rate_counters(tmp_path):
    stack.require()
    with start_fake_server(slots=2, step_a="10ms") as srv, stack.node_exporter() as node, \
            stack.LoopbackTraffic(20e6) as traffic:
        out = tmp_path / "run"
        p = run_cli("bench", "--url", srv.url, "--concurrency", "4", "--input-tokens", "32", "--output-tokens", "16",
                    "--warmup", "1s", "--duration", "8s", "--metrics-url", f"gpu-box={srv.url}/metrics",
                    "--metrics-url", f"gpu-box={node.url}/metrics", "--out", str(out), "--quiet", "--json",
                    timeout=120)
        assert p.returncode == 0, p.stderr
        time.sleep(0.1)
    summary = json.loads(p.stdout)
    rows = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines()]
    assert {r["labels"]["node"] for r in rows} == {"gpu-box"}
    assert {r["labels"]["engine"] for r in rows} == {"vllm", "node_exporter"}
    lo = [r["value"] for r in rows if r["name"] == "net.rx_bytes_s" and r["labels"].get("device") == "lo"]
    assert float(np.median(lo)) == pytest.approx(traffic.achieved, rel=0.05)
    lv = summary["levels"][0]
    assert lv["nodes"]["gpu-box"]["running_max"] == 2
    assert lv["server_running_max"] == 2


def test_bench_bad_prometheus_and_metrics_url(tmp_path):
    p = run_cli("bench", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--prometheus", "localhost:9090",
                "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and "--prometheus" in p.stderr
    p = run_cli("bench", "--url", "http://127.0.0.1:9", "--concurrency", "1", "--metrics-url", "n=ftp://x",
                "--out", str(tmp_path / "y"))
    assert p.returncode == 2 and "--metrics-url" in p.stderr


@pytest.mark.prometheus
@pytest.mark.llamacpp
def test_prometheus_scrapes_a_real_llamacpp_server(tmp_path):
    stack.require()
    from tests.llamacpp import llama_server
    from tests.tiny_gguf import write_tiny_llama_gguf

    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    slots, clients = 2, 4
    with llama_server(gguf, parallel=slots, ctx_size=slots * 1024) as url, \
            stack.prometheus({"llamacpp": [url]}) as prom:
        out = tmp_path / "run"
        p = run_cli("bench", "--url", url, "--concurrency", str(clients), "--input-tokens", "32",
                    "--output-tokens", "400", "--warmup", "2s", "--duration", "8s", "--prometheus", prom.url,
                    "--extra-body", '{"cache_prompt": false}', "--out", str(out), "--quiet", "--json", timeout=240)
        assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout)
    rows = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines()]
    assert {r["labels"]["engine"] for r in rows} == {"llamacpp"}
    lv = summary["levels"][0]
    assert lv["server_running_max"] == slots  # llamacpp:requests_processing, via Prometheus
    assert 1.0 <= lv["server_waiting_mean"] <= clients - slots + 0.5  # llamacpp:requests_deferred
    generated = sorted((r["t_s"], r["value"]) for r in rows if r["name"] == "server.generation_tokens_total")
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert generated[-1][1] - generated[0][1] == sum(r["output_tokens"] for r in records if r["ok"])


def test_local_telemetry_reads_this_hosts_network(tmp_path):
    from kvcap.telemetry.local import read_net_dev

    sample = ("Inter-|   Receive |  Transmit\n face |bytes packets errs drop fifo frame compressed multicast|bytes\n"
              "    lo: 1000 10 0 0 0 0 0 0 2000 20 0 0 0 0 0 0\n  eth0: 5 1 0 0 0 0 0 0 7 1 0 0 0 0 0 0\n")
    assert read_net_dev(sample) == {"lo": (1000, 2000), "eth0": (5, 7)}
    with start_fake_server(ttft="5ms", itl="5ms") as srv, stack.LoopbackTraffic(30e6) as traffic:
        out = tmp_path / "run"
        p = run_cli("bench", "--url", srv.url, "--concurrency", "2", "--input-tokens", "16", "--output-tokens", "8",
                    "--warmup", "1s", "--duration", "6s", "--local-telemetry", "--out", str(out), "--quiet",
                    timeout=120)
        assert p.returncode == 0, p.stderr
    rows = [json.loads(line) for line in (out / "telemetry.jsonl").read_text().splitlines()]
    lo = [r["value"] for r in rows if r["name"] == "net.rx_bytes_s" and r["labels"]["device"] == "lo"]
    assert len(lo) >= 5 and all(r["labels"]["engine"] == "procfs" for r in rows if r["name"].startswith("net."))
    assert float(np.median(lo)) == pytest.approx(traffic.achieved, rel=0.05)


def test_nic_utilisation_from_node_exporter_speed():
    from kvcap.analysis.telemetry_nodes import nic_utilisation

    rows = [{"name": "net.speed_bytes_s", "labels": {"device": "eth0"}, "value": 12.5e9},
            {"name": "net.rx_bytes_s", "labels": {"device": "eth0"}, "value": 10e9},
            {"name": "net.tx_bytes_s", "labels": {"device": "eth0"}, "value": 2e9},
            {"name": "net.rx_bytes_s", "labels": {"device": "lo"}, "value": 99e9}]
    assert nic_utilisation(rows) == 0.8  # the NIC with a known speed, not loopback


def test_damaged_telemetry_rows_are_skipped_not_fatal(tmp_path):
    """A row that is JSON but not an object, labels that are not a mapping, a value that is not a number, a torn
    last line: each is skipped, and the good rows still make the series."""
    from kvcap.rundir import RunDir

    good = [{"t_s": float(t), "source": "metrics:x", "name": "server.requests_running", "labels": {"node": "a"},
             "value": 3} for t in range(3)]
    lines = [json.dumps(good[0]), "[1, 2]", json.dumps({"t_s": 1.5, "source": "metrics:x",
                                                       "name": "server.requests_running", "labels": None,
                                                       "value": "abc"}),
             json.dumps(good[1]), json.dumps({"t_s": "x", "name": 5}), json.dumps(good[2])]
    (tmp_path / "telemetry.jsonl").write_text("\n".join(lines) + '\n{"t_s": 9.0, "sou')
    (tmp_path / "requests.jsonl").write_text("")
    tel = dedupe_sources(RunDir(tmp_path).iter_telemetry())
    assert series(tel, "server.requests_running") == [(0.0, 3.0), (1.0, 3.0), (2.0, 3.0)]
    assert series(tel, "server.requests_running", node="a") == [(0.0, 3.0), (1.0, 3.0), (2.0, 3.0)]
