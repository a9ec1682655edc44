"""The stateless compute engine (paper §3, docs/design.md §1): it holds weights only.

Per iteration it receives the batches and their plans and, for every layer, computes
q, k, v for the new tokens, puts the new k, v into the pool (asynchronously), queries
the pool for the prefix attention, computes causal self-attention over the new tokens
with its LSE, merges the two exactly, and goes on. Nothing is kept between iterations:
the next iteration's prefix is whatever the pool holds.

On one machine (:class:`~tokenlake.deploy.local.LocalCluster`) one compute engine serves
every instance: a batch with DoP > 1 is computed as a whole (its sub-batches' q rows
and K/V go through their own homes' clients), which is what the sequence-parallel
group of those instances computes together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokenlake.core.plans import Batch, Plans
from tokenlake.dataplane.attention import merge
from tokenlake.dataplane.attention_cpu import partial_attention, single_token_attention
from tokenlake.model.llama import model as llama
from tokenlake.model.llama.weights import LlamaWeights

#: Sub-batches of at most this many new tokens (decode) write their K/V into ``kv_buf``
#: layer by layer but send one put for all layers after the last one: a put message per
#: layer costs more than the few rows it carries, and no query of this iteration reads
#: them (the new tokens' own attention is the self-attention part).
COALESCE_PUT_ROWS = 32


@dataclass(frozen=True)
class IterationOutput:
    """Last-row logits per request that computed its last new token this iteration.

    ``logits[request_id]`` is [vocab] float32 for the request's final new token.
    ``prefix_tokens[request_id]`` is how many tokens the pool served it (its hit).
    """

    logits: dict[str, torch.Tensor]
    prefix_tokens: dict[str, int]


class ComputeEngine:
    """Runs iterations of a Llama model whose prefix attention is served by the pool.

    ``on_query``, when set, is called with the seconds each layer's pool queries took,
    from sending the first to receiving the last partial (a service's metrics)."""

    def __init__(self, weights: LlamaWeights, cluster) -> None:
        self.w = weights
        self.cfg = weights.config
        self.cluster = cluster
        self.on_query: Callable[[float], None] | None = None

    def run(self, plans: Plans, batches: Sequence[Batch]) -> IterationOutput:
        """Computes one iteration; returns when every put of it is stored."""
        logits: dict[str, torch.Tensor] = {}
        prefix: dict[str, int] = {}
        parts_of = {}
        for qp, tp in zip(plans.query_plans, plans.transfer_plans):
            parts_of.setdefault(qp.batch, []).append((qp, tp))
        clients = []
        for b, batch in enumerate(batches):
            out, spans = self._run_batch(batch, parts_of[b])
            logits.update(out)
            prefix.update(spans)
            clients.extend(self.cluster.client(qp.home) for qp, _ in parts_of[b])
        for client in clients:
            client.wait_puts()
        return IterationOutput(logits, prefix)

    def _run_batch(self, batch: Batch, parts) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        tokens, positions, rows_of = [], [], {}
        first_position = {}
        for qp, _ in parts:
            for span in qp.spans:
                first_position.setdefault(span.request_id, span.prefix_tokens)
        for req in batch.requests:
            start = len(tokens)
            tokens.extend(req.new_token_ids)
            p0 = first_position[req.request_id]
            positions.extend(range(p0, p0 + len(req.new_token_ids)))
            rows_of[req.request_id] = (start, len(tokens))
        ids = torch.tensor(tokens, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        bufs = []
        offset = 0
        for qp, tp in parts:
            client = self.cluster.client(qp.home)
            bufs.append((client, client.init_query(qp), client.init_transfer(tp), offset, qp.num_rows))
            offset += qp.num_rows
        hidden = llama.embed(self.w, ids)
        coalesce = len(tokens) <= COALESCE_PUT_ROWS
        rope = llama.rope_tables(self.cfg, pos)
        for layer in range(self.cfg.num_layers):
            q, k, v = llama.qkv(self.w, layer, hidden, pos, rope=rope)
            attn = self._attention(layer, q, k, v, bufs, rows_of, put=not coalesce)
            hidden = llama.finish_layer(self.w, layer, hidden, attn)
        if coalesce:
            for client, *_ in bufs:
                client.put(0, self.cfg.num_layers)
        last_rows = [stop - 1 for _, stop in rows_of.values()]
        out = llama.logits(self.w, hidden[last_rows])
        logits = {rid: out[i] for i, rid in enumerate(rows_of)}
        return logits, first_position

    def _attention(self, layer, q, k, v, bufs, rows_of, put: bool = True) -> torch.Tensor:
        """Pool prefix attention merged with causal self-attention over the new tokens.
        ``put=False`` only writes the new K/V into ``kv_buf`` (the caller puts later)."""
        n = q.shape[0]
        pre_o = torch.empty_like(q)
        pre_lse = torch.empty(n, q.shape[1])
        kv = torch.stack((k, v), dim=1)  # [n, 2, kv_heads, head_dim]
        for client, _, kv_buf, lo, rows in bufs:  # puts first: they overlap the queries
            kv_buf[layer].copy_(kv[lo : lo + rows])
            if put:
                client.put(layer)
        handles = []
        sent = time.perf_counter()
        for client, q_buf, _, lo, rows in bufs:  # queries out; self-attention meanwhile
            q_buf.copy_(q[lo : lo + rows])
            handles.append((client.query_async(layer), lo, rows))
        if n == len(rows_of):  # one new token each (decode): attention over itself only
            own = [(0, n, single_token_attention(q, k, v))]
        else:
            own = [(start, stop, partial_attention(q[start:stop], k[start:stop], v[start:stop], causal=True))
                   for start, stop in rows_of.values()]
        for handle, lo, rows in handles:
            part = handle.wait()
            pre_o[lo : lo + rows] = part.o
            pre_lse[lo : lo + rows] = part.lse
        if self.on_query is not None and handles:
            self.on_query(time.perf_counter() - sent)
        out = torch.empty_like(q)
        for start, stop, (so, slse) in own:
            out[start:stop], _ = merge(pre_o[start:stop], pre_lse[start:stop], so, slse)
        return out
