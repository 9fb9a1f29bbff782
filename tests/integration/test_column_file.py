"""``requests.columns`` (issue 14): ``kvcap sim`` writes the analysed fields of its records as binary columns beside
``requests.jsonl``; the analysis reads them instead of parsing the JSONL only while they were taken from that very
file. The summary must be the JSONL's on every key, the column file must really be the one read, and any change to
the JSONL (an appended record, an edit in place, a truncated column file) must send the analysis back to the JSONL.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcap.analysis import telemetry
from kvcap.analysis.summary import build_summary
from kvcap.rundir import COLUMN_COPIES, REQUESTS, TELEMETRY, RunDir, RunWriter
from kvcap.rundir.store import column_file, column_reader
from kvcap.rundir.store.column_file import _itl_stored, stored_columns
from tests.conftest import run_cli
from tests.integration.test_record_columns import CASES, SCENARIO
from tests.servers import start_fake_server

COLUMNS, COLUMNS_INDEX = column_file.copy_paths(Path(REQUESTS))
_, TEL_INDEX = column_file.copy_paths(Path(TELEMETRY))


def _summary(out: Path) -> str:
    run = RunDir(out)
    return json.dumps(build_summary(run, slo=run.slo).to_json(), sort_keys=True)


def _jsonl_summary(out: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The summary from the JSONL files alone (both copies ignored)."""
    with monkeypatch.context() as m:
        m.setattr(column_reader, "stored_columns", lambda path: None)
        m.setattr(telemetry, "stored_telemetry", lambda path: None)
        return _summary(out)


