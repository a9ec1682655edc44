"""``tokenlake bench soak --minutes N``: a long mixed query/put load on a local pool,
watching for leaks and drift.

Requests with shared and private prefixes go through the real data path (random q and
K/V, no model): each iteration plans a few requests, puts their new K/V layer by layer,
queries the pool for every layer, completes, and finishes about one request in four,
so segments are stored, reused, evicted and released all the time. Every
``interval_s`` it samples, per process (this one and every engine), the resident set
(``VmRSS``), open file descriptors and the cluster's shared-memory bytes, and the
iteration latency of the interval. The report (JSON) gives the first and last samples
after warm-up, the growth of each, the latency drift (last interval's median / first
interval's median), and whether any of the cluster's shared memory is left after it
closes. Linux (``/proc``) only.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable

from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import ModelSpec

#: A small Llama-shaped model: the soak is about the pool, not the arithmetic.
SOAK_MODEL = ModelSpec(name="soak", num_layers=4, hidden_size=256, num_q_heads=4,
                       num_kv_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000,
                       num_params=1e6, dtype_bytes=4, max_context=1 << 16)


def _proc_stats(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _shm_bytes(prefix: str) -> int:
    from tokenlake.dataplane.shm_files import list_buffers, shm_dir

    return sum(os.path.getsize(os.path.join(shm_dir(), n)) for n in list_buffers(prefix))


def _iteration(cluster, rng: random.Random, live: dict[str, list[int]], docs: list,
               seq: list[int]) -> None:
    """One iteration: new requests (half on a shared document), one chunk each."""
    cp = cluster.control
    reqs = []
    for _ in range(rng.randint(1, 2)):  # at most 760 new rows: within max_rows
        seq[0] += 1
        rid = f"s{seq[0]}"
        doc = rng.choice(docs) if rng.random() < 0.5 else []
        tokens = doc + [rng.randrange(3, 999) for _ in range(rng.randint(8, 80))]
        hit = cp.get_prefix_tree().match(tokens, max_tokens=len(tokens) - 1).hit_tokens
        live[rid] = tokens
        reqs.append(BatchRequest(rid, tuple(tokens[hit:]), tuple(tokens[:hit])))
    plans = cp.gen_plans([Batch(tuple(reqs))], [1])
    try:
        for qp, tp in zip(plans.query_plans, plans.transfer_plans):
            client = cluster.client(qp.home)
            q, kv = client.init_plans(qp, tp)
            for layer in range(SOAK_MODEL.num_layers):
                kv[layer].normal_()
                client.put(layer)
                q.normal_()
                client.query(layer)
            client.wait_puts()
    except BaseException:
        cp.abort(plans)
        raise
    cp.complete(plans)
    for rid in list(live):  # everything is done after its one chunk: release most
        if rng.random() < 0.75 or len(live) > 8:
            cp.finish_request(rid)
            del live[rid]


def bench_soak(minutes: float, instances: int = 2, interval_s: float = 10.0,
               warmup_s: float = 10.0, seed: int = 0,
               progress: Callable[[str], None] = lambda line: None) -> dict:
    """Runs the load for ``minutes``; the report described in the module docstring."""
    from tokenlake.dataplane.shm_files import cluster_prefix, list_buffers
    from tokenlake.deploy.local import LocalCluster

    rng = random.Random(seed)
    docs = [[rng.randrange(3, 999) for _ in range(rng.randint(100, 300))] for _ in range(8)]
    samples, lat = [], []
    live: dict[str, list[int]] = {}
    seq = [0]
    cluster = LocalCluster(instances, SOAK_MODEL, 16 << 20, segment_tokens=32, max_rows=1024)
    with cluster:
        prefix = cluster_prefix(cluster.cluster_id)
        pids = {"driver": os.getpid(), **{f"{r}-{i}": p.pid
                                          for (r, i), p in cluster._procs.items()}}
        start = time.monotonic()
        end, next_sample, iterations = start + 60 * minutes, start + warmup_s, 0
        while time.monotonic() < end:
            t0 = time.perf_counter()
            _iteration(cluster, rng, live, docs, seq)
            lat.append(time.perf_counter() - t0)
            iterations += 1
            if time.monotonic() >= next_sample:
                samples.append({"t_s": round(time.monotonic() - start, 1),
                                "iterations": iterations,
                                "latency_ms_p50": statistics.median(lat) * 1e3,
                                "shm_bytes": _shm_bytes(prefix),
                                "procs": {k: _proc_stats(p) for k, p in pids.items()}})
                progress(f"{samples[-1]['t_s']:.0f} s: {iterations} iterations, p50 "
                         f"{samples[-1]['latency_ms_p50']:.1f} ms, driver RSS "
                         f"{samples[-1]['procs']['driver']['rss_kib'] >> 10} MiB")
                lat, next_sample = [], next_sample + interval_s
        for rid in list(live):
            cluster.control.finish_request(rid)
    return _report(samples, list_buffers(prefix), minutes, instances)


def _report(samples: list[dict], left: list[str], minutes: float, instances: int) -> dict:
    if len(samples) < 2:
        return {"error": "too short: fewer than two samples after warm-up", "samples": samples}
    first, last = samples[0], samples[-1]

    def growth(a: float, b: float) -> float:
        return (b - a) / a * 100 if a else 0.0

    procs = {k: {"rss_kib": [first["procs"][k]["rss_kib"], last["procs"][k]["rss_kib"]],
                 "rss_growth_pct": growth(first["procs"][k]["rss_kib"],
                                          last["procs"][k]["rss_kib"]),
                 "fds": [first["procs"][k]["fds"], last["procs"][k]["fds"]]}
             for k in first["procs"]}
    return {"minutes": minutes, "instances": instances, "iterations": last["iterations"],
            "processes": procs,
            "max_rss_growth_pct": max(p["rss_growth_pct"] for p in procs.values()),
            "shm_bytes": [first["shm_bytes"], last["shm_bytes"]],
            "latency_ms_p50": [first["latency_ms_p50"], last["latency_ms_p50"]],
            "latency_drift": last["latency_ms_p50"] / first["latency_ms_p50"],
            "shm_left_after_close": left, "samples": samples}
