"""Requests for the simulator: a Mooncake-trace reader, arrival transforms, fast tokens.

The workload loaders of :mod:`evals.workloads` yield :class:`~evals.workloads.base.Request`
objects; the simulator takes any sequence of them. This module adds what the ``tokenlake
sim`` command needs on its own: reading a trace in the Mooncake FAST'25 format (one JSON
object per line: ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids`` of
512-token blocks), arranging it in time with the workloads' arrival functions (Poisson
arrivals at a rate, or a speed-up; repeated back to back), and building prompt token
arrays quickly.

:func:`prompt_array` gives exactly the tokens of :meth:`Request.tokens` (block ``h``,
position ``i`` -> ``(h * block_size + i) % 2**31``) as an ``array('i')``, built with numpy
instead of one Python int at a time (the control plane hashes ``array('i')`` directly).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from evals.workloads.arrivals import retime, with_poisson_arrivals
from evals.workloads.base import Request
from evals.workloads.mooncake import load_mooncake, repeat_trace

_MOD = 2**31


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Requests of a Mooncake-format JSONL trace, in file order (ids ``r-0, r-1, ...``):
    :func:`evals.workloads.mooncake.load_mooncake`, which validates every record and
    raises ``ValueError`` naming the line of a malformed one.
    """

    return list(load_mooncake(path, n=limit, name="r").items)


def arrange(requests: Sequence[Request], rate: float | None = None,
            speedup: float | None = None, times: int = 1, seed: int = 0) -> list[Request]:
    """A trace's requests as ``tokenlake sim`` and the speed benchmark replay them.

    ``rate``: a seeded Poisson process at ``rate`` req/s, in the trace's order
    (:func:`~evals.workloads.arrivals.with_poisson_arrivals` without shuffling);
    ``speedup``: the trace's own times divided by it
    (:func:`~evals.workloads.arrivals.retime`); neither keeps the times, both is an
    error. ``times`` > 1 then replays the result back to back, each copy one mean gap
    after the previous and keeping the block ids, so later copies re-ask what earlier
    ones cached (:func:`~evals.workloads.mooncake.repeat_trace` with
    ``remap_blocks=False``).
    """

    if rate is not None and speedup is not None:
        raise ValueError("give a rate or a speedup, not both")
    if not isinstance(times, int) or times < 1:
        raise ValueError(f"repeat must be a positive int, got {times!r}")
    out = list(requests)
    if rate is not None:
        out = with_poisson_arrivals(out, rate, seed=seed, shuffle=False)
    elif speedup is not None:
        out = retime(out, speedup)
    if times > 1 and out:
        out = repeat_trace(out, times, remap_blocks=False)
    return out


def prompt_array(req: Request) -> array:
    """The prompt's token ids as ``array('i')`` (equal to ``req.tokens()``)."""
    if req.token_ids is not None:
        return array("i", req.token_ids)
    bs = req.block_size
    blocks = np.asarray(req.block_hashes, dtype=np.int64) * bs
    toks = (blocks[:, None] + np.arange(bs, dtype=np.int64)[None, :]).reshape(-1)
    toks = (toks[: req.input_length] % _MOD).astype("<i4")
    out = array("i")
    out.frombytes(toks.tobytes())
    return out


def decode_tokens(index: int, start: int, count: int) -> array:
    """Stand-in output tokens ``start .. start+count-1`` of the ``index``-th request.

    Distinct per request, so no two requests ever share a segment of generated tokens.
    (Real outputs are not in the traces; see docs/simulator.md.)
    """
    base = (1 << 30) + (index * 4096) % (1 << 30)
    if base + start + count < _MOD:
        return array("i", range(base + start, base + start + count))
    return array("i", [(base + j) % _MOD for j in range(start, start + count)])


#: Speedups of a trace's own arrival times that ``e2e --trace`` tries without ``--rates``.
TRACE_SPEEDUPS = (1, 2, 4, 8, 16)


def trace_grid(trace: str, rates: Sequence[float] | None,
               seed: int) -> tuple[str, list[tuple[float, list[Request]]]]:
    """``(label, [(rate, requests), ...])`` of a Mooncake-format trace for ``e2e``."""
    reqs = load_trace(trace)
    label = f"trace:{trace.rsplit('/', 1)[-1]}"
    if rates:
        return label, [(rate, arrange(reqs, rate, None, 1, seed)) for rate in rates]
    span = max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs)
    if not span > 0:
        raise ValueError(f"{trace}: every request arrives at once; give --rates")
    return label, [(round(len(reqs) * f / span, 3), arrange(reqs, None, f, 1, seed))
                   for f in TRACE_SPEEDUPS]