def _sim(out: Path, *args: str) -> None:
    p = run_cli("sim", SCENARIO, *args, "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr


def _reads_columns(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Counts the rows read from each column copy (so a test knows which path the analysis took)."""
    read: dict[str, list[int]] = {"requests": [], "telemetry": []}
    original = column_file._chunks

    def counted(jsonl: Path, index: dict[str, Any], fields: Any, own_length: tuple[str, ...] = ()) -> Any:
        for arrays in original(jsonl, index, fields, own_length):
            read[jsonl.stem].append(int(next(iter(arrays.values())).size))
            yield arrays

    monkeypatch.setattr(column_file, "_chunks", counted)
    return read


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


@pytest.mark.parametrize("case", list(CASES))
def test_the_column_file_gives_the_jsonls_summary_on_every_key(case: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _sim(out, *CASES[case])
    for jsonl in (REQUESTS, TELEMETRY):
        index = json.loads((out / column_file.copy_paths(Path(jsonl))[1]).read_text())
        assert index["rows"] == _lines(out / jsonl) > 0
    read = _reads_columns(monkeypatch)
    from_columns = _summary(out)
    assert sum(read["requests"]) == _lines(out / REQUESTS), "requests.jsonl was parsed, not its columns read"
    assert sum(read["telemetry"]) == _lines(out / TELEMETRY), "telemetry.jsonl was parsed, not its columns read"
    assert from_columns == _jsonl_summary(out, monkeypatch)


def test_analyze_writes_the_copies_a_run_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run without copies (an older version's, or deleted): ``kvcap analyze`` parses the JSONL and leaves the
    copies, which the next analysis reads for the same summary."""
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4,8", "--requests", "80", "--warmup", "0s", "--repeats", "1")
    before = _summary(out)
    for name in COLUMN_COPIES:
        (out / name).unlink()
    p = run_cli("analyze", str(out), "--json")
    assert p.returncode == 0, p.stderr
    assert all((out / name).exists() for name in COLUMN_COPIES)
    read = _reads_columns(monkeypatch)
    assert _summary(out) == before == _jsonl_summary(out, monkeypatch)
    assert sum(read["requests"]) == _lines(out / REQUESTS) and sum(read["telemetry"]) == _lines(out / TELEMETRY)


def test_a_copy_that_keeps_the_times_keeps_the_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4,8", "--requests", "80", "--warmup", "0s", "--repeats", "1")
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)  # copy2: times kept
    assert stored_columns(copy / REQUESTS) is not None
    read = _reads_columns(monkeypatch)
    assert _summary(copy) == _summary(out)
    assert read["requests"] and read["telemetry"]


def test_an_appended_record_sends_the_analysis_back_to_the_jsonl(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One failed request appended by hand: the columns no longer match, the summary counts it."""
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4", "--requests", "60", "--warmup", "0s", "--repeats", "1")
    before = json.loads(_summary(out))["levels"][0]
    line = json.loads((out / REQUESTS).read_text().splitlines()[-1])
    line.update(ok=False, error="http_5xx", itl_ms=[], output_tokens=0, ttft_ms=None, tpot_ms=None)
    with open(out / REQUESTS, "a") as f:
        f.write(json.dumps(line) + "\n")
    assert stored_columns(out / REQUESTS) is None
    read = _reads_columns(monkeypatch)
    after = json.loads(_summary(out))["levels"][0]
    assert not read["requests"] and read["telemetry"]
    assert (after["requests"], after["errors"]) == (before["requests"] + 1, before["errors"] + 1)


def test_an_edit_in_place_of_the_same_size_is_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value rewritten with as many characters (``sed -i``): the size is the same, the time and the digest not."""
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4", "--requests", "60", "--warmup", "0s", "--repeats", "1")
    path = out / REQUESTS
    text = path.read_bytes()
    st = path.stat()
    edited = text.replace(b'"ok":true', b'"ok":null', 1)
    assert len(edited) == len(text) and edited != text
    path.write_bytes(edited)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its old time: the first MiB's digest differs
    assert stored_columns(path) is None
    read = _reads_columns(monkeypatch)
    level = json.loads(_summary(out))["levels"][0]
    assert not read["requests"] and level["ok"] == level["requests"] - 1


def test_a_damaged_column_file_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4,16", "--requests", "100", "--warmup", "0s", "--repeats", "1")
    truth = _jsonl_summary(out, monkeypatch)
    whole = (out / COLUMNS).read_bytes()
    (out / COLUMNS).write_bytes(whole[: len(whole) // 2])  # shorter than its index says
    assert stored_columns(out / REQUESTS) is None
    assert _summary(out) == truth
    index = json.loads((out / COLUMNS_INDEX).read_text())
    index["bytes"] = len(whole) // 2  # an index that agrees with the cut file: the read itself finds it short
    (out / COLUMNS_INDEX).write_text(json.dumps(index))
    assert stored_columns(out / REQUESTS) is not None
    assert _summary(out) == truth
    (out / COLUMNS_INDEX).unlink()  # a killed run: no index
    assert stored_columns(out / REQUESTS) is None
    assert _summary(out) == truth


def test_a_telemetry_row_added_by_hand_is_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A running count appended to ``telemetry.jsonl`` past anything the run held: its copy no longer matches, and
    the resident capacity read from the rows is that count."""
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4", "--requests", "60", "--warmup", "0s", "--repeats", "1")
    level = json.loads((out / "levels.jsonl").read_text().splitlines()[0])
    row = {"t_s": round((level["measure_start_s"] + level["measure_end_s"]) / 2, 3), "source": "sim",
           "name": "server.requests_running", "labels": {"replica": "r0", "node": "n0"}, "value": 77}
    with open(out / TELEMETRY, "a") as f:
        f.write(json.dumps(row) + "\n")
    assert telemetry.stored_telemetry(out / TELEMETRY) is None
    read = _reads_columns(monkeypatch)
    summary = json.loads(_summary(out))
    assert read["requests"] and not read["telemetry"]
    assert summary == json.loads(_jsonl_summary(out, monkeypatch))
    assert summary["capacity"]["resident"] >= 77


def test_a_damaged_telemetry_copy_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    _sim(out, "--set", "serving.kv_offload=remote", "--concurrency", "8,32", "--requests", "100", "--warmup", "0s",
         "--repeats", "1")
    truth = _jsonl_summary(out, monkeypatch)
    index = json.loads((out / TEL_INDEX).read_text())
    index["series"] = index["series"][:3]  # rows whose series is not listed
    (out / TEL_INDEX).write_text(json.dumps(index))
    assert _summary(out) == truth
    (out / TEL_INDEX).unlink()
    assert telemetry.stored_telemetry(out / TELEMETRY) is None
    assert _summary(out) == truth


@pytest.mark.parametrize("how", ["overwrite", "append"])
def test_a_writer_opening_the_directory_again_drops_the_old_copies(how: str, tmp_path: Path) -> None:
    """``bench --overwrite`` / ``--append`` over a ``sim`` run: the files change, so their copies go."""
    assert {p.name for jsonl in (REQUESTS, TELEMETRY) for p in column_file.copy_paths(Path(jsonl))} == set(
        COLUMN_COPIES)
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4", "--requests", "40", "--warmup", "0s", "--repeats", "1")
    assert all((out / name).exists() for name in COLUMN_COPIES)
    RunWriter(out, **{how: True}).close()
    assert not any((out / name).exists() for name in COLUMN_COPIES)
    assert (out / REQUESTS).exists() == (how == "append")


def test_itls_are_stored_in_the_fewest_bytes_that_give_back_the_same_floats() -> None:
    on_grid = np.array([0.001, 21.5, 65.535, 0.0])
    assert _itl_stored(on_grid).dtype == np.uint16
    assert np.array_equal(_itl_stored(on_grid) / 1e3, on_grid)
    wide = np.array([65.536, 3_600_000.0])
    assert _itl_stored(wide).dtype == np.uint32 and np.array_equal(_itl_stored(wide) / 1e3, wide)
    for off in (np.array([0.0005, 1.0]), np.array([-0.001]), np.array([np.nan]), np.array([5e6])):
        stored = _itl_stored(off)
        assert stored.dtype == np.float64 and np.array_equal(stored, off, equal_nan=True)


def test_an_interrupt_between_the_jsonl_and_its_copy_leaves_no_copy_trusted(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while a chunk of records is being taken into columns: the JSONL has records the copy never got.
    The copy gets no index (so it is not read), and the run's own summary counts every record of the file."""
    from kvcap.cli import main
    from kvcap.rundir.store import record_columns

    calls = [0]
    extract = record_columns.extract
    init = record_columns.RecordColumns.__init__

    def interrupted(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return extract(*args)

    def small_chunks(self: Any, sink: Any, chunk: int = 4096) -> None:
        init(self, sink, 64)

    monkeypatch.setattr(record_columns, "extract", interrupted)
    monkeypatch.setattr(record_columns.RecordColumns, "__init__", small_chunks)
    out = tmp_path / "run"
    main(["sim", SCENARIO, "--concurrency", "4,16", "--requests", "300", "--warmup", "0s", "--repeats", "1",
          "--out", str(out), "--quiet"])
    monkeypatch.setattr(record_columns, "extract", extract)
    assert calls[0] >= 2
    assert not (out / COLUMNS_INDEX).exists() and not (out / COLUMNS).exists()
    written = json.loads((out / "summary.json").read_text())
    assert written["interrupted"] is True
    assert sum(lv["requests"] for lv in written["levels"]) == _lines(out / REQUESTS) > 64


def test_a_changed_byte_in_the_copys_data_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte of the copy's data flipped, its size and index untouched: the checksum sends the analysis back to
    the JSONL, whose figures it gives."""
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4,16", "--requests", "100", "--warmup", "0s", "--repeats", "1")
    truth = _jsonl_summary(out, monkeypatch)
    for name in (COLUMNS, column_file.copy_paths(Path(TELEMETRY))[0]):
        whole = bytearray((out / name).read_bytes())
        keep = bytes(whole)
        whole[len(whole) * 2 // 3] ^= 0x40  # inside some array's data (headers are ~128 bytes of ~10⁵)
        (out / name).write_bytes(bytes(whole))
        read = _reads_columns(monkeypatch)
        assert _summary(out) == truth
        assert read["requests" if name == COLUMNS else "telemetry"], "the copy was not even read"
        (out / name).write_bytes(keep)


def test_bench_leaves_copies_of_what_it_read_for_its_own_summary(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvcap bench``'s closing summary parses the JSONL files once and writes their copies as it goes: a later
    ``analyze`` reads them, and gets the JSONL's summary."""
    out = tmp_path / "run"
    with start_fake_server(slots=4, step_a="5ms", step_b="1ms") as srv:
        p = run_cli("bench", "--url", srv.url, "--concurrency", "2,6", "--requests", "60", "--warmup", "0s",
                    "--input-tokens", "32", "--output-tokens", "16", "--metrics-url", srv.url + "/metrics",
                    "--out", str(out), "--quiet")
    assert p.returncode == 0, p.stderr
    assert all((out / name).exists() for name in COLUMN_COPIES)
    read = _reads_columns(monkeypatch)
    from_copies = _summary(out)
    assert sum(read["requests"]) == _lines(out / REQUESTS) and sum(read["telemetry"]) > 0
    assert from_copies == _jsonl_summary(out, monkeypatch)
    assert json.loads(from_copies)["levels"][1]["server_running_max"] is not None  # telemetry really in it


@pytest.mark.parametrize("copies", [True, False])
def test_a_level_without_its_line_is_counted_in_bounded_memory(copies: bool, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed run's last level has no line in ``levels.jsonl``: its window comes from its records. Its ITLs are
    kept to count its tokens only up to ``KEEP_ITL_MAX``; past it the records are read a second time. Both ways
    give the same summary, from the copies and from the JSONL."""
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4,16", "--requests", "150", "--warmup", "5s", "--repeats", "1")
    lines = (out / "levels.jsonl").read_text().splitlines()
    (out / "levels.jsonl").write_text(lines[0] + "\n")  # the c=16 level as if killed before its line
    if not copies:
        for name in COLUMN_COPIES:
            (out / name).unlink()
    second_reads: list[int] = []
    again = column_reader._count_again

    def counted(*args: Any) -> None:
        second_reads.append(1)
        again(*args)

    monkeypatch.setattr(column_reader, "_count_again", counted)
    monkeypatch.setattr(column_reader, "KEEP_ITL_MAX", 10**12)
    kept = _summary(out)
    assert not second_reads
    monkeypatch.setattr(column_reader, "KEEP_ITL_MAX", 100)
    read = _reads_columns(monkeypatch)
    recounted = _summary(out)
    assert second_reads == [1]
    assert bool(read["requests"]) == copies
    assert recounted == kept
    level = json.loads(recounted)["levels"][1]
    assert level["level"] == 16 and level["output_tok_s"] > 0


def test_a_copy_that_cannot_be_written_costs_only_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk while ``bench``'s summary writes the copies: the summary is still built, no copy is left."""
    import errno

    out = tmp_path / "run"
    _sim(out, "--concurrency", "4", "--requests", "60", "--warmup", "0s", "--repeats", "1")
    for name in COLUMN_COPIES:
        (out / name).unlink()
    truth = _jsonl_summary(out, monkeypatch)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(column_file.np, "save", full)
        got = build_summary(RunDir(out), slo=RunDir(out).slo, write_copies=True).to_json()
    assert json.dumps(got, sort_keys=True) == truth
    assert not any((out / name).exists() for name in COLUMN_COPIES)


def test_copies_written_from_odd_files_read_back_as_parsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies written by a reader (``bench``'s way) of hand-made files: series whose source is missing, empty or a
    number that reads as the same text are one series both ways; a record without a repeat or with one past 32 bits
    is kept as parsed."""
    out = tmp_path / "run"
    _sim(out, "--concurrency", "4", "--requests", "60", "--warmup", "0s", "--repeats", "1")
    for name in COLUMN_COPIES:
        (out / name).unlink()
    recs = [json.loads(x) for x in (out / REQUESTS).read_text().splitlines()]
    recs[3]["repeat"], recs[10]["repeat"] = None, 2**32
    (out / REQUESTS).write_text("".join(json.dumps(r) + "\n" for r in recs))
    rows = [{"t_s": 0.0, "name": "server.requests_running", "labels": {"replica": "x"}, "value": 1, "hold_s": 1.0},
            {"t_s": 3.0, "name": "server.requests_running", "labels": {"replica": "x"}, "value": 5, "hold_s": 1.0},
            {"t_s": 4.0, "source": "", "name": "server.requests_running", "labels": {"replica": "x"}, "value": 2},
            {"t_s": 5.0, "source": 1, "name": "gpu.util", "labels": {}, "value": 0.5},
            {"t_s": 6.0, "source": "1", "name": "gpu.util", "labels": {}, "value": 0.7}]
    with open(out / TELEMETRY, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    truth = _jsonl_summary(out, monkeypatch)
    run = RunDir(out)
    assert json.dumps(build_summary(run, slo=run.slo, write_copies=True).to_json(), sort_keys=True) == truth
    assert all((out / name).exists() for name in COLUMN_COPIES)
    read = _reads_columns(monkeypatch)
    assert _summary(out) == truth
    assert read["requests"] and read["telemetry"]
    parsed = telemetry.dedupe_sources(run.iter_telemetry())
    copied = telemetry.read_telemetry(run)
    assert parsed.meta == copied.meta
    assert all(all(np.array_equal(a, b, equal_nan=True) for a, b in zip(x, y)) for x, y in zip(parsed.raw,
                                                                                              copied.raw))
