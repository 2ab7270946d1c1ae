#!/usr/bin/env python3
"""Computes GELU_ERFC_SERIES in crates/stagecraft-ops/src/scalar.rs.

gelu_with_derivative_to_narrow writes erfc(z) = t * Q(t) * exp(-z^2) with
t = 2/(2 + z), z = 2/t - 2, and needs Q(t) = erfc(z) * exp(z^2) / t on t in
[1/7, 1] (z <= 12), where Q falls smoothly from 1 to about 0.28. Keeping
exp(-z^2) apart lets GELU's derivative reuse it (it is the Gaussian density
up to a constant). Q is interpolated at Chebyshev nodes in 60-digit arithmetic, as a
Chebyshev series in u = (7t - 4)/3 (u in [-1, 1]), which is then rewritten
in powers of u, the form Estrin's scheme evaluates. Prints the Rust array
and the largest error of the truncated series on a fine grid.

Needs mpmath (pip install mpmath). Usage: python3 scripts/gelu_erfc_series.py
"""
import mpmath as mp

mp.mp.dps = 60
T_LOW = mp.mpf(1) / 7
DEGREE = 19
NODES = 160


def q_of_t(t):
    z = 2 / t - 2
    return mp.erfc(z) * mp.exp(z * z) / t


def t_of_u(u):
    return (u * (1 - T_LOW) + (1 + T_LOW)) / 2


def chebyshev_coefficients():
    angles = [mp.pi * (k + mp.mpf(1) / 2) / NODES for k in range(NODES)]
    values = [q_of_t(t_of_u(mp.cos(a))) for a in angles]
    coefficients = [
        2 * mp.fsum(v * mp.cos(j * a) for v, a in zip(values, angles)) / NODES
        for j in range(DEGREE + 1)
    ]
    coefficients[0] /= 2
    return coefficients


def to_powers(chebyshev):
    """Sum of c_j T_j(u) as sum of a_k u^k (T_j by its recurrence)."""
    powers = [mp.mpf(0)] * (DEGREE + 1)
    previous, current = [mp.mpf(1)], [mp.mpf(0), mp.mpf(1)]
    for j, c in enumerate(chebyshev):
        t_j = previous if j == 0 else current
        for k, a in enumerate(t_j):
            powers[k] += c * a
        if j >= 1:
            following = [mp.mpf(0)] + [2 * a for a in current]
            for k, a in enumerate(previous):
                following[k] -= a
            previous, current = current, following
    return powers


def main():
    powers = to_powers(chebyshev_coefficients())
    worst = max(
        abs(mp.polyval(powers[::-1], u) - q_of_t(t_of_u(u)))
        for u in (mp.mpf(-1) + mp.mpf(2) * i / 2000 for i in range(2001))
    )
    print(f"// max |error| on [-1, 1]: {mp.nstr(worst, 3)}; "
          f"sum |a_k| = {mp.nstr(mp.fsum(abs(a) for a in powers), 3)}")
    print(f"const GELU_ERFC_SERIES: [f64; {DEGREE + 1}] = [")
    for a in powers:
        print(f"    {float(a)!r},")
    print("];")


if __name__ == "__main__":
    main()
