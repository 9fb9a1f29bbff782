"""The run directory's models are its contract: they read what the writers wrote and write it back byte for byte,
refuse what they do not know, and the committed docs/run-directory.md is what they print."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kvcap.analysis.summary import best_goodput_level, build_summary
from kvcap.analysis.verdict import compare
from kvcap.rundir import RunDir, write_json_atomic
from kvcap.rundir.compare import Comparison
from kvcap.rundir.doc import render
from kvcap.rundir.manifest import Manifest
from kvcap.rundir.summary import Finding, Summary
from tests.conftest import ROOT

GOLDEN = ROOT / "tests" / "data" / "summary_golden"


def test_the_committed_doc_is_what_the_models_print():
    committed = (ROOT / "docs" / "run-directory.md").read_text()
    assert committed == render(), "docs/run-directory.md drifted: python -m kvcap.rundir.doc > docs/run-directory.md"


@pytest.mark.parametrize("which", ["bench", "sim"])
def test_a_summary_reads_and_writes_back_the_same_bytes(which, tmp_path):
    raw = (GOLDEN / which / "summary.expected.json").read_text()
    summary = Summary.model_validate(json.loads(raw))
    write_json_atomic(tmp_path / "summary.json", summary)  # what every writer of summary.json writes
    assert (tmp_path / "summary.json").read_text() == json.dumps(json.loads(raw), indent=2, allow_nan=False) + "\n"
    assert summary.levels[0].ttft_ms.p95 == json.loads(raw)["levels"][0]["ttft_ms"]["p95"]


@pytest.mark.parametrize("which", ["bench", "sim"])
def test_the_manifest_is_read_once_into_its_model(which):
    run = RunDir(GOLDEN / which)
    manifest = run.manifest
    assert isinstance(manifest, Manifest) and run.manifest is manifest
    assert manifest.to_json() == json.loads((GOLDEN / which / "manifest.json").read_text())


def test_level_lines_are_models():
    rows = RunDir(GOLDEN / "sim").levels()
    raw = [json.loads(line) for line in (GOLDEN / "sim" / "levels.jsonl").read_text().splitlines()]
    assert [(r.mode, r.level, r.repeat, r.measure_start_s) for r in rows] == [
        (d["mode"], d["level"], d.get("repeat", 0), d["measure_start_s"]) for d in raw]


def test_an_unknown_summary_key_is_refused():
    data = json.loads((GOLDEN / "sim" / "summary.expected.json").read_text())
    data["levels"][0]["goodput_tok_per_s"] = 1.0
    with pytest.raises(ValidationError, match="goodput_tok_per_s"):
        Summary.model_validate(data)


def test_ints_stay_ints_and_absent_keys_stay_absent():
    f = Finding.model_validate({"bound": "compute", "evidence": "e", "direction": "d", "arm": "a"})
    assert json.dumps(f.to_json()) == '{"bound": "compute", "evidence": "e", "direction": "d", "arm": "a"}'
    data = json.loads((GOLDEN / "sim" / "summary.expected.json").read_text())
    summary = Summary.model_validate(data)
    assert "sim" not in summary.to_json() and summary.sim is None
    assert type(summary.to_json()["levels"][0]["level"]) is type(data["levels"][0]["level"])


def test_best_goodput_level_is_the_first_of_the_highest():
    summary = build_summary(RunDir(GOLDEN / "sim"))
    best = best_goodput_level(summary.levels)
    assert best is not None and best.goodput_tok_s == max(lv.goodput_tok_s for lv in summary.levels)
    assert best is next(lv for lv in summary.levels if lv.goodput_tok_s == best.goodput_tok_s)
    assert best_goodput_level([]) is None


def test_compare_json_is_a_comparison():
    result = compare(str(GOLDEN / "bench"), str(GOLDEN / "bench"))
    saved = result.to_json()
    assert Comparison.model_validate(saved).to_json() == saved
    # optional keys absent, but for ``moved``: optional only so that an older kvcap's compare.json still reads
    assert list(saved) == [k for k, f in Comparison.model_fields.items() if f.is_required() or k == "moved"]
    assert result.summaries is not None
    assert result.control.goodput_level == best_goodput_level(result.summaries.control.levels).level
