"""`kvcap search` end to end on the seed's reference scenario (the real simulator, in local processes): the issue's
grid — KV dtype × offload tier × VRAM — at levels up to 192, and what the table must show: the remote tier raises
resident but not effective capacity, fp8 and 48 GiB raise effective capacity, the recommendation is not the
remote tier; the same points.jsonl from 1 and 2 processes; Ctrl-C keeps finished points; bad input exits 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcap.search import pareto
from kvcap.search.grid import Prices, parse_grid, parse_prices, parse_targets, split_values
from tests.conftest import ROOT, run_cli

SCENARIO = ROOT / "scenarios" / "seed-reference.yaml"
GRID = ["--grid", "model.kv_dtype=fp16,fp8", "--grid", "serving.kv_offload=none,remote",
        "--grid", "cluster.gpu.memory=24GiB,48GiB"]
LOAD = ["--concurrency", "48,64,96,128,192", "--duration", "20s", "--warmup", "5s", "--repeats", "1"]
PRICES = ["--price", "serving.kv_offload=remote=2", "--price", "cluster.gpu.memory=48GiB=3"]
"""A remote pool costs 2, a 48 GiB card 3 (added to the 4 GPUs): the cheapest way to effective >= 96 is fp8."""
MUST_SHOW = [str(SCENARIO), *GRID, *LOAD, *PRICES, "--target", "effective>=96", "--summary-only", "--quiet"]


def search(out: Path, *extra: str) -> tuple[dict, list[dict]]:
    p = run_cli("search", *MUST_SHOW, "--out", str(out), *extra, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads((out / "search.json").read_text()), [json.loads(x) for x in
                                                          (out / "points.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_jobs(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    out = tmp_path_factory.mktemp("search") / "jobs2"
    return (out, *search(out, "--jobs", "2"))


def by_point(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["point"]["model.kv_dtype"], r["point"]["serving.kv_offload"], r["point"]["cluster.gpu.memory"]): r
            for r in rows}


def test_the_table_shows_remote_buys_residency_and_fp8_or_vram_buy_capacity(two_jobs):
    _, result, rows = two_jobs
    assert len(rows) == 8 and [r["index"] for r in rows] == list(range(8))  # grid order
    p = by_point(rows)
    for kv in ("fp16", "fp8"):
        for mem in ("24GiB", "48GiB"):
            none, remote = p[kv, "none", mem], p[kv, "remote", mem]
            assert remote["effective"] == none["effective"]  # the pool holds requests, it does not serve them
            assert remote["goodput_tok_s"] == none["goodput_tok_s"]
            assert remote["resident"] >= none["resident"]
            assert remote["resident"] == 192 or remote["resident"] > none["resident"]
    for kv, mem in (("fp16", "24GiB"), ("fp8", "24GiB")):  # where VRAM binds, remote admits far more
        assert p[kv, "remote", mem]["resident"] > p[kv, "none", mem]["resident"] + 50
    for off in ("none", "remote"):
        for mem in ("24GiB", "48GiB"):
            assert p["fp8", off, mem]["effective"] > p["fp16", off, mem]["effective"]
        for kv in ("fp16", "fp8"):
            assert p[kv, off, "48GiB"]["effective"] > p[kv, off, "24GiB"]["effective"]
    # the scenario's own arithmetic: ~12 fp16 requests of 1024+192 tokens per 24 GB card, 48 in the cluster
    assert p["fp16", "none", "24GiB"]["effective"] == 48
    # the recommendation: cheapest point with effective >= 96 (costs 4 + 2 for remote + 3 for 48 GiB)
    assert [r["point"] for r in result["recommended"]] == [
        {"model.kv_dtype": "fp8", "serving.kv_offload": "none", "cluster.gpu.memory": "24GiB"}]
    assert {r["index"]: r["cost"] for r in rows} == {i: 4 + 2 * (i // 2 % 2) + 3 * (i % 2) for i in range(8)}
    assert [r["meets_target"] for r in rows] == [r["effective"] >= 96 for r in rows]
    front = [(r["point"]["model.kv_dtype"], r["point"]["serving.kv_offload"], r["point"]["cluster.gpu.memory"])
             for r in result["pareto"]]
    assert front == [("fp8", "none", "24GiB"), ("fp8", "none", "48GiB")]
    assert result["ranked"][0] == result["recommended"][0]["index"]


def test_a_point_is_exactly_the_kvcap_sim_run_of_its_overrides(two_jobs, tmp_path):
    out, _, rows = two_jobs
    row = by_point(rows)["fp8", "remote", "24GiB"]
    p = run_cli("sim", str(SCENARIO), *LOAD, "--set", "model.kv_dtype=fp8", "--set", "serving.kv_offload=remote",
                "--set", "cluster.gpu.memory=24GiB", "--out", str(tmp_path / "sim"), "--json")
    assert p.returncode == 0, p.stderr
    summary = json.loads(p.stdout)
    cap = summary["capacity"]
    assert {k: row[k] for k in ("effective", "resident", "stress_limit", "limited_by")} == {
        k: cap[k] for k in ("effective", "resident", "stress_limit", "limited_by")}
    assert row["goodput_tok_s"] == max(lv["goodput_tok_s"] for lv in summary["levels"])
    kept = json.loads((out / row["run_dir"] / "summary.json").read_text())
    assert kept["capacity"]["effective"] == cap["effective"]
    assert sorted(p.name for p in (out / row["run_dir"]).iterdir()) == ["summary.json"]  # --summary-only


def test_by_gpu_count_alone_the_recommendation_is_still_not_the_remote_tier(two_jobs):
    """Without prices every point costs its 4 GPUs: the cheapest points meeting the target tie, and the ones that
    change the fewest keys win — fp8 or 48 GiB alone; the remote tier only adds a change that buys nothing."""
    _, result, rows = two_jobs
    flat = [{**r, "cost": Prices().cost(r["point"], r["gpus"])} for r in rows]
    assert {r["cost"] for r in flat} == {4}
    rec = pareto.recommend(flat, result["baseline"])
    assert {(r["point"]["model.kv_dtype"], r["point"]["cluster.gpu.memory"]) for r in rec} == {
        ("fp16", "48GiB"), ("fp8", "24GiB")}
    assert all(r["point"]["serving.kv_offload"] == "none" for r in rec)


def test_one_process_and_two_write_the_same_points_jsonl(two_jobs, tmp_path):
    out2, result2, _ = two_jobs
    search(tmp_path / "jobs1", "--jobs", "1")
    assert (tmp_path / "jobs1" / "points.jsonl").read_bytes() == (out2 / "points.jsonl").read_bytes()
    result1 = json.loads((tmp_path / "jobs1" / "search.json").read_text())
    for key in ("recommended", "pareto", "ranked", "effects"):
        assert result1[key] == result2[key]


def test_search_page_and_report_of_a_search_dir(two_jobs, tmp_path):
    out, result, _ = two_jobs
    page = (out / "search.html").read_text()
    assert "Pareto front" in page and page.count("<svg") == 1 + len(result["grid"])
    assert "Effect of serving.kv_offload" in page and "(others at baseline: kv_dtype=fp16, memory=24GiB)" in page
    p = run_cli("report", str(out), "--out", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "r.html").read_text() == page
    eff = result["effects"]["model.kv_dtype"]
    assert [(e["value"], e["effective"]) for e in eff] == [("fp16", 48), ("fp8", 96)]


def test_ctrl_c_keeps_the_finished_points_and_resume_runs_only_the_rest(tmp_path):
    out = tmp_path / "s"
    args = ["search", str(SCENARIO), "--grid", "cluster.nodes=1,2,3,4,5,6,7,8", "--concurrency", "16,32",
            "--duration", "400s", "--warmup", "2s", "--repeats", "1", "--no-itl", "--jobs", "2", "--quiet",
            "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "kvcap", *args],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    points, deadline = out / "points.jsonl", time.monotonic() + 60
    while time.monotonic() < deadline and not (points.exists() and points.read_text().strip()):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130, proc.stderr.read()
    rows = [json.loads(x) for x in (out / "points.jsonl").read_text().splitlines()]
    result = json.loads((out / "search.json").read_text())
    assert result["interrupted"] is True and result["points"] == 8
    assert 1 <= len(rows) == result["finished"] < 8
    assert [r["index"] for r in rows] == sorted(r["index"] for r in rows)
    assert sorted(p.name for p in (out / "points").iterdir()) == sorted(Path(r["run_dir"]).name for r in rows)
    for r in rows:  # whole run directories (not --summary-only), as kvcap sim writes them
        names = {p.name for p in (out / r["run_dir"]).iterdir()}
        assert {"manifest.json", "requests.jsonl", "levels.jsonl", "summary.json"} <= names
        assert r["gpus"] == r["cost"] == r["point"]["cluster.nodes"]
    kept = {r["run_dir"]: (out / r["run_dir"] / "summary.json").stat().st_mtime_ns for r in rows}

    other = run_cli(*[a if a != "cluster.nodes=1,2,3,4,5,6,7,8" else "cluster.nodes=1,2" for a in args], "--resume")
    assert other.returncode == 2 and "different search" in other.stderr, other.stderr
    again = run_cli(*args, "--resume", timeout=300)
    assert again.returncode == 0, again.stderr
    result = json.loads((out / "search.json").read_text())
    assert result["interrupted"] is False and result["finished"] == result["points"] == 8
    final = [json.loads(x) for x in (out / "points.jsonl").read_text().splitlines()]
    assert [r["index"] for r in final] == list(range(8))
    # the finished points are kept, not run again; meets_target is judged anew over every finished point (with no
    # --target it means "the best effective capacity found", which the points run after the resume can raise)
    assert ([{k: v for k, v in r.items() if k != "meets_target"} for r in final if r["run_dir"] in kept]
            == [{k: v for k, v in r.items() if k != "meets_target"} for r in rows])
    assert all((out / d / "summary.json").stat().st_mtime_ns == t for d, t in kept.items())
    timed = [json.loads(x)["index"] for x in (out / "timings.jsonl").read_text().splitlines()]
    assert sorted(timed) == list(range(8))  # every point ran exactly once over both runs


@pytest.mark.parametrize("args, message", [
    (["--grid", "model.kv_dtyp=fp16,fp8"], "kv_dtyp"),
    (["--grid", "model.kv_dtype=fp16,int3"], "kv_dtype"),
    ([], "at least one --grid"),
    (["--grid", "model.kv_dtype="], "empty value"),
    (["--grid", "model.kv_dtype=fp16,fp8", "--target", "effective>96"], "--target"),
    (["--grid", "model.kv_dtype=fp16,fp8", "--target", "latency>=3"], "--target"),
    (["--grid", "model.kv_dtype=fp16,fp8", "--price", "model.kv_dtype=fp4=2"], "not one of its grid values"),
    (["--grid", "model.kv_dtype=fp16,fp8", "--price", "serving.kv_offload=remote=2"], "not a --grid key"),
    (["--grid", "model.kv_dtype=fp16,fp8", "--price", "model.kv_dtype=fp8=cheap"], "--price expects"),
    (["--grid", "model.kv_dtype=fp16,fp8", "--set", "model.kv_dtype=fp8"], "both as --grid and as --set"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    p = run_cli("search", str(SCENARIO), *args, "--out", str(tmp_path / "s"))
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "s" / "points.jsonl").exists()


def test_grid_values_are_read_as_set_reads_them():
    assert split_values("a, [1,2] ,'x,y'") == ["a", "[1,2]", "'x,y'"]
    assert parse_grid(["load.concurrency=[8,16],[32]", "cluster.nodes=1,2"]) == {
        "load.concurrency": [[8, 16], [32]], "cluster.nodes": [1, 2]}
    assert [t.text for t in parse_targets(["effective>=96,goodput>=1.5e3"])] == ["effective>=96", "goodput>=1500"]
    prices = parse_prices(["gpu=2.5", "cluster.nodes=2=1"], {"cluster.nodes": [1, 2]})
    assert prices.cost({"cluster.nodes": 2}, 2) == 6.0 and prices.cost({"cluster.nodes": 1}, 1) == 2.5


def test_pareto_and_recommendation_rules():
    def row(i, eff, cost, **point):
        return {"index": i, "effective": eff, "goodput_tok_s": 0.0, "cost": cost, "point": point,
                "meets_target": eff is not None and eff >= 50}
    rows = [row(0, 40, 1, a=0, b=0), row(1, 60, 2, a=1, b=0), row(2, 60, 2, a=1, b=1), row(3, None, 0.5, a=0, b=1),
            row(4, 80, 3, a=0, b=1)]
    assert [r["index"] for r in pareto.pareto(rows)] == [3, 0, 1, 2, 4]
    assert [r["index"] for r in pareto.recommend(rows, {"a": 0, "b": 0})] == [1]
    assert pareto.meets(row(9, 80, 1), [], rows) and not pareto.meets(row(9, 60, 1), [], rows)
