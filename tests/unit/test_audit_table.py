"""Reading a published capacity table: one spelling per column, one unit per cell, bounds kept, bad cells named.

`read_table` and `parse_row` against hand-written cells; the checks on the parsed rows are in test_audit.py.
"""

from __future__ import annotations

import math

import pytest

from kvcap.audit.across_levels import audit_table
from kvcap.audit.table import Num, combine_bounds, flip_bound, normalize_header, parse_row, read_table
from kvcap.errors import InputError
from tests.conftest import ROOT

ARTICLE = ROOT / "tests" / "data" / "article_table.csv"


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def read_error(tmp_path, text: str) -> str:
    """The one-line error `read_table` gives for a CSV with this text."""
    path = tmp_path / "t.csv"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError) as e:
        read_table(path)
    return one_line(e)


def audit_error(rows: list[dict]) -> str:
    """The one-line error `audit_table` gives for these rows."""
    with pytest.raises(InputError) as e:
        audit_table(rows, output_tokens=256)
    return one_line(e)


def test_read_table_normalizes_and_keeps_bounds_as_text():
    rows = read_table(ARTICLE)
    assert [r["concurrency"] for r in rows] == ["8", "16", "24"]
    assert rows[2]["ttft_ms"] == ">900"
    assert rows[0]["arm"] == "control (VRAM only)"
    assert normalize_header("Output tok/s") == "output_tok_s"
    assert normalize_header("TTFT p95 (ms)") == "ttft_p95_ms"


@pytest.mark.parametrize(("header", "column"), [
    ("Streams", "concurrency"), ("Max concurrency", "concurrency"), ("Throughput", "output_tok_s"),
    ("Output tokens/s", "output_tok_s"), ("Req/s", "request_s"), ("RPS", "request_s"),
    ("Mean output tokens", "output_tokens"), ("Variant", "arm"), ("Notes", "note"),
    ("  E2E (s)  ", "e2e_s"), ("p99 TTFT, ms", "p99_ttft_ms"),
])
def test_normalize_header_aliases(header, column):
    assert normalize_header(header) == column


def test_parse_row_types_every_cell():
    row = parse_row({"Concurrency": "8", "Output tok/s": "1,234", "TTFT p95 (s)": "0.5", "p99_tpot_ms": "<90",
                     "e2e_median_ms": "20000", "itl_ms": "50", "Arm": " control ", "request_s": "2 req/s",
                     "output_tokens": "256 tokens", "note": "", "unrelated": "anything"}, "row 1")
    assert row.where == "row 1" and row.arm == "control" and row.note == ""
    assert row.concurrency == 8.0
    assert row.output_tok_s == Num(1234.0, None, "1,234")
    assert row.latency["ttft"] == {"p95": Num(500.0, None, "0.5")}      # bare number in the header's unit (s)
    assert row.latency["tpot"] == {"p99": Num(90.0, "upper", "<90"),    # '<' is an upper bound
                                   "": Num(50.0, None, "50")}           # ITL counts as TPOT, unlabelled
    assert row.latency["e2e"] == {"p50": Num(20000.0, None, "20000")}   # median spelled p50
    assert row.request_s == Num(2.0, None, "2 req/s")
    assert row.output_tokens == 256.0


@pytest.mark.parametrize(("cell", "ms", "bound"), [
    ("250", 250.0, None), ("250 ms", 250.0, None), ("0.43s", 430.0, None), (">900", 900.0, "lower"),
    ("≥ 900ms", 900.0, "lower"), ("<=80", 80.0, "upper"), ("≤80", 80.0, "upper"), ("~81.8", 81.8, None),
    ("140 (+44%)", 140.0, None), ("1500us", 1.5, None), (97.5, 97.5, None),
])
def test_latency_cells(cell, ms, bound):
    v = parse_row({"concurrency": 8, "output_tok_s": 97, "ttft_ms": cell}, "row 1").latency["ttft"][""]
    assert v.value == pytest.approx(ms) and v.bound == bound


