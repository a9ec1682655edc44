"""Real traces in the Mooncake FAST'25 format, and what can be done with them.

One JSON object per line::

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, ...]}

``timestamp`` is the arrival in milliseconds, ``hash_ids`` the ids of the prompt's
512-token prefix blocks (the last one may be partial): equal ids mean the same
reusable prefix block. No tokens are published, so requests carry ``block_hashes``
and :meth:`Request.tokens` makes stand-in tokens from them.

:func:`repeat_trace` makes a longer trace from copies shifted in time;
:func:`prefix_reuse` counts the input tokens an unbounded prefix cache would serve.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

from evals.workloads.arrivals import retime
from evals.workloads.base import Request, RequestList, jsonl_objects


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_mooncake(path: Path | str, *, n: int | None = None, speedup: float = 1.0,
                  block_size: int = 512, name: str = "mooncake") -> RequestList:
    """The requests of a Mooncake-format trace, arriving at the trace's timestamps.

    ``n`` keeps the first ``n`` lines (None: all); ``speedup`` divides every arrival
    time (see :func:`evals.workloads.arrivals.retime`). Raises ValueError naming
    ``file:line`` on a malformed line, on a ``hash_ids`` list whose length is not
    ``ceil(input_length / block_size)``, or on timestamps that go backwards.
    """
    path = Path(path)
    requests: list[Request] = []
    prev_ts = -math.inf
    for where, _lineno, obj in jsonl_objects(path) if n is None or n > 0 else ():
        missing = {"timestamp", "input_length", "output_length", "hash_ids"} - set(obj)
        if missing:
            raise ValueError(f"{where}: missing {sorted(missing)}")
        ts, inp, out, ids = (obj["timestamp"], obj["input_length"], obj["output_length"],
                             obj["hash_ids"])
        if not isinstance(ts, (int, float)) or isinstance(ts, bool) \
                or not math.isfinite(ts) or ts < 0:
            raise ValueError(f"{where}: timestamp must be a number >= 0, got {ts!r}")
        if ts < prev_ts:
            raise ValueError(f"{where}: timestamp {ts} is before the previous one "
                             f"({prev_ts}): the trace must be sorted by time")
        prev_ts = ts
        if not _is_int(inp) or inp < 1 or not _is_int(out) or out < 1:
            raise ValueError(f"{where}: input_length and output_length must be integers "
                             f">= 1, got {inp!r}, {out!r}")
        if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
            raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
        if len(ids) != -(-inp // block_size):
            raise ValueError(f"{where}: {len(ids)} hash_ids for {inp} input tokens, "
                             f"want {-(-inp // block_size)} blocks of {block_size}")
        requests.append(Request(f"{name}-{len(requests)}", ts / 1000.0, inp, out,
                                block_hashes=tuple(ids), block_size=block_size))
        if n is not None and len(requests) >= n:
            break  # lines after the n-th are not read
    if not requests:
        raise ValueError(f"{path}: no requests")
    if speedup != 1.0:
        requests = retime(requests, speedup)
    return RequestList(name, requests)


def _block_keys(r: Request, block_size: int) -> list[object]:
    """Keys of a request's prefix blocks: its block ids, or for token requests a chain
    of hashes over blocks of ``block_size`` tokens (equal key = equal whole prefix)."""
    if r.block_hashes is not None:
        return list(r.block_hashes)
    keys: list[object] = []
    key: object = None
    toks = r.token_ids
    for start in range(0, len(toks), block_size):
        key = hash((key, toks[start:start + block_size]))
        keys.append(key)
    return keys


def prefix_reuse(requests: Iterable[Request], block_size: int | None = None,
                 page: int | None = None) -> tuple[int, int]:
    """(reusable tokens, input tokens) with an unbounded prefix cache.

    Requests are taken in the given order; each one's hits are its leading blocks
    already seen (the first unseen block ends the prefix match), counted as
    ``min(hit_blocks * block_size, input_length)`` tokens; then all its blocks are
    cached. ``block_size`` defaults to each request's own (token requests: 512).
    Trace block ids and token blocks are different key spaces. With ``page``, what a
    cache that hits whole pages and computes at least the last prompt token can serve:
    ``min(hit_blocks * block_size, input_length - 1)`` rounded down to a page.
    """
    seen: set[object] = set()
    hit = total = 0
    for r in requests:
        bs = block_size or r.block_size
        keys = _block_keys(r, bs)
        h = 0
        for k in keys:
            if k not in seen:
                break
            h += 1
        hit += (min(h * bs, r.input_length - 1) // page * page if page
                else min(h * bs, r.input_length))
        total += r.input_length
        seen.update(keys)
    return hit, total


def repeat_trace(requests: Sequence[Request], times: int, *, remap_blocks: bool = True,
                 gap_s: float | None = None, n: int | None = None) -> list[Request]:
    """A longer trace: ``times`` copies of ``requests`` one after the other in time.

    Copy c is shifted by ``c * (span + gap_s)`` where ``span`` is the trace's length in
    time and ``gap_s`` defaults to its mean inter-arrival time; its request (and
    session) ids get the suffix ``-r{c}`` (copy 0 keeps the originals). ``n`` cuts the
    result to its first ``n`` requests (e.g. 12,000 from 3 x 3,993 + ...).

    Reuse: with ``remap_blocks`` (the default) copy c's block ids are offset by
    ``c * (max id + 1)``, so copies share nothing and every copy keeps the original's
    own reuse (about 65% of input tokens for the Mooncake synthetic trace). With
    ``remap_blocks=False`` the ids are kept, so every later copy re-asks prefixes
    the first copy already cached: with an unbounded cache they are (almost) all
    hits and the overall reuse rises toward 100% -- a test of capacity and eviction
    rather than a longer version of the same workload. Remapping needs block-id
    requests (token requests raise ValueError).
    """
    reqs = list(requests)
    if times < 1:
        raise ValueError(f"times must be >= 1, got {times}")
    if not reqs:
        raise ValueError("no requests to repeat")
    if remap_blocks and any(r.block_hashes is None for r in reqs):
        raise ValueError("remap_blocks needs requests with block_hashes (a trace); "
                         "use remap_blocks=False for token requests")
    first, last = reqs[0].arrival_s, reqs[-1].arrival_s
    span = last - first
    if gap_s is None:
        gap_s = span / (len(reqs) - 1) if len(reqs) > 1 and span > 0 else 1.0
    if gap_s < 0:
        raise ValueError(f"gap_s must be >= 0, got {gap_s}")
    period = span + gap_s
    stride = 1 + max((h for r in reqs for h in (r.block_hashes or ())), default=-1)
    out: list[Request] = []
    for c in range(times):
        for r in reqs:
            if n is not None and len(out) >= n:
                return out
            if c == 0:
                out.append(r)
                continue
            changes: dict = {"request_id": f"{r.request_id}-r{c}",
                             "arrival_s": r.arrival_s + c * period}
            if r.session_id is not None:
                changes["session_id"] = f"{r.session_id}-r{c}"
            if remap_blocks:
                changes["block_hashes"] = tuple(h + c * stride for h in r.block_hashes)
            out.append(replace(r, **changes))
    return out
