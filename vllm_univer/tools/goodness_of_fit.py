"""Pearson's chi-square goodness-of-fit test, as every statistical check here uses it."""

from __future__ import annotations

import math

import numpy as np


def chi_square_pvalue(counts, expected_probs, min_expected: float = 5.0) -> float:
    """p-value of ``counts`` (flat, any array-like) against ``expected_probs``:
    0 if an outcome of probability 0 was observed; otherwise cells whose expected
    count is below ``min_expected`` are pooled into one. scipy's chi-square tail
    where scipy is installed, else the Wilson-Hilferty approximation."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    if counts[probs == 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs * counts.sum()
    small = expected < min_expected
    obs, exp = list(counts[~small]), list(expected[~small])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.array(obs), np.array(exp)
    if len(obs) < 2:
        return 1.0
    exp *= obs.sum() / exp.sum()
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
    try:
        from scipy.stats import chi2
    except ImportError:
        z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
        return 0.5 * math.erfc(z / math.sqrt(2))
    return float(chi2.sf(stat, dof))
