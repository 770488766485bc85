"""Exact rational least squares (Python integers / fractions.Fraction) and the condition
numerator K of docs/accuracy.md: the yardstick of the accuracy tests (tests/test_accuracy_*.py,
tests/test_multivariate.py) and of benchmarks/experiments/accuracy_margin.py. No floating point
until the end; slow (pure Python, O(N) big-integer operations per prompt), so for checking, never
for benchmarking.

Every finite float is an integer times a power of two, so a prompt's x (and y) become integers
X_i = x_i * D_x over one common power-of-two denominator D_x; then, exactly,

    N^2 D_x^2 Sxx / N = N sum X^2 - (sum X)^2,     b_hat = (N sum XY - sum X sum Y) D_x / ((N sum X^2 - (sum X)^2) D_y).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np


def _ints(values) -> tuple[list[int], int]:
    """Finite floats -> (integers, D) with value_i = integer_i / D, D a power of two."""
    ratios = [float(v).as_integer_ratio() for v in values]
    D = max(d for _, d in ratios)
    return [n * (D // d) for n, d in ratios], D


def _f(q) -> float:
    """float(q) for a rational, +-inf where it is beyond float64 (float() raises OverflowError)."""
    try:
        return float(q)
    except OverflowError:
        return math.inf if q > 0 else -math.inf


@dataclass
class Exact:
    """The exact OLS of one prompt: prediction y_hat (Fraction), slope b, y_scale = max|y|
    (Fraction, 1 if y = 0) and k = K / y_scale (float), the condition numerator in units of
    y_scale: a solver with error bound c u K satisfies err(pred) <= c u k."""

    y_hat: Fraction
    b: Fraction
    k: float
    y_scale: Fraction

    @property
    def kappa(self) -> float:
        """K / |y_hat|: the relative condition number (inf where y_hat = 0)."""
        if self.y_hat == 0 or not math.isfinite(self.k):
            return math.inf
        return _f(Fraction(self.k) * self.y_scale / abs(self.y_hat))

    def err(self, pred: float) -> float:
        """|pred - y_hat| / y_scale, exactly computed then rounded (inf for a non-finite pred)."""
        if not math.isfinite(pred):
            return math.inf
        return _f(abs(Fraction(pred) - self.y_hat) / self.y_scale)


def exact_ols(x, y, u) -> Exact | None:
    """Exact OLS of the given floats (sequences of N >= 2 finite floats, finite u); None when all
    x are equal (exactly degenerate). K = max|x| sum_i |d y_hat / d x_i| + max|y| sum_i |d y_hat /
    d y_i| + |u| |d y_hat / d u| (normwise first-order sensitivity, docs/accuracy.md); k = inf
    where a sensitivity is beyond float64 (tiny data, a far query)."""
    X, dx = _ints(x)
    Y, dy = _ints(y)
    N = len(X)
    SX, SY = sum(X), sum(Y)
    nsxx = N * sum(a * a for a in X) - SX * SX  # = N dx^2 Sxx
    if nsxx == 0:
        return None
    nsxy = N * sum(a * b for a, b in zip(X, Y)) - SX * SY
    b = Fraction(nsxy * dx, nsxx * dy)
    U = Fraction(u)
    delta = U - Fraction(SX, N * dx)  # u - x_bar
    y_hat = Fraction(SY, N * dy) + b * delta
    Sxx = Fraction(nsxx, N * dx * dx)
    mx, my = max(abs(Fraction(v)) for v in x), max(abs(Fraction(v)) for v in y)
    ys = my if my > 0 else Fraction(1)
    # centred values, normalised to [-1, 1] (exact integers, one rounding each)
    cx = [N * a - SX for a in X]
    cy = [N * a - SY for a in Y]
    Mx, My = max(abs(v) for v in cx), max(abs(v) for v in cy) or 1
    xi = np.array([v / Mx for v in cx])  # (x_i - x_bar) / max|x - x_bar|
    eta = np.array([v / My for v in cy])
    C2 = _f(delta * Fraction(Mx, N * dx) / Sxx)  # (u - x_bar)(x_i - x_bar)/Sxx = C2 xi_i
    P = _f(mx * delta * Fraction(My, N * dy) / (Sxx * ys))  # mx (u - x_bar)(y_i - y_bar)/(Sxx ys)
    Q = _f(2 * mx * b * delta * Fraction(Mx, N * dx) / (Sxx * ys))
    bN = _f(mx * b / (N * ys))
    with np.errstate(over="ignore", invalid="ignore"):  # a sensitivity beyond float64: K = inf
        dxi = np.abs(P * eta - Q * xi - bN).sum()  # mx sum |d y_hat/d x_i| / ys
        dyi = _f(my / ys) * np.abs(1.0 / N + C2 * xi).sum()  # my sum |w_i| / ys
    du = _f(abs(U * b) / ys)
    with np.errstate(over="ignore", invalid="ignore"):
        k = float(dxi + dyi + du)
    return Exact(y_hat=y_hat, b=b, k=k if math.isfinite(k) else math.inf, y_scale=ys)


def exact_prediction_mv(x, y, u) -> Fraction | None:
    """Exact OLS prediction with an intercept and d regressors: solve (A^T A) theta = A^T y, A = [1, x],
    by Gauss-Jordan in rationals, then theta . (1, u). x (N, d), y (N,), u (d,) finite floats (numpy
    arrays or nested sequences, converted exactly). None if A^T A is singular (no unique fit).
    O(N d^2) big-rational operations: for checking a few small prompts."""
    A = [[Fraction(1)] + [Fraction(float(v)) for v in row] for row in x]
    yy = [Fraction(float(v)) for v in y]
    N, p = len(A), len(A[0])
    M = [[sum(A[i][r] * A[i][c] for i in range(N)) for c in range(p)] + [sum(A[i][r] * yy[i] for i in range(N))]
         for r in range(p)]
    for col in range(p):
        piv = next((r for r in range(col, p) if M[r][col] != 0), None)
        if piv is None:
            return None
        M[col], M[piv] = M[piv], M[col]
        for r in range(p):
            if r != col and M[r][col] != 0:
                f = M[r][col] / M[col][col]
                M[r] = [a - f * b for a, b in zip(M[r], M[col])]
    theta = [M[r][p] / M[r][r] for r in range(p)]
    return theta[0] + sum(t * Fraction(float(v)) for t, v in zip(theta[1:], u))
