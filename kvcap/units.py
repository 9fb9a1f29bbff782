"""Parsing and printing of sizes, bandwidths, durations and fractions.

Capacity planning goes wrong most often at the units: GB vs GiB, GB/s vs Gbps.
Every quantity inside kvcap is held in base units — bytes, bytes per second,
seconds, fractions — and converted only here, at the edges. Suffixes are
case-exact: ``24GiB`` and ``24GB`` differ, and a typo such as ``24Gib`` is an
error, not a guess.
"""

from __future__ import annotations

import math
import re

from kvcap.errors import InputError

_NUMBER = r"(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_PATTERN = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[A-Za-zµ/%]*)\s*$")

SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50,
}

# bandwidth suffix -> bytes per second per unit
BANDWIDTH_UNITS: dict[str, float] = {}
for _p, _m in (("", 1.0), ("k", 1e3), ("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
    for _bits in (f"{_p}bps", f"{_p}b/s", f"{_p}bit/s"):
        BANDWIDTH_UNITS[_bits] = _m / 8.0
    for _bytes in (f"{_p}B/s", f"{_p}Bps"):
        BANDWIDTH_UNITS[_bytes] = _m
for _p, _m in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40)):
    BANDWIDTH_UNITS[f"{_p}B/s"] = float(_m)
del _p, _m, _bits, _bytes

DURATION_UNITS: dict[str, float] = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0,
}


def _split(text: str, what: str) -> tuple[float, str]:
    if isinstance(text, (int, float)):
        return float(text), ""
    m = _PATTERN.match(str(text))
    if not m:
        raise InputError(f"cannot read {what} {text!r}")
    return float(m.group("num")), m.group("unit")


def _suggest(unit: str, table: dict[str, float] | dict[str, int]) -> str:
    folded = [u for u in table if u.lower() == unit.lower()]
    if not folded and unit.lower().endswith("s"):
        folded = [u for u in table if u.lower().replace("/", "") == unit.lower()]
    if folded:
        return f" (did you mean {' or '.join(sorted(set(folded)))}?)"
    return f" (use one of {', '.join(list(table)[:12])}…)"


def parse_size(text: str | int | float, what: str = "size") -> int:
    """``'24GiB'`` → 25769803776. A bare number is bytes. Must be > 0."""
    num, unit = _split(text, what)
    unit = unit or "B"
    if unit not in SIZE_UNITS:
        if unit in ("G", "M", "T", "K", "g", "m", "t", "k"):
            raise InputError(f"ambiguous {what} {text!r}: write {num:g}{unit.upper()}B (10^n) or "
                             f"{num:g}{unit.upper()}iB (2^n)")
        raise InputError(f"unknown unit {unit!r} in {what} {text!r}{_suggest(unit, SIZE_UNITS)}")
    value = num * SIZE_UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{what} must be positive, got {text!r}")
    return round(value)


def parse_bandwidth(text: str | int | float, what: str = "bandwidth") -> float:
    """``'100Gbps'`` → 12.5e9 bytes/s; ``'12.5GB/s'`` → 12.5e9. Text needs a unit; a number is bytes/s."""
    num, unit = _split(text, what)
    if not unit and isinstance(text, (int, float)) and num > 0:
        return float(num)
    if not unit:
        raise InputError(f"{what} {text!r} needs a unit, e.g. 100Gbps or 12.5GB/s")
    if unit not in BANDWIDTH_UNITS:
        raise InputError(f"unknown unit {unit!r} in {what} {text!r}{_suggest(unit, BANDWIDTH_UNITS)}")
    value = num * BANDWIDTH_UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"{what} must be positive, got {text!r}")
    return value


def parse_duration(text: str | int | float, what: str = "duration", bare_unit: str | None = "s") -> float:
    """``'500ms'`` → 0.5 s. A bare number is read in ``bare_unit`` (or refused if None)."""
    num, unit = _split(text, what)
    if not unit:
        if bare_unit is None:
            raise InputError(f"{what} {text!r} needs a unit, e.g. 500ms or 2s")
        unit = bare_unit
    if unit not in DURATION_UNITS:
        raise InputError(f"unknown unit {unit!r} in {what} {text!r}{_suggest(unit, DURATION_UNITS)}")
    value = num * DURATION_UNITS[unit]
    if not math.isfinite(value) or value < 0:
        raise InputError(f"{what} must not be negative, got {text!r}")
    return value


def parse_fraction(text: str | int | float, what: str = "fraction") -> float:
    """``'1%'`` → 0.01; ``'0.9'`` → 0.9. Must lie in [0, 1]."""
    num, unit = _split(text, what)
    if unit == "%":
        num /= 100.0
    elif unit:
        raise InputError(f"unknown unit {unit!r} in {what} {text!r} (use a fraction like 0.9 or a percentage like 90%)")
    if not 0.0 <= num <= 1.0:
        raise InputError(f"{what} must be between 0 and 1 (or 0% and 100%), got {text!r}")
    return num


def format_size(n_bytes: float, binary: bool = True) -> str:
    """Human size in binary (GiB) or decimal (GB) units, never mixed."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB") if binary else ("B", "kB", "MB", "GB", "TB", "PB")
    base = 1024.0 if binary else 1000.0
    value = float(n_bytes)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def bytes_s_to_gbps(bytes_s: float) -> float:
    """Bytes per second → gigabits per second (10^9 bits)."""
    return bytes_s * 8.0 / 1e9


def format_bandwidth(bytes_s: float) -> str:
    """Both ways, so nobody compares GB/s with Gbps: ``'20 GB/s (160 Gbps)'`` (4 significant digits)."""
    return f"{bytes_s / 1e9:.4g} GB/s ({bytes_s_to_gbps(bytes_s):.4g} Gbps)"
