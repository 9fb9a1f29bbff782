"""`compare --allow-diff KEY` accepts two runs that differ only in KEY (issue 11 item 4) — for every fixed variable a
`kvcap bench` flag can change — and refuses them (exit 3) without it. Keys derived from KEY (the prompt set, the
measured input lengths, the load keys of another load model) follow it. Pairs of REAL tiny bench runs against the
project's test server, run in-process through the CLI's own entry point."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcap.cli import main
from kvcap.rundir import RunDir
from tests.conftest import run_cli
from tests.servers import start_fake_server
from tests.unit.test_workload import tokenizer_json  # noqa: F401  (a fixture: a small BPE tokenizer.json)

BASE = {"--concurrency": "2", "--input-tokens": "16", "--output-tokens": "2", "--warmup": "0s", "--requests": "4",
        "--prefix-tokens": "3", "--prefix-groups": "2"}
RATE = {**{k: v for k, v in BASE.items() if k != "--concurrency"}, "--rate": "100"}
DURATION = {**{k: v for k, v in BASE.items() if k != "--requests"}, "--duration": "0.3s"}
TRACE = {"--trace": "@trace1", "--warmup": "0s"}
SESSIONS = {**BASE, "--turns": "2"}

# key → (the run it is compared with, what changes); @name: what the fixture provides (files, the other server),
# None: a bare flag, "": the flag dropped
PAIRS: dict[str, tuple[dict[str, str | None], dict[str, str | None]]] = {
    "target.api": (BASE, {"--api": "chat"}),
    "model.name": (BASE, {"--url": "@other_server"}),
    "workload.input_tokens": (BASE, {"--input-tokens": "20"}),
    "workload.output_tokens": (BASE, {"--output-tokens": "3"}),
    "workload.dataset": (BASE, {"--dataset": "@dataset"}),
    "workload.prefix_tokens": (BASE, {"--prefix-tokens": "4"}),
    "workload.prefix_groups": (BASE, {"--prefix-groups": "3"}),
    "workload.prompts_per_group": (BASE, {"--prompts-per-group": "2"}),
    "workload.turns": (SESSIONS, {"--turns": "3"}),
    "workload.think_time": (SESSIONS, {"--think-time": "10ms"}),
    "workload.unique_prefix": (BASE, {"--no-unique-prefix": None}),
    "workload.tokenizer": (BASE, {"--tokenizer": "@tokenizer"}),
    "decoding.temperature": (BASE, {"--temperature": "0.7"}),
    "decoding.force_length": (BASE, {"--no-force-length": None}),
    "decoding.extra_body": (BASE, {"--extra-body": '{"top_k": 5}'}),
    "timeouts.request": (BASE, {"--timeout": "60s"}),
    "timeouts.stall": (BASE, {"--stall-timeout": "30s"}),
    "client.workers": (BASE, {"--workers": "2"}),
    "load.mode": (BASE, {"--concurrency": "", "--rate": "100"}),
    "load.concurrency": (BASE, {"--concurrency": "3"}),
    "load.rate": (RATE, {"--rate": "120"}),
    "load.arrival": (RATE, {"--arrival": "constant"}),
    "load.requests": (BASE, {"--requests": "5"}),
    "load.duration": (DURATION, {"--duration": "0.4s"}),
    "load.warmup": (BASE, {"--warmup": "0.1s"}),
    "load.repeats": (BASE, {"--repeats": "2"}),
    "load.seed": (BASE, {"--seed": "7"}),
    "load.trace_rows": (TRACE, {"--trace": "@trace2"}),
    "load.trace_speed": (TRACE, {"--trace-speed": "2"}),
    "cluster.gpus": (BASE, {"--fixed": "cluster.gpus=8"}),  # any key declared with --fixed
}
NO_FLAG = {"target.url", "server.engine", "server.version", "client.host"}
"""Fixed keys no bench flag sets (the URL is not a fixed variable: two arms are two servers)."""
DERIVED_ONLY = {"workload.prompt_set", "workload.input_tokens_measured", "load.trace_requests", "load.trace",
                "workload.dataset_sha256", "workload.prompt"}
"""Fixed keys that only follow others: the prompt set and measured lengths move with input_tokens, dataset, prefix
and seed; the trace's row count with its rows; its one level (``load.trace``) is its speed; the dataset's digest
with its file."""


class Runs:
    """Each distinct bench run once (runs are shared by the pairs that need them), into its own directory."""

    def __init__(self, root: Path, url: str, files: dict[str, str]) -> None:
        self.root, self.url, self.files, self.done = root, url, files, {}

    def get(self, flags: dict[str, str | None]) -> str:
        flags = {"--url": self.url, **flags}
        args: list[str] = []
        for flag, value in flags.items():
            if value == "":
                continue
            args += [flag] if value is None else [flag, self.files[value[1:]] if value.startswith("@") else value]
        key = " ".join(args)
        if key not in self.done:
            out = self.root / f"run{len(self.done)}"
            argv = ["bench", *args, "--out", str(out), "--quiet", "--json"]
            if "--workers" in flags:  # worker processes: from a fresh interpreter, as a user runs it
                p = run_cli(*argv, timeout=120)
                assert p.returncode == 0, p.stderr[-2000:]
            else:
                assert main(argv) == 0
            self.done[key] = str(out)
        return self.done[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_json) -> Iterator[Runs]:  # noqa: F811
    root = tmp_path_factory.mktemp("allow-diff")
    (root / "data.jsonl").write_text("".join(json.dumps({"prompt": f"row {i} the of and to in is was"}) + "\n"
                                             for i in range(4)))
    for name, lengths in (("trace1", (12, 14, 16, 18)), ("trace2", (13, 15, 17, 19))):
        (root / f"{name}.jsonl").write_text("".join(
            json.dumps({"arrival_s": 0.05 * k, "input_tokens": n, "output_tokens": 2}) + "\n"
            for k, n in enumerate(lengths)))
    with start_fake_server(ttft="1ms", itl="1ms") as srv, \
            start_fake_server(ttft="1ms", itl="1ms", model_name="other-model") as other:
        files = {"other_server": other.url, "dataset": str(root / "data.jsonl"), "tokenizer": tokenizer_json,
                 "trace1": str(root / "trace1.jsonl"), "trace2": str(root / "trace2.jsonl")}
        yield Runs(root, srv.url, files)


def compare(a: str, b: str, *allow: str) -> int:
    return main(["compare", a, b, "--json", *(["--allow-diff", ",".join(allow)] if allow else [])])


@pytest.mark.parametrize("key", sorted(PAIRS))
def test_allow_diff_accepts_exactly_the_key(runs, key, capsys):
    base, change = PAIRS[key]
    a, b = runs.get(base), runs.get({**base, **change})
    fa, fb = RunDir(a).manifest.fixed, RunDir(b).manifest.fixed
    assert fa.get(key) != fb.get(key), (key, fa.get(key))  # the flag does change that key
    assert compare(a, b) == 3
    assert key in capsys.readouterr().err
    assert compare(a, b, key) == 0
    result = json.loads(capsys.readouterr().out)["fixed_variables"]
    assert result["equal"] is True and key in {d["key"] for d in result["allowed_differences"]}


def test_every_fixed_key_a_flag_changes_is_covered(runs):
    dirs = {d for base, change in PAIRS.values() for d in (runs.get(base), runs.get({**base, **change}))}
    seen = set().union(*(RunDir(d).manifest.fixed for d in dirs))
    assert seen - NO_FLAG - DERIVED_ONLY - set(PAIRS) == set()


def test_the_key_under_test_needs_no_allow(runs):
    a = runs.get({**BASE, "--vary": "serving.kv_offload=none"})
    b = runs.get({**BASE, "--vary": "serving.kv_offload=host"})
    assert compare(a, b) == 0


def test_a_derived_key_follows_only_a_source_that_differs():
    from kvcap.analysis.verdict import same_caliber
    from kvcap.rundir import Manifest

    a = Manifest(source="bench", run_id="a", started_at=0.0,
                 fixed={"workload.input_tokens": "16", "workload.prompt_set": "p1"})
    b = Manifest(source="bench", run_id="b", started_at=0.0,
                 fixed={"workload.input_tokens": "16", "workload.prompt_set": "p2"})
    # the asked length is allowed but equal: the prompt sets differ for another reason, which is not allowed
    assert [d.to_json() for d in same_caliber(a, b, {"workload.input_tokens"}).differences] == [
        {"key": "workload.prompt_set", "control": "p1", "treatment": "p2"}]
    b.fixed["workload.input_tokens"] = "20"
    assert same_caliber(a, b, {"workload.input_tokens"}).equal is True


def test_measured_lengths_are_equal_within_5_percent():
    from kvcap.analysis.verdict import MEASURED_INPUT, same_caliber

    def diffs(x: float | None, y: float | None) -> list[dict]:
        return [d.to_json() for d in same_caliber(None, None, set(), measured={MEASURED_INPUT: (x, y)}).differences]

    assert diffs(100.0, 104.9) == [] and diffs(100.0, None) == []
    assert diffs(100.0, 105.3) == [{"key": MEASURED_INPUT, "control": 100.0, "treatment": 105.3, "tolerance": 0.05}]


def test_a_dataset_is_compared_by_its_content_not_its_path(runs, capsys):
    """The same file at two paths: same caliber. Another file at the same path: a difference, by its digest."""
    import hashlib
    import shutil

    original = Path(runs.files["dataset"])
    copy = original.with_name("copy-of-data.jsonl")
    shutil.copyfile(original, copy)
    a = runs.get({**BASE, "--dataset": "@dataset"})
    b = runs.get({**BASE, "--dataset": str(copy)})
    fa, fb = RunDir(a).manifest.fixed, RunDir(b).manifest.fixed
    assert fa["workload.dataset"] != fb["workload.dataset"]
    assert fa["workload.dataset_sha256"] == fb["workload.dataset_sha256"] == hashlib.sha256(
        original.read_bytes()).hexdigest()
    assert compare(a, b) == 0
    capsys.readouterr()

    edited = original.with_name("edited-data.jsonl")
    shutil.copyfile(original, edited)
    c = runs.get({**BASE, "--dataset": str(edited)})
    edited.write_text(edited.read_text().replace("row 3", "row 33"))
    d = runs.root / "edited-again"
    assert main(["bench", "--url", runs.url, *(x for kv in BASE.items() for x in kv), "--dataset", str(edited),
                 "--out", str(d), "--quiet", "--json"]) == 0
    fc, fd = RunDir(c).manifest.fixed, RunDir(str(d)).manifest.fixed
    assert fc["workload.dataset"] == fd["workload.dataset"] == str(edited)
    assert fd["workload.dataset_sha256"] == hashlib.sha256(edited.read_bytes()).hexdigest()
    assert compare(c, str(d)) == 3
    assert "workload.dataset_sha256" in capsys.readouterr().err
    assert compare(c, str(d), "workload.dataset") == 0  # allowing the dataset allows its content to differ
    allowed = json.loads(capsys.readouterr().out)["fixed_variables"]["allowed_differences"]
    assert "workload.dataset_sha256" in {x["key"] for x in allowed}


def test_a_run_without_the_digest_is_compared_by_its_path():
    from kvcap.analysis.verdict import same_caliber
    from kvcap.rundir import Manifest

    def run(fixed: dict[str, str]) -> Manifest:
        return Manifest(source="bench", run_id="r", started_at=0.0, fixed=fixed)

    old = run({"workload.dataset": "d.jsonl"})  # a run from before the digest was recorded
    new = run({"workload.dataset": "d.jsonl", "workload.dataset_sha256": "ab"})
    assert same_caliber(old, new, set()).equal is True
    moved = run({"workload.dataset": "e.jsonl", "workload.dataset_sha256": "ab"})
    assert [d.to_json() for d in same_caliber(old, moved, set()).differences] == [
        {"key": "workload.dataset", "control": "d.jsonl", "treatment": "e.jsonl"}]
    assert same_caliber(new, moved, set()).equal is True
