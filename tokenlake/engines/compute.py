"""The stateless compute engine (paper §3, docs/design.md §1): it holds weights only.

Per iteration it receives the batches and their plans and, for every layer, computes
q, k, v for the new tokens, puts the new k, v into the pool (asynchronously), queries
the pool for the prefix attention, computes causal self-attention over the new tokens
with its LSE, merges the two exactly, and goes on. Nothing is kept between iterations:
the next iteration's prefix is whatever the pool holds. Where this process holds every
slab a plan reads (a CPU ``LocalCluster``), the query is attended here, in place, and a
few rows are stored here too (docs/data-plane.md "Attending in place").

The unit of work is one sub-batch (a batch of DoP ``d`` has ``d``, each homed on its own
instance, docs/design.md §5). The rows of a request that crosses into a later
sub-batch reach it as K/V through a :class:`~tokenlake.engines.exchange.LocalExchange`
(pass-KV; the module says why). :class:`ComputeEngine` computes an iteration's
sub-batches one after the other in this thread; :class:`ParallelComputeEngine` gives
every instance its own compute engine (a worker thread here, as the Ray deployment
gives every instance a compute actor), so the sub-batches of an iteration -- those of
one sequence-parallel batch included -- compute at the same time.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tokenlake.core.errors import EngineUnavailable
from tokenlake.core.plans import Batch, Plans, QueryPlan, TransferPlan
from tokenlake.dataplane.attend_layout import IN_PLACE_ENV, AttendLayout
from tokenlake.engines.exchange import LocalExchange
from tokenlake.kernels.attention import Partial, merge
from tokenlake.kernels.cpu import merge_single_token, partial_attention
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

    ``logits[request_id]`` is [vocab] float32, on the host, for the request's final new token.
    ``prefix_tokens[request_id]`` is how many tokens the pool served it (its hit).
    """

    logits: dict[str, torch.Tensor]
    prefix_tokens: dict[str, int]


@dataclass(frozen=True)
class _Layout:
    """The rows of one sub-batch: token ids, positions, per-request row ranges, and the
    requests it shares with its neighbours (see :mod:`tokenlake.engines.exchange`)."""

    ids: torch.Tensor
    positions: torch.Tensor
    rows_of: dict[str, tuple[int, int]]
    earlier: tuple[str, int, int] | None  # (first request, its rows before, its last row here)
    later: tuple[str, int, int] | None  # (last request, its rows [start, stop)) if it continues
    finished: tuple[str, ...]  # requests whose last new row is in this sub-batch
    decode: bool  # one row per request and none before: self-attention is the row itself

    @classmethod
    def of(cls, batch: Batch, qp: QueryPlan, device: torch.device | str = "cpu") -> _Layout:
        new = {r.request_id: r.new_token_ids for r in batch.requests}
        tokens: list[int] = []
        positions: list[int] = []
        rows_of = {}
        for s in qp.spans:
            first = s.position - s.prefix_tokens  # index among the request's new tokens
            tokens.extend(new[s.request_id][first : first + s.stop - s.start])
            positions.extend(range(s.position, s.position + s.stop - s.start))
            rows_of[s.request_id] = (s.start, s.stop)
        head, tail = qp.spans[0], qp.spans[-1]
        before = head.position - head.prefix_tokens
        earlier = (head.request_id, before, head.stop) if before else None
        continues = tail.position + tail.stop - tail.start < tail.prefix_tokens + len(new[tail.request_id])
        later = (tail.request_id, tail.start, tail.stop) if continues else None
        finished = tuple(s.request_id for s in qp.spans if not (continues and s is tail))
        decode = earlier is None and len(tokens) == len(qp.spans)
        return cls(torch.tensor(tokens, dtype=torch.long, device=device),
                   torch.tensor(positions, dtype=torch.long, device=device),
                   rows_of, earlier, later, finished, decode)


