"""``tokenlake bench query-vs-fetch``: the declarative query against the imperative fetch.

One decode step (1 query row) of one Llama-2-7B-shaped layer (32 heads x 128 dims) over
a prefix of S tokens spread over 4 instances, in a float32 and a bfloat16 pool, the
instances asked by message as between hosts (``share_slabs=False``: on one machine the
home would read the peers' slabs itself):

(a) **query**: the q row goes to every instance holding prefix segments; each computes
    its partial attention; the partials come back and are merged (``client.query``);
(b) **fetch**: the prefix KV held by the other instances is fetched over the same
    transport (zmq, zero-copy frames) and attended locally with the local part.

Prints figures; asserts nothing. Bytes are payload bytes (tensor frames). The local
partial attention is also reported as KV GB/s against this machine's memory read
bandwidth, both measured in the same run (``bench_kernel.memory_read_gbps``).
"""

from __future__ import annotations

import random
import statistics

import torch

from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import ModelSpec
from tokenlake.dataplane import wire
from tokenlake.dataplane.messages import ReadSegment, SegmentData, expect
from tokenlake.dataplane.sockets import send
from tokenlake.deploy.local import LocalCluster
from tokenlake.kernels.attention import merge
from tokenlake.kernels.backends import flashinfer_partial_attention
from tokenlake.kernels.cpu import partial_attention
from tokenlake.kernels.slab import slab_partial_attention
from tokenlake.tools.bench.plans import timed_ms

LAYER = ModelSpec(
    name="llama-2-7b-one-layer", num_layers=1, hidden_size=4096, num_q_heads=32, num_kv_heads=32,
    head_dim=128, intermediate_size=11008, vocab_size=32000, num_params=6.74e9, dtype_bytes=4,
    max_context=1 << 20,
)


def _fill(cluster: LocalCluster, rid: str, tokens: list[int], chunk: int) -> None:
    """Stores the prefix through the real put path, one chunked-prefill iteration at a time."""
    cp = cluster.control
    for off in range(0, len(tokens), chunk):
        plans = cp.gen_plans([Batch((BatchRequest(rid, tuple(tokens[off : off + chunk])),))], [1])
        (tp,) = plans.transfer_plans
        client = cluster.client(tp.home)
        kv = client.init_transfer(tp)
        kv.normal_()
        client.put(0).wait(timeout_s=120)
        cp.complete(plans)


