"""Iteration time under the pool's cache load (paper §6.1-§6.2).

The pool itself uses a share ``L`` of every instance (queries of remote segments, puts
of new KV; :func:`tokenlake.core.cost_model.get_cache_load`), so a batch's compute gets only
``1 - L`` of its instances and runs ``1/(1 - L)`` times slower than the latency model
predicts. ``L`` is clamped to ``[0, 0.95]`` so a saturated pool slows work by at most 20x
rather than dividing by zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake.core.cost_model import LatencyModel

MAX_LOAD = 0.95
SLO_RTOL = 1 + 1e-9  # a batch meets an SLO it equals up to rounding


def slowdown(cache_load: float) -> float:
    """``1 / (1 - L)`` with ``L`` clamped to ``[0, MAX_LOAD]``."""
    load = min(max(float(cache_load), 0.0), MAX_LOAD)
    return 1.0 / (1.0 - load)


def iteration_time(latency: LatencyModel, requests: Sequence[tuple[int, int]], k: int,
                   cache_load: float) -> float:
    """Seconds one iteration of ``requests`` ((new, prefix) pairs) takes on ``k`` instances."""
    return latency.predict(requests, k) * slowdown(cache_load)


def work_terms(latency: LatencyModel, new: np.ndarray, prefix: np.ndarray) -> np.ndarray:
    """Per request, the part of the iteration time that divides by the DoP (seconds)."""
    new = np.asarray(new, dtype=np.float64)
    prefix = np.asarray(prefix, dtype=np.float64)
    return (latency.c_new * new + latency.c_new_prefix * new * prefix
            + latency.c_new_sq * new * new + latency.c_prefix * prefix)


def batch_times(latency: LatencyModel, work_prefix: np.ndarray, dops: Sequence[int],
                cache_load: float) -> np.ndarray:
    """Times of every contiguous batch ``requests[j:i]`` on every DoP, in one tensor.

    ``work_prefix`` is the prefix sum (length M+1, leading 0) of :func:`work_terms` in the
    DP's order. Returns ``times[i, m, j]`` of shape ``(M+1, len(dops), M+1)``: the
    :func:`iteration_time` of ``requests[j:i]`` on ``dops[m]`` instances for ``j < i``
    (entries with ``j >= i`` are meaningless).
    """
    wp = np.asarray(work_prefix, dtype=np.float64)
    scale = slowdown(cache_load)
    idx = np.arange(len(wp))
    count = (idx[:, None] - idx[None, :]).astype(np.float64)  # [i, j] = i - j
    diff = (wp[:, None] - wp[None, :]) * scale  # [i, j]: the work that divides by the DoP
    fixed = (latency.c_const + latency.c_request * count) * scale
    inv_dops = 1.0 / np.asarray([latency.speedup(d) for d in dops], dtype=np.float64)
    times = diff[:, None, :] * inv_dops[None, :, None]
    times += fixed[:, None, :]
    return times
