"""Units: bits vs bytes and 10^3 vs 2^10 are never mixed; typos are errors."""

import pytest

from kvcap.errors import InputError
from kvcap.units import (
    bytes_s_to_gbps,
    format_bandwidth,
    format_size,
    parse_bandwidth,
    parse_duration,
    parse_fraction,
    parse_size,
)


@pytest.mark.parametrize(("text", "expected"), [
    ("24GiB", 24 * 2**30), ("24GB", 24 * 10**9), ("128 GiB", 128 * 2**30), ("512MiB", 512 * 2**20),
    ("1.5TB", 1_500_000_000_000), ("4096", 4096), (" 2 KiB ", 2048), ("1e3B", 1000),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(("text", "bytes_s"), [
    ("100Gbps", 12.5e9), ("100 Gb/s", 12.5e9), ("12.5GB/s", 12.5e9), ("20 GB/s", 20e9), ("25Gbit/s", 3.125e9),
    ("400Mbps", 50e6), ("1GiB/s", 2**30), ("10GBps", 10e9),
])
def test_parse_bandwidth(text, bytes_s):
    assert parse_bandwidth(text) == pytest.approx(bytes_s)


def test_article_unit_conversion():
    # the article: 20 GB/s × 8 = 160 Gbps, and never compare 20 GB/s with 20 Gbps
    assert bytes_s_to_gbps(parse_bandwidth("20GB/s")) == pytest.approx(160.0)
    assert parse_bandwidth("20GB/s") == pytest.approx(8 * parse_bandwidth("20Gbps"))
    assert format_bandwidth(20e9) == "20 GB/s (160 Gbps)"
    assert format_bandwidth(12.5e9) == "12.5 GB/s (100 Gbps)"


@pytest.mark.parametrize(("text", "seconds"), [
    ("500ms", 0.5), ("2s", 2.0), ("1m", 60.0), ("1.5h", 5400.0), ("250us", 250e-6), ("10", 10.0),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_fraction():
    assert parse_fraction("1%") == pytest.approx(0.01)
    assert parse_fraction("0.9") == pytest.approx(0.9)
    assert parse_fraction("90%") == pytest.approx(0.9)


@pytest.mark.parametrize(("fn", "text", "fragment"), [
    (parse_size, "24Gib", "did you mean GiB"),
    (parse_size, "24G", "ambiguous"),
    (parse_size, "-1GiB", "positive"),
    (parse_size, "0GB", "positive"),
    (parse_size, "lots", "cannot read"),
    (parse_bandwidth, "100gbs", "did you mean"),
    (parse_bandwidth, "100", "needs a unit"),
    (parse_bandwidth, "0Gbps", "positive"),
    (parse_duration, "5 parsecs", "unknown unit"),
    (parse_duration, "-2s", "negative"),
    (parse_fraction, "1.5", "between 0 and 1"),
    (parse_fraction, "120%", "between 0 and 1"),
])
def test_bad_units_are_errors(fn, text, fragment):
    with pytest.raises(InputError, match=fragment):
        fn(text)


@pytest.mark.parametrize("n", [1, 1023, 2**30, 24 * 2**30, 3 * 10**12])
def test_size_round_trip(n):
    # printed binary sizes read back within print precision
    printed = format_size(n)
    assert parse_size(printed.replace(" ", "")) == pytest.approx(n, rel=5e-3)
    printed_dec = format_size(n, binary=False)
    assert parse_size(printed_dec.replace(" ", "")) == pytest.approx(n, rel=5e-3)


def test_bandwidth_round_trip():
    for bw in (3.125e9, 12.5e9, 50e9, 900e9):
        gbs, gbps = format_bandwidth(bw).split(" (")
        assert parse_bandwidth(gbs.replace(" ", "")) == pytest.approx(bw, rel=1e-3)
        assert parse_bandwidth(gbps.rstrip(")").replace(" ", "")) == pytest.approx(bw, rel=1e-3)