@pytest.mark.parametrize(("cells", "column", "words"), [
    ({"output_tok_s": "97 ms"}, "output_tok_s", "unexpected unit"),
    ({"output_tok_s": "0"}, "output_tok_s", "must be positive"),
    ({"concurrency": "0"}, "concurrency", "positive number without a bound"),
    ({"ttft_ms": "fast"}, "ttft_ms", "is not a number"),
    ({"ttft_ms": "250 parsecs"}, "ttft_ms", "unknown unit"),
    ({"ttft_ms": "250 min/s"}, "ttft_ms", "unknown unit"),
    ({"ttft_ms": True}, "ttft_ms", "is not a number"),
    ({"ttft_ms": math.nan}, "ttft_ms", "not a finite number"),
    ({"output_tokens": "0"}, "output_tokens", "at least 1"),
    ({"request_s": "0 req/s"}, "request_s", "must be positive"),
])
def test_bad_cells_name_the_row_and_the_column(cells, column, words):
    with pytest.raises(InputError) as e:
        parse_row({"concurrency": 8, "output_tok_s": 97} | cells, "row 7")
    msg = one_line(e)
    assert msg.startswith("row 7: column " + column) and words in msg


def test_num_text_marks_bounds():
    assert Num(900.0, "lower").text("{:g}") == "≥ 900"
    assert Num(80.0, "upper").text("{:g}") == "≤ 80"
    assert Num(5.0, "unknown").text("{:g}") == "≈ 5"
    assert Num(81.8173).text("{:.1f}", "≈ ") == "≈ 81.8"
    assert Num(0.123456).text() == "0.1235"


def test_bounds_flip_and_combine():
    assert flip_bound("lower") == "upper" and flip_bound("upper") == "lower"
    assert flip_bound(None) is None and flip_bound("unknown") == "unknown"
    assert combine_bounds() is None and combine_bounds(None, None) is None
    assert combine_bounds(None, "lower") == "lower" and combine_bounds("upper", "upper") == "upper"
    assert combine_bounds("lower", "upper") == "unknown"


def test_comments_blank_lines_and_bom_are_ignored(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("\ufeff# a comment\nConcurrency,Output tok/s\n\n8,97\n  # another\n16,140,\n", encoding="utf-8")
    assert read_table(path) == [{"concurrency": "8", "output_tok_s": "97"},
                                {"concurrency": "16", "output_tok_s": "140"}]


def test_more_cells_than_columns(tmp_path):
    assert "row 2: 3 cells but the header has 2 columns" in read_error(tmp_path, "concurrency,output_tok_s\n8,97,250\n")


def test_missing_file(tmp_path):
    with pytest.raises(InputError) as e:
        read_table(tmp_path / "nope.csv")
    assert "no such file" in one_line(e)


def test_missing_columns(tmp_path):
    msg = read_error(tmp_path, "streams_total,ttft_ms\n8,250\n")
    assert "concurrency" in msg and "output_tok_s" in msg and "ttft_ms" in msg
    assert "output_tok_s" in audit_error([{"concurrency": 8}])


def test_non_numeric(tmp_path):
    msg = read_error(tmp_path, "concurrency,output_tok_s,ttft_ms\n8,97,250\n16,lots,430\n")
    assert "row 3" in msg and "output_tok_s" in msg and "'lots'" in msg
    assert "ttft_ms" in audit_error([{"concurrency": 8, "output_tok_s": 97, "ttft_ms": "fast"}])
    assert "concurrency" in audit_error([{"concurrency": ">8", "output_tok_s": 97}])


def test_empty_and_duplicate_rows(tmp_path):
    assert "no rows" in read_error(tmp_path, "concurrency,output_tok_s\n")
    assert "second row" in audit_error([{"concurrency": 8, "output_tok_s": 97}, {"concurrency": 8, "output_tok_s": 99}])
