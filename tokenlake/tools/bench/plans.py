"""Benchmarks of the control plane (``tokenlake bench plans``). They print figures; they
are not tests, and nothing asserts a speed."""

from __future__ import annotations

import random
import statistics
import time
from array import array

from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import load_model


def timed_ms(fn, repeats: int) -> list[float]:
    """Wall time of ``repeats`` calls of ``fn``, each in milliseconds."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench_gen_plans(
    n_instances: int,
    n_requests: int = 64,
    prefix_tokens: int = 32 * 1024,
    segment_tokens: int = 576,
    repeats: int = 30,
    seed: int = 0,
) -> dict:
    """``gen_plans`` for one decode iteration of ``n_requests`` requests whose
    ``prefix_tokens``-token prefixes are all in the pool (distinct documents).

    Requests are spread round-robin over ``min(n_requests, N)`` decode batches (DoP 1).
    Reports the steady-state iteration (the figure a scheduler pays every step) and the
    first iteration after admission (prefix replicas chosen, leases taken).
    """
    model = load_model("llama-2-7b")
    rng = random.Random(seed)
    segs = n_requests * (prefix_tokens // segment_tokens + 2)
    config = PoolConfig(segment_tokens, "bench", slots_per_instance=2 * segs // n_instances + 16)
    cp = ControlPlane(config, model, list(range(n_instances)), clock=time.monotonic, rng=rng)
    n_batches = min(n_requests, n_instances)
    prompts = [
        tuple(rng.randrange(3, model.vocab_size) for _ in range(prefix_tokens))
        for _ in range(n_requests)
    ]
    # Fill the pool: prefill every prefix (the segment-aligned part is what is reused).
    for i, p in enumerate(prompts):
        cp.complete(cp.gen_plans([Batch((BatchRequest(f"fill{i}", p),))], [1]))
        cp.finish_request(f"fill{i}")
    aligned = prefix_tokens // segment_tokens * segment_tokens

    def decode_batches(first: bool) -> list[Batch]:
        groups: list[list[BatchRequest]] = [[] for _ in range(n_batches)]
        for i, p in enumerate(prompts):
            tok = (rng.randrange(3, model.vocab_size),)
            req = BatchRequest(f"r{i}", p[aligned:] + tok if first else tok, p[:aligned] if first else ())
            groups[i % n_batches].append(req)
        return [Batch(tuple(g), "prefill" if first else "decode") for g in groups]

    batches = decode_batches(first=True)
    t0 = time.perf_counter()
    plans = cp.gen_plans(batches, [1] * n_batches)
    first_ms = (time.perf_counter() - t0) * 1e3
    cp.complete(plans)
    steady, complete = [], []
    for _ in range(repeats):
        batches = decode_batches(first=False)
        t0 = time.perf_counter()
        plans = cp.gen_plans(batches, [1] * n_batches)
        t1 = time.perf_counter()
        cp.complete(plans)
        steady.append((t1 - t0) * 1e3)
        complete.append((time.perf_counter() - t1) * 1e3)
    return {
        "median_ms": statistics.median(steady),
        "p90_ms": sorted(steady)[int(0.9 * (len(steady) - 1))],
        "first_iteration_ms": first_ms,
        "complete_ms": statistics.median(complete),
        "segments_read_per_iteration": n_requests * (prefix_tokens // segment_tokens),
    }


def bench_match(
    prompt_tokens: int = 128 * 1024,
    tree_segments: int = 100_000,
    segment_tokens: int = 576,
    repeats: int = 20,
    seed: int = 0,
) -> dict:
    """Longest-prefix match of a ``prompt_tokens`` prompt (all of it cached: the worst
    case, every segment hashed and looked up) against a tree of ``tree_segments``."""
    rng = random.Random(seed)
    config = PoolConfig(segment_tokens, "bench-match", slots_per_instance=tree_segments // 8 + 64)
    cp = ControlPlane(config, load_model("llama-2-7b"), list(range(8)), clock=time.monotonic)
    pool, hasher = cp.pool, cp.pool.hasher
    prompt = [rng.randrange(3, 32000) for _ in range(prompt_tokens)]

    def insert_chain(tokens) -> int:
        parent = None
        n = 0
        for i, key in enumerate(hasher.iter_keys(tokens)):
            placed = pool.place(key, parent, i)
            if placed.created:
                pool.commit(key, placed.location.instance)
            parent, n = key, n + 1
        return n

    total = insert_chain(prompt)
    chain_tokens = 64 * segment_tokens
    while total < tree_segments:
        other = array("i", (rng.randrange(3, 32000) for _ in range(chain_tokens)))
        total += insert_chain(other)
    as_list = timed_ms(lambda: pool.match(prompt), repeats)
    as_array = array("i", prompt)
    as_arr = timed_ms(lambda: pool.match(as_array), repeats)
    hit = pool.match(prompt).hit_tokens
    return {
        "tree_segments": len(pool.tree),
        "hit_tokens": hit,
        "list_ms": statistics.median(as_list),
        "array_ms": statistics.median(as_arr),
        "tokens_per_s_list": prompt_tokens / (statistics.median(as_list) / 1e3),
        "tokens_per_s_array": prompt_tokens / (statistics.median(as_arr) / 1e3),
    }


def bench_plans(instances=(8, 64, 256), radix: bool = True, inserts: int = 10_000) -> dict:
    """All figures of ``tokenlake bench plans`` as one JSON-ready dict; with ``radix``
    also the prefix tree beside a page-size-1 radix tree
    (:func:`tokenlake.tools.bench.match.bench_match_vs_radix`)."""
    from tokenlake.tools.bench.match import bench_match_vs_radix

    details = {str(n): bench_gen_plans(n) for n in instances}
    match = bench_match()
    versus = bench_match_vs_radix(inserts=inserts) if radix else None
    return {
        "gen_plans_ms": {n: round(d["median_ms"], 3) for n, d in details.items()},
        "match_tokens_per_s": round(match["tokens_per_s_list"]),
        "gen_plans_detail": details,
        "match_detail": match,
        "match_vs_radix": versus,
        "setup": {
            "requests": 64,
            "prefix_tokens": 32 * 1024,
            "segment_tokens": 576,
            "model": "llama-2-7b",
            "phase": "decode, DoP 1, min(64, N) batches",
        },
    }
