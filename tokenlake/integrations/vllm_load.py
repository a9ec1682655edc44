"""The load mode of :mod:`tokenlake.integrations.vllm`: the pool holds vLLM's pages.

The pool holds vLLM's KV pages as they are: a segment of ``C`` tokens is ``C /
block_size`` vLLM blocks of one layer each, copied byte for byte (the CPU kernels may pack
a block's K, so a block is opaque here). The pool's namespace must be the ``vllm-cpu``
layout and ``C`` a multiple of vLLM's block size; the connector refuses other pools.

Scheduler side: a request whose prompt the pool holds beyond vLLM's own prefix cache has
that hit leased when vLLM allocates its blocks, and the step's metadata names the
``(instance, slot)`` of each leased segment and the blocks it fills (a :class:`Load`);
every step, the prompt segments that step completes are planned for storing
(``gen_plans``, one sub-batch at the connector's instance). Worker side: the loads are
copied into vLLM's blocks layer by layer (:class:`~tokenlake.integrations.vllm_reads.PageLoader`:
in place from a mapped slab, or by message); ``save_kv_layer`` copies the completed
segments' pages into the home instance's shared ``kv`` buffer and puts the layer
(asynchronous); ``wait_for_save`` waits and commits the plans (``complete``).
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from tokenlake.core.errors import ConfigError, TokenLakeError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.integrations.vllm_meta import Load, Store, TokenLakeMetadata
from tokenlake.integrations.vllm_mode import PoolRequests, VllmPool
from tokenlake.integrations.vllm_reads import PageLoader

log = logging.getLogger(__name__)


class LoadStrategy:
    """The load mode (see the module): a :class:`~tokenlake.integrations.vllm_mode.ModeStrategy`."""

    layout: ClassVar[str] = "vllm-cpu"  # vLLM's pages, opaque
    holds: ClassVar[str] = "vLLM's pages"

    def __init__(self, pool: VllmPool, requests: PoolRequests) -> None:
        self.pool, self.requests = pool, requests
        # scheduler side: what the next step's metadata carries
        self._loads: list[Load] = []
        self._failed: list[int] = []  # blocks of hits the pool no longer held (vLLM computes them)
        # worker side
        self.loader = PageLoader(pool.cp, pool.per_seg, pool.block_size)
        self._puts: list = []  # this step's puts in flight
        self._kv_buf: torch.Tensor | None = None  # this step's rows of the home's kv buffer
        self.stored_tokens = 0

    @property
    def loaded_tokens(self) -> int:
        return self.loader.loaded_tokens

    @staticmethod
    def check_vllm(vllm_config) -> None:
        """Any vLLM configuration: the pages are copied in, then vLLM runs as usual."""

    @staticmethod
    def check_segments(segment_tokens: int, block_size: int) -> None:
        if segment_tokens % block_size:
            raise ConfigError(f"the pool's segments ({segment_tokens} tokens) are not whole vLLM "
                              f"blocks of {block_size}: serve it with --segment-tokens "
                              f"{block_size} (or a multiple)")

    # ------------------------------------------------------------ scheduler side
    def rematch(self, request_id: str) -> None:
        """Nothing: a preempted request keeps its leases and what it stored."""

    def allocated(self, request, num_external_tokens: int) -> None:
        """Leases the hit and records the load of the blocks vLLM did not compute itself;
        a hit the pool no longer holds makes vLLM compute those blocks."""
        if num_external_tokens <= 0:
            return
        rid, bs, C = request.request_id, self.pool.block_size, self.pool.segment_tokens
        hit = self.requests.hits.get(rid, 0)
        blocks = self.requests.blocks[rid]
        start = hit - num_external_tokens
        locs = self.requests.lease(rid)
        if locs is None:  # evicted since the match
            self._failed += blocks[start // bs: hit // bs]
            return
        first = start // C
        segs = [(loc.instance, loc.slot) for loc in locs[first:]]
        skip = (start - first * C) // bs
        per_seg = self.pool.per_seg
        per = [blocks[i * per_seg:(i + 1) * per_seg] for i in range(first, hit // C)]
        self._loads.append(Load(rid, segs, per, skip, self.pool.cp.lease_grants(rid)))

    def build_meta(self, scheduler_output, done: dict[str, int]) -> TokenLakeMetadata:
        meta = TokenLakeMetadata(self._loads, self._failed)
        self._loads, self._failed = [], []
        meta.store = self.plan_store(done)
        return meta

    def plan_store(self, done: dict[str, int]) -> Store | None:
        """One sub-batch storing the prompt segments completed by this step (``done``:
        each request's tokens with KV after it), at most the pool's ``max_rows`` tokens."""
        reqs, rows = [], []
        budget, C, bs = self.pool.max_rows, self.pool.segment_tokens, self.pool.block_size
        for rid, upto in done.items():
            prompt = self.requests.prompts.get(rid)
            if prompt is None:
                continue
            have = self.requests.pool_len.get(rid, 0)
            end = min(upto, len(prompt)) // C * C
            end = min(end, have + budget // C * C)
            if end <= have:
                continue
            prefix = () if rid in self.requests.admitted else tuple(prompt[:have])
            reqs.append(BatchRequest(rid, tuple(prompt[have:end]), prefix, self.requests.salt(rid)))
            rows.append((rid, self.requests.blocks[rid][have // bs: end // bs]))
            budget -= end - have
        if not reqs:
            return None
        cp = self.pool.cp
        try:
            plans = cp.gen_plans([Batch(tuple(reqs))], [1], homes=[self.pool.home])
        except TokenLakeError as e:  # a full pool, an evicted prefix: this step stores nothing
            log.info("not storing this step's segments: %s", e)
            return None
        for r in reqs:
            self.requests.admit(r.request_id, len(r.new_token_ids))
        return Store(plans, rows, cp.plan_grants(plans))

    def step_output(self, connector_output) -> None:
        """Nothing: a failed load or store is handled by the worker side alone."""

    def finished(self, request_id: str) -> None:
        """Nothing of the mode's own (its loads were handed over at the step's metadata)."""

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, caches: dict[int, torch.Tensor], vllm_config) -> None:
        self.loader.caches.update(caches)

    def start_load_kv(self, meta: TokenLakeMetadata) -> None:
        self.loader.start(meta.loads)

    def wait_for_layer_load(self, layer: int) -> None:
        if self.loader.pending:
            self.loader.receive_layer(layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, meta: TokenLakeMetadata | None) -> None:
        """The store plan's pages of ``layer`` (``[blocks, kv_heads, block_size, 2 *
        head_dim]`` each) into the home's kv buffer as rows, then put (asynchronous)."""
        if meta is None or meta.store is None:
            return
        cp = self.pool.cp
        (tp,) = meta.store.plans.transfer_plans
        cp.adopt_grants(meta.store.plans, meta.store.grants)  # the scheduler side's
        client = cp.client(tp.home)
        if self._kv_buf is None:
            self._kv_buf = client.init_transfer(tp)
        row = 0
        for _rid, blocks in meta.store.rows:
            n = len(blocks) * self.pool.block_size
            pages = kv_layer[blocks]  # [blocks, kv_heads, block_size, 2 * head_dim]
            self._kv_buf[layer, row:row + n] = pages.reshape(n, *self._kv_buf.shape[2:])
            row += n
        self._puts.append(client.put(layer))

    def wait_for_save(self, meta: TokenLakeMetadata | None) -> None:
        """Every layer still owed to vLLM's blocks, then the step's puts waited for and
        its store plan committed; a store that fails is aborted (nothing of it becomes
        visible)."""
        self.loader.finish()
        puts, self._puts, self._kv_buf = self._puts, [], None
        if meta is None or meta.store is None:
            return
        plans, cp = meta.store.plans, self.pool.cp
        try:
            for handle in puts:
                handle.wait()
            cp.complete(plans)
            self.stored_tokens += sum(len(b) for _, b in meta.store.rows) * self.pool.block_size
        except Exception as e:
            log.warning("storing this step's segments failed: %s", e)
            try:
                cp.abort(plans)
            except TokenLakeError:
                pass

    def attend(self, layer, q, k, v, attn_metadata, scale, meta) -> None:
        """None: vLLM attends over its own blocks, into which the prefix was loaded."""
        return None

    def worker_meta(self) -> None:
        return None

    def take_load_errors(self) -> set[int]:
        return self.loader.take_errors()

    def close(self) -> None:
        self.loader.close()
