"""Arrival processes: seeded Poisson arrivals and re-timing of existing requests.

A Poisson process at ``rate`` requests per second has independent exponential gaps of
mean ``1 / rate``. :func:`with_poisson_arrivals` puts any list of requests on such a
process while keeping every multi-turn session in order (turn k+1 strictly after turn
k); :func:`retime` and :func:`scale_rate` compress or stretch a trace's own timestamps.
All functions return new lists sorted by arrival; requests are immutable and are
copied with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace

from evals.workloads.base import Request


def _check_rate(rate: float, what: str = "rate") -> float:
    rate = float(rate)
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"{what} must be a positive finite number, got {rate!r}")
    return rate


def poisson_arrivals(n: int, rate: float, seed: int = 0, start: float = 0.0) -> list[float]:
    """``n`` arrival times (seconds) of a Poisson process at ``rate`` req/s.

    The first arrival is one exponential gap after ``start``; times are strictly
    increasing and depend only on ``(n, rate, seed, start)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rate = _check_rate(rate)
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    rng = random.Random(seed)
    times: list[float] = []
    t = float(start)
    for _ in range(n):
        nxt = t + rng.expovariate(rate)
        t = nxt if nxt > t else math.nextafter(t, math.inf)  # a zero gap is possible
        times.append(t)
    return times


def _session_ordered(requests: Sequence[Request]) -> list[Request]:
    """The same slots, but each session's requests moved so its turns appear in
    increasing turn order (other requests keep their positions)."""
    slots: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(requests):
        if r.session_id is not None:
            slots[r.session_id].append(i)
    out = list(requests)
    for sid, positions in slots.items():
        turns = sorted((requests[i] for i in positions), key=lambda r: r.turn)
        for a, b in zip(turns, turns[1:]):
            if a.turn == b.turn:
                raise ValueError(f"session {sid!r} has turn {a.turn} twice "
                                 f"({a.request_id!r}, {b.request_id!r})")
        for i, r in zip(positions, turns):
            out[i] = r
    return out


def with_poisson_arrivals(requests: Iterable[Request], rate: float, seed: int = 0,
                          shuffle: bool = True, start: float = 0.0) -> list[Request]:
    """The requests re-timed onto a Poisson process at ``rate`` req/s.

    With ``shuffle`` (the default) the order of the requests is first permuted with a
    generator seeded by ``seed``, so sessions and documents interleave over the whole
    run; without it the given order is kept. Either way the k-th arrival time goes to
    the k-th request after each session's turns were put back in turn order, so turn
    k+1 of a session always arrives strictly after turn k.
    """
    reqs = list(requests)
    if shuffle:
        random.Random(f"tokenlake-shuffle-{seed}").shuffle(reqs)
    reqs = _session_ordered(reqs)
    times = poisson_arrivals(len(reqs), rate, seed, start)
    return [replace(r, arrival_s=t) for r, t in zip(reqs, times)]


def with_session_arrivals(requests: Iterable[Request], rate: float, seed: int = 0,
                          turn_gap_s: float = 1.0, start: float = 0.0) -> list[Request]:
    """The requests re-timed so that *sessions* start on a Poisson process.

    A request without a ``session_id`` is a session of its own. Sessions start in an
    order shuffled with ``seed``, at ``rate * sessions / requests`` sessions/s, so the
    mean request rate over the run is ``rate`` req/s; turn ``k`` of a session (in turn
    order) arrives ``k * turn_gap_s`` seconds after the session starts. A simulator with
    closed-loop sessions (``SimConfig.closed_sessions``) sends a turn only after the
    previous one finished, so turns follow each other as a chat user's do. Contrast
    :func:`with_poisson_arrivals`, which spreads a session's turns over the whole run.
    Returned in arrival order.
    """
    rate = _check_rate(rate)
    if not turn_gap_s > 0:
        raise ValueError(f"turn_gap_s must be > 0, got {turn_gap_s!r}")
    sessions: dict[str, list[Request]] = {}
    for r in requests:
        sid = r.session_id if r.session_id is not None else f"\0{r.request_id}"
        sessions.setdefault(sid, []).append(r)
    if not sessions:
        return []
    order = list(sessions)
    random.Random(f"tokenlake-sessions-{seed}").shuffle(order)
    n_req = sum(len(v) for v in sessions.values())
    starts = poisson_arrivals(len(order), rate * len(order) / n_req, seed, start)
    out = []
    for sid, t0 in zip(order, starts):
        turns = sorted(sessions[sid], key=lambda r: r.turn)
        for a, b in zip(turns, turns[1:]):
            if a.turn == b.turn:
                raise ValueError(f"session {sid!r} has turn {a.turn} twice "
                                 f"({a.request_id!r}, {b.request_id!r})")
        out += [replace(r, arrival_s=t0 + k * turn_gap_s) for k, r in enumerate(turns)]
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out


def retime(requests: Iterable[Request], speedup: float) -> list[Request]:
    """The requests with every arrival time divided by ``speedup`` (2.0 replays a trace
    twice as fast, 0.5 half as fast); order and sessions are unchanged."""
    speedup = _check_rate(speedup, "speedup")
    out = [replace(r, arrival_s=r.arrival_s / speedup) for r in requests]
    out.sort(key=lambda r: r.arrival_s)
    return out


def mean_rate(requests: Sequence[Request]) -> float:
    """Mean arrival rate (req/s) of a sorted request list: ``(n - 1) / span``; ``inf``
    when all requests arrive at once."""
    if len(requests) < 2:
        raise ValueError("the mean rate needs at least two requests")
    span = requests[-1].arrival_s - requests[0].arrival_s
    return math.inf if span <= 0 else (len(requests) - 1) / span


def scale_rate(requests: Sequence[Request], rate: float) -> list[Request]:
    """The requests re-timed (by :func:`retime`) so their mean rate becomes ``rate``;
    the trace's own burstiness is kept, only the time axis is scaled."""
    rate = _check_rate(rate)
    current = mean_rate(requests)
    if math.isinf(current):
        raise ValueError("all requests arrive at the same time: no rate to scale")
    return retime(requests, rate / current)
