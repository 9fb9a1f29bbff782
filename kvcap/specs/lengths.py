"""Token-length distributions: ``1024``, ``uniform:a,b``, ``normal:mean,sd[,max]``, ``lognormal:mean,sd[,max]``
(clamped to [1, max])."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from kvcap.errors import InputError


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts, always clamped to [lo, hi] and rounded to integers."""

    kind: str
    a: float
    b: float = 0.0
    lo: int = 1
    hi: int = 1_000_000

    @property
    def spec(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        cap = f",{self.hi}" if self.kind != "uniform" and self.hi < 1_000_000 else ""
        return f"{self.kind}:{self.a:g},{self.b:g}{cap}"

    @property
    def mean(self) -> float:
        return float(self.a) if self.kind != "uniform" else (self.a + self.b) / 2

    def scaled(self, mean: float) -> LengthDist:
        """The same shape (spread and cap in proportion) around ``mean``: the lengths a server counted, when it
        counts every prompt ``mean / self.mean`` times what was asked."""
        r = mean / self.mean
        if self.kind == "fixed":
            return LengthDist("fixed", max(1, round(mean)), hi=max(self.hi, max(1, round(mean))))
        hi = self.hi if self.hi >= 1_000_000 else max(1, round(self.hi * r))
        if self.kind == "uniform":
            lo, up = max(1, round(self.a * r)), max(1, round(self.b * r))
            return LengthDist("uniform", lo, max(lo, up), hi=hi)
        return LengthDist(self.kind, round(mean, 1), round(self.b * r, 1), hi=hi)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = rng.integers(int(self.a), int(self.b) + 1, size=n)
        elif self.kind == "normal":
            x = rng.normal(self.a, self.b, size=n)
        else:  # lognormal parameterised by its own mean and sd (not the underlying normal's)
            sigma2 = np.log1p((self.b / self.a) ** 2)
            x = rng.lognormal(np.log(self.a) - sigma2 / 2, np.sqrt(sigma2), size=n)
        lengths: np.ndarray = np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)
        return lengths

    def quantiles(self, n: int) -> np.ndarray:
        """``n`` lengths at the probabilities (i + ½) / n, in increasing order: a sample with no sampling noise in
        its mean or spread, for replaying a run of known size whose exact lengths are not known."""
        p = (np.arange(n) + 0.5) / n
        if self.kind == "fixed":
            x = np.full(n, self.a)
        elif self.kind == "uniform":
            x = np.floor(self.a + (self.b - self.a + 1) * p)
        else:
            z = np.array([NormalDist().inv_cdf(float(q)) for q in p])
            if self.kind == "normal":
                x = self.a + self.b * z
            else:
                sigma2 = np.log1p((self.b / self.a) ** 2)
                x = np.exp(np.log(self.a) - sigma2 / 2 + np.sqrt(sigma2) * z)
        lengths: np.ndarray = np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)
        return lengths


def parse_length(text: str | int, what: str = "length", hi: int = 1_000_000) -> LengthDist:
    s = str(text).strip()
    kind, sep, rest = s.partition(":")
    try:
        if not sep:
            n = int(s)
            if n <= 0:
                raise InputError(f"{what} must be a positive integer, got {s!r}")
            return LengthDist("fixed", n, hi=max(hi, n))
        args = [float(x) for x in rest.split(",")]
    except ValueError:
        raise InputError(f"cannot read {what} {s!r}: use N, uniform:a,b, normal:mean,sd or lognormal:mean,sd") from None
    if (kind not in ("uniform", "normal", "lognormal") or len(args) not in (2, 3)
            or (kind == "uniform" and len(args) == 3)):
        raise InputError(f"cannot read {what} {s!r}: use N, uniform:a,b, normal:mean,sd[,max] or "
                         "lognormal:mean,sd[,max]")
    a, b = args[:2]
    if len(args) == 3:
        if args[2] < 1:
            raise InputError(f"{what} {s!r}: the cap must be at least 1")
        hi = min(hi, int(args[2]))
    if kind == "uniform" and not 1 <= a <= b:
        raise InputError(f"{what} {s!r}: uniform needs 1 ≤ a ≤ b")
    if kind != "uniform" and (a <= 0 or b < 0):
        raise InputError(f"{what} {s!r}: mean must be positive and sd not negative")
    return LengthDist(kind, a, b, hi=hi)
