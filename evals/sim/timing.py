"""Modelled time: iteration schedules of a run, communication, batch-size-1 SLO bases.

A *run* is a batch that repeats iterations without a new decision (see
:mod:`evals.sim.backend`). Its iteration times are known in advance, so the time of
every token is exact without an event per iteration:

* :class:`DecodeSchedule` -- decode: every request gains one token per step, so the
  summed context grows linearly and step ``j`` (1-based) lasts ``a + b (j-1)``; the end
  of step ``j`` is ``t0 + j a + b j (j-1) / 2`` (closed form, no loop).
* :class:`ChunkSchedule` -- chunked prefill: one explicit duration per chunk.

Iteration times come from the fitted :class:`~tokenlake.core.cost_model.LatencyModel` (the
same one the scheduler plans with) on ``k`` instances, times the pool's slowdown
``1/(1-L)`` (paper §6.1, :mod:`scheduler.latency`), plus, for TokenLake, the time to
ship query rows and new KV to remote instances (:func:`pool_comm_s`).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Sequence

from tokenlake.core.cost_model import LatencyModel, comm_bytes_per_query_layer
from tokenlake.core.specs import HardwareProfile, ModelSpec


class DecodeSchedule:
    """``k_max`` decode steps from ``t0``; step ``j`` (1-based) lasts ``a + b (j-1)`` s."""

    __slots__ = ("t0", "a", "b", "k_max")

    def __init__(self, t0: float, a: float, b: float, k_max: int) -> None:
        self.t0, self.a, self.b, self.k_max = t0, a, b, k_max

    def end(self, j: int) -> float:
        return self.t0 + j * self.a + self.b * j * (j - 1) / 2

    def duration(self, j: int) -> float:
        return self.a + self.b * (j - 1)

    def end_if_before(self, j: int, t: float) -> float | None:
        end = self.end(j)
        return end if end < t else None

    def steps_done_by(self, t: float) -> int:
        """How many steps have ended at time ``t`` (0 .. k_max)."""
        x = t - self.t0
        if x <= 0:
            return 0
        if self.b > 0:
            half = self.b / 2
            lin = self.a - half
            j = int((-lin + math.sqrt(lin * lin + 4 * half * x)) / (2 * half))
        else:
            j = int(x / self.a)
        j = max(0, min(j, self.k_max))
        while j < self.k_max and self.end(j + 1) <= t:
            j += 1
        while j > 0 and self.end(j) > t:
            j -= 1
        return j

    def first_end_at_or_after(self, t: float) -> int:
        """The first step (1 .. k_max) that ends at or after ``t``."""
        j = self.steps_done_by(t)
        if j >= 1 and self.end(j) == t:
            return j
        return min(j + 1, self.k_max)


class ChunkSchedule:
    """Explicit steps from ``t0``: step ``j`` lasts ``durations[j-1]``.

    Give the durations, or ``duration(j)`` and ``k_max``: then they are computed only
    as far as a question needs (a run is often stopped long before its last chunk).
    """

    __slots__ = ("t0", "durations", "ends", "k_max", "_fn")

    def __init__(self, t0: float, durations: Sequence[float] = (), fn=None, k_max: int = 0) -> None:
        self.t0, self.durations, self.ends, self._fn = t0, [], [], fn
        self.k_max = k_max if fn is not None else len(durations)
        t = t0
        for d in durations:
            t += d
            self.durations.append(d)
            self.ends.append(t)

    def _extend(self, j: int) -> None:
        ends, fn = self.ends, self._fn
        t = ends[-1] if ends else self.t0
        while len(ends) < min(j, self.k_max):
            d = fn(len(ends) + 1)
            t += d
            self.durations.append(d)
            ends.append(t)

    def _extend_past(self, t: float) -> None:
        while len(self.ends) < self.k_max and (not self.ends or self.ends[-1] < t):
            self._extend(len(self.ends) + 1)

    def end(self, j: int) -> float:
        if j > len(self.ends):
            self._extend(j)
        return self.ends[j - 1] if j else self.t0

    def end_if_before(self, j: int, t: float) -> float | None:
        """``end(j)`` if it is before ``t``, else None (computing no further than ``t``)."""
        self._extend_past(t)
        return self.end(j) if j <= len(self.ends) and self.ends[j - 1] < t else None

    def duration(self, j: int) -> float:
        self._extend(j)
        return self.durations[j - 1]

    def steps_done_by(self, t: float) -> int:
        self._extend_past(t)
        return bisect.bisect_right(self.ends, t)

    def first_end_at_or_after(self, t: float) -> int:
        self._extend_past(t)
        return min(bisect.bisect_left(self.ends, t) + 1, self.k_max)


def decode_coefficients(lat: LatencyModel, contexts: Sequence[int], k: int,
                        slow: float, comm_s: float) -> tuple[float, float]:
    """``(a, b)`` of a :class:`DecodeSchedule` for requests with these prefix lengths
    at the first step, on ``k`` instances, slowed by ``slow``, plus ``comm_s`` per step."""
    n, ctx, s = len(contexts), sum(contexts), lat.speedup(k)
    per_token = lat.c_new_prefix + lat.c_prefix
    a = slow * (lat.c_const + lat.c_request * n
                + ((lat.c_new + lat.c_new_sq) * n + per_token * ctx) / s) + comm_s
    return a, slow * per_token * n / s


def iteration_s(lat: LatencyModel, items: Sequence[tuple[int, int]], k: int, slow: float) -> float:
    """One iteration of ``(new, prefix)`` items on ``k`` instances (the DP's model)."""
    new = new_prefix = new_sq = prefix = 0.0
    for n, p in items:
        new += n
        new_prefix += n * p
        new_sq += n * n
        prefix += p
    return slow * (lat.c_const + lat.c_request * len(items)
                   + (lat.c_new * new + lat.c_new_prefix * new_prefix + lat.c_new_sq * new_sq
                      + lat.c_prefix * prefix) / lat.speedup(k))


@functools.lru_cache(maxsize=65536)
def expected_remote(n_instances: int, segments: int) -> float:
    """Expected instances other than the home that hold some of ``segments`` segments
    placed uniformly at random (hash placement), counting the open tail as one more."""
    if n_instances <= 1 or segments <= 0:
        return 0.0
    held = n_instances * (1.0 - (1.0 - 1.0 / n_instances) ** (segments + 1))
    return held * (n_instances - 1) / n_instances


def pool_comm_s(model: ModelSpec, hw: HardwareProfile, n_instances: int,
                items: Sequence[tuple[int, int]], dop: int, segment_tokens: int) -> float:
    """Seconds one TokenLake iteration spends shipping data to remote instances.

    Per layer: ``2 * alpha_net`` (a round trip) plus the bytes of every new token's query
    row and partial result to each remote holder of its context (the paper's ``4d`` per
    row, :func:`~tokenlake.core.cost_model.comm_bytes_per_query_layer`) and of its new KV to
    a remote home (``(N-1)/N`` of the rows under hash placement), over ``B_net``; the
    ``dop`` sub-batches send in parallel. Not overlapped with compute (conservative).
    """
    if n_instances <= 1:
        return 0.0
    q_bytes = comm_bytes_per_query_layer(model)
    kv_bytes = model.kv_bytes_per_token_layer * (n_instances - 1) / n_instances
    total = 0.0
    for new, prefix in items:
        remote = expected_remote(n_instances, prefix // segment_tokens)
        total += new * (remote * q_bytes + kv_bytes)
    if total <= 0:
        return 0.0
    return model.num_layers * (2 * hw.net_latency_s + total / (dop * hw.net_bw))


def prefill_bs1_s(lat: LatencyModel, input_len: int, chunk: int) -> float:
    """Prefill of one request alone on one instance, no cache hit, chunked by ``chunk``
    (the "processing time when the batch size is 1" of paper §7, input side)."""
    total, done = 0.0, 0
    while done < input_len:
        n = min(chunk, input_len - done)
        total += (lat.c_const + lat.c_request + lat.c_new * n + lat.c_new_prefix * n * done
                  + lat.c_new_sq * n * n + lat.c_prefix * done)
        done += n
    return total


def decode_bs1_s(lat: LatencyModel, context: int) -> float:
    """One decode step of one request alone over ``context`` tokens (output side)."""
    return (lat.c_const + lat.c_request + lat.c_new + lat.c_new_sq
            + (lat.c_new_prefix + lat.c_prefix) * context)
