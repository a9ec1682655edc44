"""Helpers shared by the data-plane tests: a deterministic "model" that gives every
token its K/V from its id and position (so equal prefixes have equal KV), and an
executor that runs one iteration's plans through a LocalCluster."""

from __future__ import annotations

import torch

from tokenlake.core.specs import ModelSpec
from tokenlake.dataplane import wire
from tokenlake.kernels.attention import merge, partial_attention_ref


class ManualClock:
    """A clock a test moves by hand: ``clock()`` is ``clock.now`` (seconds)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


TINY = ModelSpec(
    name="tiny-gqa", num_layers=2, hidden_size=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=1000, num_params=100_000, dtype_bytes=4, max_context=4096,
)


def token_kv(tokens, start: int, layer: int, model: ModelSpec = TINY) -> torch.Tensor:
    """K/V of ``tokens`` at positions ``start..``: [n, 2, kv_heads, head_dim] float32."""
    n = len(tokens)
    t = torch.tensor(list(tokens), dtype=torch.float64)[:, None]
    p = torch.arange(start, start + n, dtype=torch.float64)[:, None]
    width = 2 * model.num_kv_heads * model.head_dim
    base = torch.arange(width, dtype=torch.float64)[None, :]
    x = torch.sin(t * 0.37 + p * 0.011 + layer * 1.3 + base * 0.173) + 0.5 * torch.cos(t * 0.05 + base * 0.71)
    return x.reshape(n, 2, model.num_kv_heads, model.head_dim).to(torch.float32)


def query_rows(request_id: str, start: int, n: int, layer: int, model: ModelSpec = TINY) -> torch.Tensor:
    """Deterministic q rows of a request: [n, q_heads, head_dim] float32."""
    g = torch.Generator().manual_seed(hash((request_id, start, layer)) % (2**31))
    return torch.randn(n, model.num_q_heads, model.head_dim, generator=g)


def execute(cluster, plans, tokens: dict[str, list[int]], new: dict[str, int], model: ModelSpec = TINY,
            coalesce: bool = False):
    """Runs every sub-batch of ``plans``: puts the new tokens' KV layer by layer (or, with
    ``coalesce``, all layers in one put after the last query) and queries the pool.
    Returns {(request_id, layer): (q, o, lse, position)} per span."""
    results = {}
    for qp, tp in zip(plans.query_plans, plans.transfer_plans):
        client = cluster.client(qp.home)
        q_buf = client.init_query(qp)
        kv_buf = client.init_transfer(tp)
        handles = []
        for layer in range(model.num_layers):
            for span in qp.spans:
                toks = tokens[span.request_id]
                kv_buf[layer, span.start : span.stop] = token_kv(
                    toks[span.position : span.position + span.stop - span.start], span.position, layer, model
                )
            if not coalesce:
                handles.append(client.put(layer))
            for span in qp.spans:
                q_buf[span.start : span.stop] = query_rows(span.request_id, span.position, span.stop - span.start, layer, model)
            part = client.query(layer)
            for span in qp.spans:
                rows = slice(span.start, span.stop)
                results[(span.request_id, span.position, layer)] = (  # on the host (a GPU pool's too)
                    q_buf[rows].cpu().clone(), part.o[rows].cpu().clone(), part.lse[rows].cpu().clone(), span
                )
        if coalesce:
            handles.append(client.put(0, model.num_layers))
        for h in handles:
            h.wait()
    return results


def reference_prefix(tokens: list[int], prefix_tokens: int, q: torch.Tensor, layer: int, model: ModelSpec = TINY,
                     kv_dtype: torch.dtype = torch.float32):
    """float64 attention of ``q`` over the prefix's K/V as a pool of ``kv_dtype`` stores
    them (rounded to it once)."""
    kv = token_kv(tokens[:prefix_tokens], 0, layer, model).to(kv_dtype).to(torch.float64)
    return partial_attention_ref(q.to(torch.float64), kv[:, 0], kv[:, 1])


def full_attention_check(tokens, span, q, o, lse, layer, model: ModelSpec = TINY,
                         kv_dtype: torch.dtype = torch.float32):
    """Pool prefix partial merged with causal self-attention over the span's own rows
    equals monolithic causal attention over [prefix ; new] (the compute engine's job).
    Valid when the span starts at the request's first new token."""
    p, n = span.prefix_tokens, span.stop - span.start
    new_kv = token_kv(tokens[p : p + n], p, layer, model).to(kv_dtype)
    so, slse = partial_attention_ref(q.double(), new_kv[:, 0].double(), new_kv[:, 1].double(), causal=True)
    mo, mlse = merge(o.double(), lse.double(), so, slse)
    all_kv = token_kv(tokens[: p + n], 0, layer, model).to(kv_dtype).double()
    ro, rlse = partial_attention_ref(q.double(), all_kv[:, 0], all_kv[:, 1], causal=True)
    return (mo - ro).abs().max().item(), (mlse - rlse).abs().max().item()


def engine_request(cluster, key: tuple[str, int], message, reply, **who):
    """One request to one engine of a ``LocalCluster`` as another engine of the cluster
    (``PEER_*`` kinds are accepted from engines only), or as ``who`` says
    (``as_owner``, ``as_engine``, ``routing_id``: :meth:`LocalCluster._dealer`)."""
    from tokenlake.dataplane.messages import expect

    sock = cluster._dealer(key, **(who or {"as_engine": True}))
    try:
        sock.send_multipart(message.encode(1))
        return expect(wire.recv(sock, cluster.timeout_s), reply)
    finally:
        sock.close(0)


def check_iteration(cluster, tokens, new, first_prefix):
    """Plans and runs one iteration of ``cluster``'s control plane; every query equals
    float64 attention. Returns the prefix tokens each request found cached."""
    from tokenlake.core.plans import Batch, BatchRequest

    cp = cluster.control
    reqs = [BatchRequest(rid, tuple(tokens[rid][first_prefix[rid]:first_prefix[rid] + n]),
                         tuple(tokens[rid][:first_prefix[rid]])) for rid, n in new.items()]
    plans = cp.gen_plans([Batch(tuple(reqs))], [1])
    results = execute(cluster, plans, tokens, new)
    cp.complete(plans)
    worst, hits = 0.0, {}
    for (rid, _pos, layer), (q, o, lse, span) in results.items():
        hits[rid] = min(hits.get(rid, span.prefix_tokens), span.prefix_tokens)
        if span.prefix_tokens:
            ro, rlse = reference_prefix(tokens[rid], span.prefix_tokens, q, layer)
            worst = max(worst, (o.double() - ro).abs().max().item(), (lse.double() - rlse).abs().max().item())
        if span.position == span.prefix_tokens:
            worst = max(worst, *full_attention_check(tokens[rid], span, q, o, lse, layer))
    assert worst < 1e-5, worst
    return hits


def tier_round_trip(cluster, doc: list[int], c: int, push: int) -> None:
    """``doc``, whose whole segments ``cluster``'s tiers hold, is pushed out of the
    slabs by ``push`` segments of other documents; a request that continues it then
    finds it only in the tiers, is promoted, and reads all of it with exact answers."""
    import random

    cp = cluster.control
    rng = random.Random(len(doc))
    tokens = {f"o{i}": [rng.randrange(3, 900) for _ in range(8 * c)] for i in range(-(-push // 8))}
    for rid in list(tokens):
        check_iteration(cluster, tokens, {rid: 8 * c}, {rid: 0})
        cp.finish_request(rid)
    whole = len(doc) // c * c
    m = cp.get_prefix_tree().match(doc, max_tokens=len(doc) - 1)
    assert m.tier_keys and len(m.keys + m.tier_keys) == whole // c, "pushed out, held in the tiers"
    tokens["q"] = doc[:whole] + [rng.randrange(3, 900) for _ in range(6)]
    assert cp.promote([(tokens["q"], None)]) == len(m.tier_keys)
    assert check_iteration(cluster, tokens, {"q": 6}, {"q": whole}) == {"q": whole}
    cp.finish_request("q")
    cp.check()
