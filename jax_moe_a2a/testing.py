"""Error measures for comparing a result with its reference (tests, benchmarks, the demo and the notebook)."""

from __future__ import annotations

import numpy as np


def calc_diff(a, b) -> float:
  """``1 - 2 sum(a b) / sum(a^2 + b^2)`` in float64: 0 for equal tensors (and for two all-zero ones), DeepGEMM's
  error measure; about 6.5e-4 for E4M3 rounding alone."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  denom = float(np.sum(a * a + b * b))
  return 0.0 if denom == 0.0 else 1.0 - 2.0 * float(np.sum(a * b)) / denom


def max_rel(a, b) -> float:
  """``max |a - b| / max |b|`` in float64 (the absolute difference when b is all zero)."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  scale = float(np.max(np.abs(b))) if b.size else 0.0
  diff = float(np.max(np.abs(a - b), initial=0.0))
  return diff / scale if scale else diff
