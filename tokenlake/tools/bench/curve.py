"""``tokenlake bench curve``: what CURVE (encryption and authentication) costs the data path.

Two 4-instance pools of one Llama-2-7B-shaped layer (float32) hold the same prefix: one
with CURVE (the default), one started ``insecure``. Rounds alternate between them (the
order flips every round) and time, on each:

* **query**: one decode query row over the prefix (the q row goes to the instances that
  hold segments; their partial ``(o, lse)`` come back over CURVE or not);
* **put**: a new request's chunk stored layer by layer; its segments whose hash home is
  another instance travel to that instance's transfer engine as K/V frames (the bulk
  bytes CURVE has to encrypt). The put is aborted afterwards, so every round stores the
  same amount.

Prints medians, ranges and the ratio secure / insecure; asserts nothing.
"""

from __future__ import annotations

import random
import statistics
import time

from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.deploy.local import LocalCluster
from tokenlake.tools.bench.dataplane import LAYER, _fill


def _query_ms(cluster: LocalCluster, rid: str, repeats: int) -> list[float]:
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest(rid, (7,)),), "decode")], [1])
    try:
        client = cluster.client(plans.query_plans[0].home)
        client.init_query(plans.query_plans[0]).normal_()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.query(0, timeout_s=120)
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    finally:
        cp.abort(plans)


def _put_ms(cluster: LocalCluster, rid: str, tokens: list[int]) -> tuple[float, int]:
    """One chunk stored and aborted: (milliseconds, rows that went to peers)."""
    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest(rid, tuple(tokens)),))], [1])
    try:
        (tp,) = plans.transfer_plans
        client = cluster.client(tp.home)
        client.init_transfer(tp).normal_()
        t0 = time.perf_counter()
        client.put(0).wait(timeout_s=120)
        ms = (time.perf_counter() - t0) * 1e3
        return ms, sum(p.stop - p.start for p in tp.puts if p.instance != tp.home)
    finally:
        cp.abort(plans)


def bench_curve(prefix_tokens: int = 16384, put_tokens: int = 4096, rounds: int = 7,
                query_repeats: int = 5, instances: int = 4, segment_tokens: int = 512) -> dict:
    m = LAYER
    seg_bytes = 2 * m.num_kv_heads * segment_tokens * m.head_dim * 4
    slots = (prefix_tokens + 2 * put_tokens) // segment_tokens // instances + 2 * instances + 8
    rng = random.Random(0)
    prefix = [rng.randrange(3, 32000) for _ in range(prefix_tokens)]
    times: dict[str, dict[str, list[float]]] = {k: {"query": [], "put": []} for k in ("curve", "insecure")}
    remote_rows = []
    with LocalCluster(instances, m, slots * seg_bytes, segment_tokens, max_rows=put_tokens,
                      timeout_s=120.0, peer_timeout_s=60.0, share_slabs=False) as secure, \
         LocalCluster(instances, m, slots * seg_bytes, segment_tokens, max_rows=put_tokens,
                      timeout_s=120.0, peer_timeout_s=60.0, insecure=True, share_slabs=False) as plain:
        pools = {"curve": secure, "insecure": plain}
        for cluster in pools.values():
            _fill(cluster, "prefix", prefix, put_tokens)
            _query_ms(cluster, "prefix", 1)  # warm-up
        for r in range(rounds):
            order = ("curve", "insecure") if r % 2 == 0 else ("insecure", "curve")
            new = [rng.randrange(3, 32000) for _ in range(put_tokens)]
            for name in order:
                times[name]["query"].append(statistics.median(_query_ms(pools[name], "prefix",
                                                                        query_repeats)))
                ms, rows = _put_ms(pools[name], f"new-{r}", new)
                times[name]["put"].append(ms)
                remote_rows.append(rows)
    out: dict = {"setup": {"instances": instances, "segment_tokens": segment_tokens,
                           "prefix_tokens": prefix_tokens, "put_tokens": put_tokens,
                           "rounds": rounds, "layer": "llama-2-7b-shaped, float32",
                           "put_bytes": put_tokens * 2 * m.num_kv_heads * m.head_dim * 4,
                           "put_bytes_to_peers": statistics.median(remote_rows) * 2 * m.num_kv_heads
                           * m.head_dim * 4}}
    for op in ("query", "put"):
        row = {}
        for name in ("curve", "insecure"):
            xs = times[name][op]
            row[name] = {"median_ms": statistics.median(xs), "min_ms": min(xs), "max_ms": max(xs)}
        row["ratio_curve_over_insecure"] = row["curve"]["median_ms"] / row["insecure"]["median_ms"]
        out[op] = row
    return out