def _fetch_and_attend(cluster, qp, q: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The imperative path: pull remote slots' KV, attend over everything locally (on a
    GPU pool: the fetched K/V copied to the home's device, attended there by FlashInfer)."""
    home_slab = cluster.slab(qp.home)
    socks, fetched = [], 0
    parts = []
    for task in qp.tasks + qp.tails:
        slots = [s for it in task.items for s in it.slots]
        tokens = [t for it in task.items for t in it.tokens]
        if task.instance == qp.home:
            parts.append(slab_partial_attention(q, home_slab, 0, slots, tokens))
            continue
        sock = cluster._dealer(("transfer", task.instance), as_owner=False)  # a member, as CURVE asks
        send(sock, ReadSegment(0, tuple(slots)).encode(1))
        socks.append((sock, tokens))
    for sock, tokens in socks:
        data = expect(wire.recv(sock, 120.0), SegmentData)
        sock.close(0)
        blocks = [t[:, :, :n] for t, n in zip(data.blocks, tokens)]  # [2, kv_heads, n, d]
        fetched += sum(t.numel() * t.element_size() for t in data.blocks)
        if q.is_cuda:  # to the home GPU, attended in the pool's half dtype: [2, kv_heads, S_i, d]
            kv = torch.cat(blocks, dim=2).to(q.device)
            parts.append(flashinfer_partial_attention(q, kv[0], kv[1], kv_layout="HND"))
            continue
        kv = torch.cat(blocks, dim=2).float()  # the fetched prefix, local, float32 math: [2, kv_heads, S_i, d]
        parts.append(partial_attention(q, kv[0].transpose(0, 1), kv[1].transpose(0, 1)))
    o, lse = parts[0]
    for po, plse in parts[1:]:
        o, lse = merge(o, lse, po, plse)
    return fetched, o


def bench_query_vs_fetch(
    prefixes=(4096, 16384, 65536), n_instances: int = 4, segment_tokens: int = 512,
    repeats: int = 5, chunk: int = 4096, dtypes=("float32", "bfloat16"), device: str = "cpu",
) -> dict:
    """The comparison of the module docstring; ``device="cuda"`` puts every buffer of the
    pool on the GPU (half dtypes only) and returns the query/fetch rows alone."""
    from tokenlake.tools.bench.kernel import memory_read_gbps

    results = [row for dtype in dtypes
               for row in _query_vs_fetch(prefixes, n_instances, segment_tokens, repeats, chunk, dtype, device)]
    if device != "cpu":
        return {"results": results, "setup": {"instances": n_instances, "segment_tokens": segment_tokens,
                                              "dtypes": list(dtypes), "device": device}}
    bandwidth = memory_read_gbps()
    local = {dtype: _attention_throughput(max(prefixes), segment_tokens, dtype) for dtype in dtypes}
    best = max(bandwidth.values())
    return {
        "results": results,
        "attention_gbps": {d: r["attention_gbps"] for d, r in local.items()},
        "attention_vs_bandwidth": {d: r["attention_gbps"] / best for d, r in local.items()},
        "memory_read_gbps": best, "memory_read_methods_gbps": bandwidth,
        "attention_threads": torch.get_num_threads(),
        "setup": {"instances": n_instances, "segment_tokens": segment_tokens, "dtypes": list(dtypes),
                  "heads": LAYER.num_q_heads, "head_dim": LAYER.head_dim, "query_rows": 1},
    }


def _query_vs_fetch(prefixes, n_instances: int, segment_tokens: int, repeats: int, chunk: int,
                    dtype: str, device: str = "cpu") -> list[dict]:
    m = LAYER
    seg_bytes = 2 * m.num_kv_heads * segment_tokens * m.head_dim * getattr(torch, dtype).itemsize
    slots = sum(prefixes) // segment_tokens // n_instances + 2 * n_instances + 8
    rng = random.Random(0)
    results = []
    with LocalCluster(n_instances, m, slots * seg_bytes, segment_tokens, max_rows=chunk, timeout_s=120.0,
                      peer_timeout_s=60.0, kv_dtype=dtype, share_slabs=False,  # as between hosts
                      device=device) as cluster:
        cp = cluster.control
        for s in prefixes:
            rid = f"prefix-{s}"
            tokens = [rng.randrange(3, 32000) for _ in range(s)]
            _fill(cluster, rid, tokens, chunk)
            plans = cp.gen_plans([Batch((BatchRequest(rid, (7,)),), "decode")], [1])
            qp = plans.query_plans[0]
            client = cluster.client(qp.home)
            q = client.init_query(qp)
            q.normal_()
            query_ms = timed_ms(lambda c=client: c.query(0, timeout_s=120), repeats)  # a reply after the device's work
            got = client.query(0).o.clone()
            remote = {t.instance for t in qp.tasks + qp.tails} - {qp.home}
            query_bytes = len(remote) * (q[0].numel() * 4 + got[0].numel() * 4 + m.num_q_heads * 4)
            outcome: dict = {}

            def fetch(qp=qp, q=q, outcome=outcome):
                outcome["bytes"], outcome["o"] = _fetch_and_attend(cluster, qp, q)

            fetch_ms = timed_ms(fetch, max(2, repeats // 2))
            fetched = [outcome["bytes"]]
            tolerance = 1e-4 if device == "cpu" else 2e-2  # FlashInfer: q rounded to the half dtype
            assert torch.allclose(outcome["o"], got, atol=tolerance), "query and fetch disagree"
            results.append({
                "dtype": dtype,
                "prefix_tokens": s,
                "query_bytes": query_bytes,
                "fetch_bytes": fetched[0],
                "query_ms": statistics.median(query_ms),
                "fetch_ms": statistics.median(fetch_ms),
                "bytes_ratio": fetched[0] / max(query_bytes, 1),
                "latency_ratio": statistics.median(fetch_ms) / statistics.median(query_ms),
            })
            cp.abort(plans)
            cp.finish_request(rid)
    return results


def _attention_throughput(tokens: int, segment_tokens: int, dtype: str) -> dict:
    """Local partial attention over a slab (what a query engine runs), as GB/s of KV read."""
    m = LAYER
    n = tokens // segment_tokens
    slab = torch.randn(n, 1, 2, m.num_kv_heads, segment_tokens, m.head_dim).to(getattr(torch, dtype))
    q = torch.randn(1, m.num_q_heads, m.head_dim)
    slots, toks = list(range(n)), [segment_tokens] * n
    slab_partial_attention(q, slab, 0, slots, toks)
    ms = statistics.median(timed_ms(lambda: slab_partial_attention(q, slab, 0, slots, toks), 5))
    return {"attention_gbps": slab.numel() * slab.element_size() / (ms / 1e3) / 1e9}