class _InPlace:
    """A sub-batch's prefix attention over slabs this process holds (a CPU pool on this
    machine): the plan's items laid out once, as the query engine lays them out, and
    attended here with the same kernel, no hand-off; and, for a few rows, their store.
    The plans in flight hold their slots (the serving loop commits or aborts them after
    the iteration), exactly as they do for the engines' reads and writes; an instance
    leaves the pool only between iterations (the serving loop's ``recover``), so no
    slab read here is zeroed under the read (the query engine checks that per query)."""

    def __init__(self, by_instance: dict, slab_of: Callable[[int], torch.Tensor]) -> None:
        """``by_instance``: the plan's items per instance (``QueryPlan.tasks_by_instance``)."""
        self.layout = AttendLayout.of(by_instance)
        self.slabs = [slab_of(inst) for inst in by_instance]
        self.slab_of = slab_of
        self.ask: tuple[torch.Tensor, int] | None = None

    def wait(self, timeout_s: float | None = None) -> Partial:
        q, layer = self.ask
        return Partial(*self.layout.attend(q.float(), layer, self.slabs, q.shape[1]))

    def store(self, tp: TransferPlan, kv: torch.Tensor) -> None:
        """Every layer of the plan's rows of ``kv`` ``[layers, rows, 2, kv_heads,
        head_dim]`` written into their slots, as the transfer engine's put writes them
        (a plan with page copies is left to it)."""
        for p in tp.puts:
            slot = self.slab_of(p.instance)[p.slot]  # [layers, 2, kv_heads, C, head_dim]
            slot[:, :, :, p.offset : p.offset + p.stop - p.start].copy_(kv[:, p.start : p.stop].permute(0, 2, 3, 1, 4))


