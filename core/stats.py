"""Welch's one-sided t-test, for the canary's decision (core/canary.py). Pure Python: the proxy's
image has no SciPy, and this is all of it that is needed (checked against SciPy in the tests)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Welch:
    difference: float  # mean(a) - mean(b)
    se: float  # standard error of the difference
    df: float  # Welch-Satterthwaite degrees of freedom

    def p_greater(self, shift: float = 0.0) -> float:
        """p-value of H1 "mean(a) - mean(b) > shift" (small: a is clearly above b + shift)."""
        if self.se == 0.0:
            return 0.0 if self.difference > shift else 1.0
        return t_sf((self.difference - shift) / self.se, self.df)

    def p_less(self, shift: float = 0.0) -> float:
        """p-value of H1 "mean(a) - mean(b) < shift"."""
        if self.se == 0.0:
            return 0.0 if self.difference < shift else 1.0
        return t_sf((shift - self.difference) / self.se, self.df)


def welch(a: Sequence[float], b: Sequence[float]) -> Welch:
    """Needs two values or more in each sample."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError("Welch's test needs at least two values per sample")
    (ma, va), (mb, vb) = _mean_var(a), _mean_var(b)
    qa, qb = va / len(a), vb / len(b)
    se = math.sqrt(qa + qb)
    if se == 0.0:
        return Welch(ma - mb, 0.0, float(len(a) + len(b) - 2))
    df = (qa + qb) ** 2 / (qa**2 / (len(a) - 1) + qb**2 / (len(b) - 1))
    return Welch(ma - mb, se, df)


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    m = math.fsum(xs) / len(xs)
    return m, math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betai(df / 2, 0.5, df / (df + t * t))
    return tail if t >= 0 else 1.0 - tail


def _betai(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (Numerical Recipes, 6.4)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    """Its continued fraction, by the modified Lentz method."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h
