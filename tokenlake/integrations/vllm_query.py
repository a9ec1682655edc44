"""The query mode of :mod:`tokenlake.integrations.vllm`: vLLM's attention over the pooled
prefix computed in the pool, as TokenLake's own engines do it.

In the connector's load mode the pool is a store of vLLM's pages, copied into vLLM's
blocks before the forward pass. In the query mode (``"mode": "query"`` in the
connector's extra config, a pool served with ``--kv-layout hf``) nothing is copied back:
vLLM keeps no KV of its own, every token's K/V goes to the pool (``put``, layer by layer,
as each attention layer runs) and each attention layer sends its q rows to the pool
(``query``), which attends over the request's earlier tokens where their segments live
and merges the partials; vLLM's side attends over this step's new tokens only, and the
two partial results are merged exactly by log-sum-exp.

On the pool's machine the worker attends the plan's slots itself instead, from the
slabs it maps (:class:`~tokenlake.integrations.vllm_slabs.SlabMaps`), with the query
engines' own layout and kernel: no hand-off per layer. The step's commit proves the slots
held the plan's segments throughout; a step read in place whose commit fails keeps no
output (docs/vllm.md "Attending in place").

vLLM (0.32, CPU) always picks its ``CPU_ATTN`` backend, and lets an out-of-tree package
replace a backend's class (``register_backend`` in
``vllm/v1/attention/backends/registry.py``). :func:`tokenlake.integrations.vllm_plugin.register`
does that from a ``vllm.general_plugins`` entry point (declared in ``pyproject.toml``),
which vLLM runs in every process it starts; :class:`TokenLakeAttentionImpl` is ``CPU_ATTN``'s own
implementation, unchanged, unless the engine's KV-transfer config names the TokenLake
connector in query mode.

Which rows are whose: vLLM orders a step's requests its own way; the connector's
scheduler side names, for each request it planned, the vLLM block that holds the
request's first new token (``QueryStep.anchors``), and the worker reads that block from
the slot mapping of each request's first token. A block holding a not yet computed token
belongs to one request (vLLM shares only full, cached blocks, and the query mode runs with
vLLM's own prefix cache off).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ClassVar

import torch

from tokenlake.core.errors import ConfigError, TokenLakeError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.dataplane.attend_layout import IN_PLACE_ENV
from tokenlake.integrations.vllm_meta import FailedRequests, QueryStep, TokenLakeMetadata
from tokenlake.integrations.vllm_mode import PoolRequests, VllmPool
from tokenlake.integrations.vllm_query_step import StepState
from tokenlake.integrations.vllm_slabs import SlabMaps

log = logging.getLogger(__name__)
_told_executor: list[str] = []  # the executor warning is given once per process

class QueryStrategy:
    """The query mode (see the module): a :class:`~tokenlake.integrations.vllm_mode.ModeStrategy`."""

    layout: ClassVar[str] = "hf"  # K/V rows [tokens, 2, kv_heads, head_dim], Hugging Face order
    holds: ClassVar[str] = "vLLM's K/V rows"

    def __init__(self, pool: VllmPool, requests: PoolRequests) -> None:
        self.pool, self.requests = pool, requests
        # scheduler side
        self._live: dict[str, Any] = {}  # request id -> vLLM's live Request
        self._external: dict[str, int] = {}  # pooled tokens vLLM never computed
        self._local: set[str] = set()  # requests vLLM attends alone
        self.pooled_tokens = 0  # prefix tokens found in the pool
        # worker side
        self._step: StepState | None = None  # this step's plans and buffers
        self._failed_requests: set[str] = set()  # to report to the scheduler side
        self._load_errors: set[int] = set()
        self._slabs = SlabMaps(pool.cp, IN_PLACE_ENV, "the query mode attends", home=pool.home)

    @staticmethod
    def check_vllm(vllm_config) -> None:
        """The query mode keeps no KV in vLLM's blocks: vLLM's own prefix cache would
        match empty blocks, and a step must finish before the next is planned."""
        cache = getattr(vllm_config, "cache_config", None)
        if getattr(cache, "enable_prefix_caching", False):
            raise ConfigError("the query mode keeps vLLM's KV in the pool, not in its blocks: "
                              "start vLLM with --no-enable-prefix-caching")
        sched = getattr(vllm_config, "scheduler_config", None)
        if getattr(sched, "async_scheduling", False):
            raise ConfigError("the query mode plans each step after the previous one "
                              "completed: start vLLM with --no-async-scheduling")
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ConfigError("the query mode does not support speculative decoding")
        parallel = getattr(vllm_config, "parallel_config", None)
        backend = getattr(parallel, "distributed_executor_backend", None)
        if backend not in (None, "uni") and not _told_executor:
            _told_executor.append(backend)
            log.warning("query mode: vLLM runs its model in a worker process (executor %r); its "
                        "engine core busy-waits for it and takes a core the pool's query "
                        "engines need on a small host. Consider --distributed-executor-backend "
                        "uni with VLLM_ENABLE_V1_MULTIPROCESSING=0 and OMP_WAIT_POLICY=PASSIVE "
                        "(docs/vllm.md, 'Sharing the cores')", backend)

    @staticmethod
    def check_segments(segment_tokens: int, block_size: int) -> None:
        """Any segment size: the pool holds rows, not vLLM blocks."""

    # ------------------------------------------------------------ scheduler side
    def rematch(self, request_id: str) -> None:
        """Preempted by vLLM and scheduled again: it starts over in the pool."""
        self.requests.release(request_id)
        self._local.discard(request_id)
        self._external.pop(request_id, None)

    def allocated(self, request, num_external_tokens: int) -> None:
        """Leases the prefix (it is attended where it lives; vLLM's blocks for it stay
        empty); a prefix the pool no longer holds is computed by vLLM (build_meta)."""
        rid = request.request_id
        self._live[rid] = request
        if num_external_tokens <= 0 or self.requests.lease(rid) is None:
            return
        hit = self.requests.hits.get(rid, 0)
        self._external[rid] = hit  # tokens vLLM's blocks do not hold
        self.pooled_tokens += hit

    def build_meta(self, scheduler_output, done: dict[str, int]) -> TokenLakeMetadata:
        meta = TokenLakeMetadata()
        meta.query = self._plan_query(scheduler_output, done, meta)
        return meta

    def _plan_query(self, scheduler_output, done: dict[str, int], meta: TokenLakeMetadata) -> QueryStep:
        """One sub-batch at this instance with the new tokens of every scheduled request
        the pool serves. A request whose computed tokens are not what the pool holds for
        it (a failed step, a prefix evicted before its lease) leaves the pool: if vLLM
        computed all its tokens itself, vLLM attends over its own blocks from then on; if
        part of them was only in the pool, its first block is reported as a load error,
        so vLLM discards this step's output and computes it again."""
        reqs, anchors, first, last, external = [], {}, {}, {}, set()
        requests, bs = self.requests, self.pool.block_size
        for rid, upto in done.items():
            n = scheduler_output.num_scheduled_tokens[rid]
            start = upto - n
            blocks = requests.blocks.get(rid, [])
            request = self._live.get(rid)
            if rid in self._local or request is None or not blocks:
                continue
            if rid in requests.admitted and requests.pool_len.get(rid, 0) != start:
                requests.release(rid)  # what the pool holds for it is not what vLLM computed
            if start == 0:
                self._external.pop(rid, None)  # computed from the start: vLLM holds it all
            elif rid not in requests.admitted:
                if self._external.pop(rid, 0):
                    meta.failed_blocks.append(blocks[0])
                    log.info("request %s: its pooled prefix is gone; computed again", rid)
                else:
                    self._local.add(rid)
                    log.info("request %s: attended by vLLM alone from now on", rid)
                continue
            tokens = list(request.all_token_ids[start:upto])
            if len(tokens) != n:
                raise TokenLakeError(f"request {rid}: {n} tokens scheduled, {len(tokens)} known")
            reqs.append(BatchRequest(rid, tuple(tokens), cache_salt=requests.salt_of(request)))
            anchors[blocks[start // bs]] = rid
            first[rid] = blocks[0]
            if start > 0:
                last[rid] = blocks[(start - 1) // bs]
            if self._external.get(rid, 0):
                external.add(rid)
        if not reqs:
            return QueryStep(None)
        return self._plan(reqs, anchors, (first, last), external, meta)

    def _plan(self, reqs: list[BatchRequest], anchors: dict[int, str], blocks: tuple[dict, dict],
              external: set[str], meta: TokenLakeMetadata) -> QueryStep:
        """The step's plans for ``reqs``; where the pool cannot plan them, they leave it
        (and the ``external`` ones are computed again). ``blocks``: each request's first
        block and the block of its last token before this step."""
        first, last = blocks
        phase = "decode" if all(len(r.new_token_ids) == 1 for r in reqs) else "prefill"
        cp = self.pool.cp
        try:
            plans = cp.gen_plans([Batch(tuple(reqs), phase)], [1], homes=[self.pool.home])
        except TokenLakeError as e:  # nothing reaches the pool this step
            log.warning("query mode: this step cannot be planned in the pool (%s)", e)
            for r in reqs:
                self.requests.release(r.request_id)
            meta.failed_blocks += [first[rid] for rid in external]
            for rid in external:
                self._external.pop(rid, None)
            return QueryStep(None)
        for r in reqs:
            self.requests.admit(r.request_id, len(r.new_token_ids))
        return QueryStep(plans, anchors, first, frozenset(external), cp.plan_grants(plans), last)

    def step_output(self, connector_output) -> None:
        failed = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(failed, FailedRequests):
            for rid in failed.request_ids:  # the pool did not take the step: start over
                self.requests.release(rid)

    def finished(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self._external.pop(request_id, None)
        self._local.discard(request_id)

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, caches: dict[int, torch.Tensor], vllm_config) -> None:
        """vLLM's attention layers must run TokenLake's backend (the
        ``vllm.general_plugins`` entry point installs it); its blocks are not read here."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(vllm_config, Attention)
        plain = [name for name, layer in layers.items()
                 if not getattr(layer.impl, "tokenlake_query", False)]
        if plain:
            raise ConfigError(f"query mode: {len(plain)} attention layers (e.g. {plain[0]}) do "
                              "not run TokenLake's backend; is the 'tokenlake_query_mode' "
                              "vLLM plugin installed and allowed (VLLM_PLUGINS)?")

    def start_load_kv(self, meta: TokenLakeMetadata) -> None:
        """Nothing: the pool attends over the prefix, nothing is loaded."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Nothing to wait for (see :meth:`start_load_kv`)."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, meta: TokenLakeMetadata | None) -> None:
        """Nothing: :meth:`attend` put the layer's new K/V already."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata, scale: float, meta: TokenLakeMetadata | None):
        """One attention layer of this step (called by the query-mode backend): the new
        K/V put into the pool, q sent to it, merged with attention over the new tokens."""
        step = meta.query if meta is not None else None
        if self._step is None or step is None or self._step.step is not step:
            # a new step (or a warm-up pass without metadata: attention over its own tokens)
            step = step if step is not None else QueryStep(None)
            client, cp, home = None, self.pool.cp, self.pool.home
            if step.plans is not None:
                try:
                    cp.adopt_grants(step.plans, step.grants)  # the scheduler side's
                    client = cp.client(home)
                except Exception as e:
                    log.warning("query mode: cannot reach pool instance %d: %s", home, e)
            self._step = StepState(step, client, self.pool.block_size, cp.timeout_s, self._slabs)
        return self._step.attend(layer, q, k, v, attn_metadata, scale)

    def wait_for_save(self, meta: TokenLakeMetadata | None) -> None:
        """After the forward pass: wait for the puts and commit the step's plans, or,
        when anything failed, abort them and make vLLM compute the affected requests."""
        state, self._step = self._step, None
        step = meta.query if meta is not None else None
        if step is None or step.plans is None:
            return
        if state is not None and state.step is not step:
            state = None
        failed = state is None or state.failed
        if not failed:
            try:
                state.finish()
                self.pool.cp.complete(step.plans)
            except Exception as e:
                state.fail(e)
                failed = True
        if failed:
            if state is not None and state.client is not None:  # no put may still write
                with contextlib.suppress(Exception):  # into slots the abort frees (a dead
                    state.client.wait_puts(self.pool.cp.timeout_s)  # engine: at once)
            try:
                self.pool.cp.abort(step.plans)
            except Exception as e:
                log.warning("query mode: aborting the step's plans failed: %s", e)
            requests = {s.request_id for qp in step.plans.query_plans for s in qp.spans}
            self._failed_requests |= requests
            self._load_errors.update(step.first_block[rid] for rid in step.external)
            if state is not None and state.read_in_place:
                # read in place: only a commit proves the slots held the plan's segments
                # throughout, so no output of this step is kept; vLLM computes each
                # request again from its last block it computed itself
                log.warning("query mode: a step read in place was not committed; vLLM drops "
                            "its output for %d requests and computes them again", len(requests))
                self._load_errors.update(step.last_block[rid] for rid in requests - step.external
                                         if rid in step.last_block)

    def worker_meta(self) -> FailedRequests | None:
        if not self._failed_requests:
            return None
        failed, self._failed_requests = frozenset(self._failed_requests), set()
        return FailedRequests(failed)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Unmaps the slabs (its client is the session's)."""
        self._slabs.close()