class ComputeEngine:
    """Runs iterations of a Llama model whose prefix attention is served by the pool.

    The model runs where its weights are (``weights.placed("cuda", torch.bfloat16)``: on
    the GPU, writing q and the new K/V into the instance's CUDA IPC buffers); logits come
    back on the host.

    ``on_query``, when set, is called with the seconds each layer's pool queries took,
    from sending the first to receiving the last partial (a service's metrics).
    :meth:`run` computes the sub-batches one after the other (``parallel = False``)."""

    parallel = False

    def __init__(self, weights: LlamaWeights, cluster) -> None:
        self.w = weights
        self.cfg = weights.config
        self.cluster = cluster
        self.on_query: Callable[[float], None] | None = None
        self._copies: dict[torch.device, LlamaWeights] = {self.w.device: self.w}  # per GPU (_weights_at)
        self._placing = threading.Lock()
        #: called with each layer's number before its K/V are put and its queries sent
        #: (the serving loop waits there for a promotion's layer: generation/tier_reads.py)
        self.layer_gate: Callable[[int], None] | None = None

    def run(self, plans: Plans, batches: Sequence[Batch], exchange: LocalExchange | None = None) -> IterationOutput:
        """Computes the sub-batches in ``plans`` (all of an iteration's, or those homed
        on one instance); returns when every put of them is stored."""
        exchange = LocalExchange() if exchange is None else exchange
        logits: dict[str, torch.Tensor] = {}
        prefix: dict[str, int] = {}
        homes = []
        for qp, tp in sorted(zip(plans.query_plans, plans.transfer_plans), key=lambda p: (p[0].batch, p[0].part)):
            out = self.run_part(batches[qp.batch], qp, tp, exchange)
            logits.update(out)
            prefix.update((s.request_id, s.prefix_tokens) for s in qp.spans if s.request_id not in prefix)
            homes.append(qp.home)
        for home in dict.fromkeys(homes):
            self.cluster.client(home).wait_puts()
        return IterationOutput(logits, prefix)

    def run_part(self, batch: Batch, qp: QueryPlan, tp: TransferPlan,
                 exchange: LocalExchange) -> dict[str, torch.Tensor]:
        """One sub-batch on its home's client; returns the logits of the requests whose
        last new row it computed. Its puts are sent, not waited for. If it fails, the
        ``exchange`` is told, so that no later sub-batch waits for its rows."""
        try:
            return self._run_part(batch, qp, tp, exchange)
        except BaseException as exc:
            exchange.fail(exc)
            with contextlib.suppress(Exception):  # no write of this part lands after the abort
                self.cluster.client(qp.home).wait_puts()
            raise

    def _weights_at(self, home: int) -> LlamaWeights:
        """The weights to compute ``home``'s sub-batches with: on a pool spread over
        several GPUs (``layout.gpus``), a copy on ``home``'s GPU, made once per GPU (its
        buffers are there: no copy between GPUs at every layer); else the engine's own."""
        layout = getattr(self.cluster, "layout", None)
        if self.w.device.type != "cuda" or layout is None or layout.gpus <= 1:
            return self.w
        device = torch.device(layout.device_of("q", home))
        with self._placing:
            if device not in self._copies:
                self._copies[device] = self.w.placed(device, self.w.dtype)
            return self._copies[device]

    def _in_place(self, qp: QueryPlan, tp: TransferPlan) -> _InPlace | None:
        """The sub-batch's prefix attended in this process where the cluster's slabs are
        all here (a CPU ``LocalCluster`` with ``share_slabs``: its driver maps them),
        unless ``TOKENLAKE_QUERY_IN_PLACE=0``; else None: asked of the query engine.
        A dead engine of an instance the sub-batch touches is ``EngineUnavailable`` all
        the same, as it is on the engines' path (the serving loop then replaces it)."""
        if not getattr(self.cluster, "share_slabs", False) or os.environ.get(IN_PLACE_ENV, "1") == "0":
            return None
        by_instance = qp.tasks_by_instance()
        for inst in sorted({qp.home, *by_instance, *(p.instance for p in tp.puts)}):
            for role in ("query", "transfer"):
                if not self.cluster.alive(role, inst):
                    raise EngineUnavailable(f"the {role} engine of instance {inst} is not running")
        return _InPlace(by_instance, self.cluster.slab)

    def _run_part(self, batch, qp, tp, exchange) -> dict[str, torch.Tensor]:
        w = self._weights_at(qp.home)
        lay = _Layout.of(batch, qp, w.device)
        client = self.cluster.client(qp.home)
        here = self._in_place(qp, tp) if w.device.type == "cpu" else None  # (CPU slabs, CPU q)
        coalesce = lay.ids.numel() <= COALESCE_PUT_ROWS
        # a few rows (decode, a short chunk): stored here too, no hand-off
        store_here = here is not None and coalesce and not tp.copies
        # registered without waiting: the first query or put reads the engines' replies
        q_buf, kv_buf = client.init_plans(None if here is not None else qp, None if store_here else tp, wait=False)
        if store_here:
            kv_buf = client.kv.new_empty((self.cfg.num_layers, tp.num_rows, *client.kv.shape[2:]))
        buf = (client, q_buf, kv_buf, here)
        hidden = llama.embed(w, lay.ids)
        rope = llama.rope_tables(self.cfg, lay.positions)
        kv_dtype = buf[2].dtype  # the pool's: new rows attend as the pool will store them
        for layer in range(self.cfg.num_layers):
            if lay.decode and here is None:  # the query engine wakes while q is computed (doorbell.py heads-up)
                client.expect_query()
            q, k, v = llama.qkv(w, layer, hidden, lay.positions, rope=rope)
            k, v = llama.stored_kv(k, v, kv_dtype)
            if lay.later is not None:
                rid, a, z = lay.later
                exchange.publish(qp.batch, qp.part, layer, rid, k[a:z], v[a:z])
            attn = self._attention(layer, q, k, v, buf, lay, exchange, qp, put=not coalesce)
            hidden = llama.finish_layer(w, layer, hidden, attn)
        if store_here:
            here.store(tp, kv_buf)
        elif coalesce:
            client.put(0, self.cfg.num_layers)
        if not lay.finished:
            return {}
        out = llama.logits(w, hidden[[lay.rows_of[rid][1] - 1 for rid in lay.finished]]).cpu()
        return {rid: out[i] for i, rid in enumerate(lay.finished)}

    def _attention(self, layer, q, k, v, buf, lay: _Layout, exchange, qp, put: bool = True) -> torch.Tensor:
        """Pool prefix attention merged with attention over the request's rows in earlier
        sub-batches and causal self-attention over the new rows here. ``put=False``
        only writes the new K/V into ``kv_buf`` (the caller puts later)."""
        client, q_buf, kv_buf, here = buf
        if self.layer_gate is not None:  # (page copies from a promoted slot go with the puts)
            self.layer_gate(layer)
        kv_buf[layer, :, 0].copy_(k)
        kv_buf[layer, :, 1].copy_(v)
        if put:  # puts first: they overlap the query
            client.put(layer)
        sent = time.perf_counter()
        if here is None:
            q_buf.copy_(q)
            handle = client.query_async(layer)
        else:  # attended when waited for (after this part's own attention)
            here.ask, handle = (q, layer), here
        if lay.decode:  # one new token each (no earlier rows), merged with the prefix
            return merge_single_token(*self._pool_partial(handle, sent, q), q, k, v).to(q.dtype)
        own = [(a, z, partial_attention(q[a:z], k[a:z], v[a:z], causal=True)) for a, z in lay.rows_of.values()]
        if lay.earlier is not None:  # the first request's rows in earlier sub-batches
            rid, before, z = lay.earlier
            ek, ev = exchange.collect(qp.batch, qp.part, layer, rid, before)
            eo, else_ = partial_attention(q[:z], ek, ev)
            a, z, (so, slse) = own[0]  # the first request's rows: [0, z)
            own[0] = (a, z, merge(so, slse, eo, else_))
        po, plse = self._pool_partial(handle, sent, q)
        out = torch.empty_like(q)
        for a, z, (so, slse) in own:
            out[a:z], _ = merge(po[a:z], plse[a:z], so, slse)
        return out

    def _pool_partial(self, handle, sent: float, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's partial of a layer's query, on ``q``'s device (no copy unless the
        pool is on a GPU)."""
        part = handle.wait()
        if self.on_query is not None:
            self.on_query(time.perf_counter() - sent)
        return part.o.to(q.device), part.lse.to(q.device)


class ParallelComputeEngine(ComputeEngine):
    """One compute engine per instance, in one process: every instance's sub-batches
    run in a worker thread of their own (torch releases the interpreter lock in its
    kernels), so the sub-batches of an iteration compute at the same time, those of a
    sequence-parallel batch exchanging K/V as they go. Sub-batches that share a home
    run one after the other in (batch, part) order (which cannot deadlock: a sub-batch
    waits only for earlier parts of its own batch). ``parallel = True``: a
    :class:`~tokenlake.generation.Server` gives the policy one compute slot per instance.
    """

    parallel = True

    def __init__(self, weights: LlamaWeights, cluster, timeout_s: float = 60.0) -> None:
        super().__init__(weights, cluster)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=cluster.n_instances, thread_name_prefix="compute")

    def run(self, plans: Plans, batches: Sequence[Batch], exchange: LocalExchange | None = None) -> IterationOutput:
        exchange = LocalExchange(self.timeout_s) if exchange is None else exchange
        by_home: dict[int, list[tuple[QueryPlan, TransferPlan]]] = {}
        for qp, tp in zip(plans.query_plans, plans.transfer_plans):
            by_home.setdefault(qp.home, []).append((qp, tp))
        futures = {home: self._pool.submit(self._run_home, parts, batches, exchange)
                   for home, parts in by_home.items()}
        logits: dict[str, torch.Tensor] = {}
        prefix: dict[str, int] = {}
        error: BaseException | None = None
        for fut in futures.values():  # every worker finishes before the caller aborts or completes
            try:
                out = fut.result()
            except BaseException as exc:  # noqa: BLE001 - the first failure is raised below
                error = error or exc
                continue
            logits.update(out.logits)
            for rid, n in out.prefix_tokens.items():
                prefix.setdefault(rid, n)
        if error is not None:  # the first sub-batch that failed, not one that waited for it
            raise exchange.error or error
        return IterationOutput(logits, prefix)

    def _run_home(self, parts, batches, exchange) -> IterationOutput:
        sub = Plans(0, tuple(qp for qp, _ in parts), tuple(tp for _, tp in parts), ())
        return ComputeEngine.run(self, sub, batches, exchange)

    def close(self) -> None:
        """Stops the worker threads (after the iteration in progress)."""
        self._pool.shutdown(wait=True)
