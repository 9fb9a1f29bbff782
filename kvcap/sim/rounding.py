"""``round(x, k)`` for the records' and telemetry's fixed decimals, the same floats, faster where it can be.

Why: CPython's ``round(x, k)`` goes through a correctly rounded decimal string and back (``_Py_dg_dtoa``, a format,
``_Py_dg_strtod``), a visible share of the compiled simulator's time at several rounded fields a request. For almost
every value the answer is plain arithmetic: with ``y = x·10^k`` clearly away from a half (|y − n| < 0.499 for the
nearest integer n), the exact x·10^k rounds to that same n (y's own error is under 2^-13 for |y| < 10^12), and
``n / 10^k`` is the double nearest the decimal n·10^-k — a correctly rounded quotient of that very decimal, which is
what ``round`` returns (it is never a tie: such a decimal is either exactly a double or not dyadic). Anything else —
near a half, a zero (its sign), huge, NaN or infinite — takes the builtin.
"""

from __future__ import annotations

_SCALES = (1.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0, 1000000.0)


def round_to(x: float, digits: int) -> float:
    """``round(x, digits)`` (0 ≤ digits ≤ 6), bit for bit."""
    scale = _SCALES[digits]
    y = x * scale
    if -1e12 < y < 1e12:
        n = float(int(y + 0.5)) if y >= 0.0 else -float(int(0.5 - y))
        d = y - n
        if -0.499 < d < 0.499 and n != 0.0:
            return n / scale
    return round(x, digits)
