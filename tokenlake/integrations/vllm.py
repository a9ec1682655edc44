"""``TokenLakeConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on a TokenLake pool.

    python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config \\
      '{"kv_connector": "TokenLakeConnector", "kv_connector_module_path":
        "tokenlake.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy":
        "recompute", "kv_connector_extra_config": {"address": "tcp://127.0.0.1:7400"}}'

against a pool served with ``tokenlake serve --kv-layout vllm-cpu --segment-tokens 128``
(docs/vllm.md). Extra config: ``address`` (required), ``credentials`` (the file ``tokenlake
serve`` wrote; default: the one for that port on this machine), ``timeout_s``, ``instance``
(the pool instance whose buffers this vLLM instance writes: give each vLLM instance its
own; default 0) and ``mode``: ``"load"`` (default, below) or ``"query"``
(:mod:`tokenlake.integrations.vllm_query`: the pooled prefix is attended in the pool,
never copied into vLLM; a pool served with ``--kv-layout hf``, vLLM run with
``--no-enable-prefix-caching``).

The pool holds vLLM's KV pages as they are: a segment of ``C`` tokens is ``C /
block_size`` vLLM blocks of one layer each, copied byte for byte (the CPU kernels may pack
a block's K, so a block is opaque here). The pool's namespace must be the ``vllm-cpu``
layout and ``C`` a multiple of vLLM's block size; the connector refuses other pools.

Scheduler side: a prompt is matched in the pool (whole segments); the segments beyond
vLLM's own prefix cache are leased (``lease_prefix``) and their ``(instance, slot)`` sent
to the worker; every step, the prompt segments that step completes are planned for storing
(``gen_plans``, one sub-batch) and finishing a request releases its leases.
Worker side: ``start_load_kv`` reads the leased slots (``READ_SEGMENT`` to each instance's
transfer engine, layer by layer) into the request's blocks; a load that fails reports its
blocks as load errors, so vLLM computes them. ``save_kv_layer`` copies the completed
segments' pages into the home instance's shared ``kv`` buffer and puts the layer
(asynchronous); ``wait_for_save`` waits and commits the plans (``complete``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from tokenlake.core.errors import ConfigError, TokenLakeError
from tokenlake.core.plans import Batch, BatchRequest, Plans
from tokenlake.dataplane import wire
from tokenlake.dataplane.auth import ClusterKeys, connect_secure
from tokenlake.dataplane.messages import ReadSegment, SegmentData, expect
from tokenlake.dataplane.sockets import send
from tokenlake.integrations.vllm_query import FailedRequests, QueryStep, StepState
from tokenlake.service.remote import connect

log = logging.getLogger(__name__)

LAYOUT = "vllm-cpu"  # load mode: vLLM's pages, opaque
QUERY_LAYOUT = "hf"  # query mode: K/V rows [tokens, 2, kv_heads, head_dim], Hugging Face order
MODES = ("load", "query")
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass
class Load:
    """Blocks of one request to fill from the pool: per segment, its ``(instance, slot)``
    and the vLLM block ids it fills (the blocks vLLM computed itself are left alone:
    ``skip`` leading blocks of the first segment)."""

    request_id: str
    segments: list[tuple[int, int]]
    blocks: list[list[int]]
    skip: int = 0


@dataclass
class Store:
    """This step's plan for storing completed segments: ``rows`` lists, in the plan's
    row order, each request's block ids whose pages fill its rows."""

    plans: Plans
    rows: list[tuple[str, list[int]]]


@dataclass
class TokenLakeMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    failed_blocks: list[int] = field(default_factory=list)  # loads refused by the pool
    store: Store | None = None
    query: QueryStep | None = None  # query mode: this step's plan


class TokenLakeConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if "address" not in extra:
            raise ConfigError("TokenLakeConnector needs kv_connector_extra_config.address")
        self.mode = extra.get("mode", "load")
        if self.mode not in MODES:
            raise ConfigError(f"kv_connector_extra_config.mode must be one of {MODES}, "
                              f"got {self.mode!r}")
        self.block_size = vllm_config.cache_config.block_size
        if self.mode == "query":
            self._check_query_mode(vllm_config)
        self.cp = connect(extra["address"], float(extra.get("timeout_s", 10.0)),
                          extra.get("credentials"))
        namespace, self.C = self.cp.layout()
        layout = QUERY_LAYOUT if self.mode == "query" else LAYOUT
        if not namespace.endswith("/" + layout):
            what = "vLLM's K/V rows" if self.mode == "query" else "vLLM's pages"
            raise ConfigError(f"the pool at {extra['address']} holds {namespace!r}, not {what}: "
                              f"serve it with --kv-layout {layout}")
        if self.mode == "load" and self.C % self.block_size:
            raise ConfigError(f"the pool's segments ({self.C} tokens) are not whole vLLM blocks "
                              f"of {self.block_size}: serve it with --segment-tokens "
                              f"{self.block_size} (or a multiple)")
        self.per_seg = max(1, self.C // self.block_size)
        self.home = extra.get("instance", 0)
        if type(self.home) is not int or self.home not in self.cp.instances:
            raise ConfigError(f"kv_connector_extra_config.instance must be one of the pool's "
                              f"instances {list(self.cp.instances)}, got {self.home!r}")
        # [layers, max_rows, 2, kv_heads, head_dim] of every instance's kv buffer
        kv_shape = tuple(self.cp.client_info(self.cp.instances[0]).buffers["kv"].shape)
        self._check_model(vllm_config, kv_shape, extra["address"])
        self.max_rows = kv_shape[1]  # most tokens one store plan can hold
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is not 'recompute': a request whose load from "
                        "the pool fails (a dead engine) ends with an error instead of being "
                        "computed; set \"kv_load_failure_policy\": \"recompute\"")
        # scheduler side
        self._hits: dict[str, int] = {}  # request -> pool hit (tokens) seen at matching
        self._pool_len: dict[str, int] = {}  # request -> its tokens the pool holds or stores
        self._admitted: set[str] = set()
        self._prompts: dict[str, list[int]] = {}
        self._blocks: dict[str, list[int]] = {}
        self._loads: list[Load] = []
        self._failed: list[int] = []
        # worker side
        self._caches: dict[int, torch.Tensor] = {}  # layer index -> its KV cache tensor
        self._clients: dict[int, Any] = {}
        self._socks: dict[int, Any] = {}
        self._puts: list = []
        self._load_errors: set[int] = set()
        self._kv_buf = None
        self.loaded_tokens = self.stored_tokens = 0
        # query mode
        self._requests: dict[str, Any] = {}  # scheduler: request id -> vLLM's live Request
        self._external: dict[str, int] = {}  # scheduler: pooled tokens vLLM never computed
        self._local: set[str] = set()  # scheduler: requests vLLM attends alone
        self._step: StepState | None = None  # worker: this step's plans and buffers
        self._failed_requests: set[str] = set()  # worker: reported to the scheduler side
        self.pooled_tokens = 0  # scheduler: prefix tokens found in the pool (query mode)

    @staticmethod
    def _check_model(vllm_config, kv_shape: tuple[int, ...], address: str) -> None:
        """Refuses a pool whose slabs hold another model's KV shape (layers, KV heads,
        head size): its pages would be read into this model's blocks."""
        hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        if hf is None:
            return
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        mine = (hf.num_hidden_layers, hf.num_key_value_heads, head_dim)
        pool = (kv_shape[0], kv_shape[3], kv_shape[4])
        if mine != pool:
            raise ConfigError(f"the pool at {address} holds KV of another model ({pool[0]} "
                              f"layers x {pool[1]} KV heads x {pool[2]}) than vLLM's ({mine[0]} "
                              f"x {mine[1]} x {mine[2]})")

    @staticmethod
    def _check_query_mode(vllm_config) -> None:
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

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.mode == "query":  # preempted by vLLM and scheduled again: start over
            self._release(request.request_id)
            self._local.discard(request.request_id)
            self._external.pop(request.request_id, None)
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) < 2:
            return 0, False
        hit = self.cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1).hit_tokens
        self._hits[request.request_id] = hit
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        self._prompts[rid] = list(request.prompt_token_ids or [])
        self._blocks[rid] = list(blocks.get_block_ids()[0])
        if self.mode == "query":
            self._requests[rid] = request
        if num_external_tokens <= 0:
            return
        hit = self._hits.get(rid, 0)
        if self.mode == "query":  # lease the prefix; it is attended where it lives
            try:
                self.cp.lease_prefix(rid, self._prompts[rid][:hit])
            except TokenLakeError as e:  # build_connector_meta makes vLLM compute it
                log.warning("request %s: the pool no longer holds its prefix (%s)", rid, e)
                return
            self._admitted.add(rid)
            self._pool_len[rid] = hit
            self._external[rid] = hit  # tokens vLLM's blocks do not hold
            self.pooled_tokens += hit
            return
        start = hit - num_external_tokens
        block_ids = self._blocks[rid][start // self.block_size: hit // self.block_size]
        try:
            locs = self.cp.lease_prefix(rid, self._prompts[rid][:hit])
        except TokenLakeError as e:  # evicted since the match: vLLM computes these blocks
            log.warning("request %s: the pool no longer holds its prefix (%s)", rid, e)
            self._failed += block_ids
            return
        self._admitted.add(rid)
        self._pool_len[rid] = hit
        first = start // self.C
        segs = [(loc.instance, loc.slot) for loc in locs[first:]]
        skip = (start - first * self.C) // self.block_size
        per = [self._blocks[rid][i * self.per_seg:(i + 1) * self.per_seg]
               for i in range(first, hit // self.C)]
        self._loads.append(Load(rid, segs, per, skip))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = TokenLakeMetadata(self._loads, self._failed)
        self._loads, self._failed = [], []
        done: dict[str, int] = {}  # request -> its tokens with KV after this step
        for new in scheduler_output.scheduled_new_reqs:
            self._prompts.setdefault(new.req_id, list(new.prompt_token_ids or []))
            self._blocks[new.req_id] = list(new.block_ids[0])
            done[new.req_id] = new.num_computed_tokens + \
                scheduler_output.num_scheduled_tokens[new.req_id]
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None and rid in self._blocks:
                if rid in cached.resumed_req_ids:
                    self._blocks[rid] = list(cached.new_block_ids[i][0])
                else:
                    self._blocks[rid] += list(cached.new_block_ids[i][0])
            done[rid] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[rid]
        if self.mode == "query":
            meta.query = self._plan_query(scheduler_output, done, meta)
        else:
            meta.store = self._plan_store(done)
        return meta

    def _plan_query(self, scheduler_output, done: dict[str, int], meta: TokenLakeMetadata) -> QueryStep:
        """Query mode: one sub-batch at this instance with the new tokens of every
        scheduled request the pool serves. A request whose computed tokens are not what
        the pool holds for it (a failed step, a prefix evicted before its lease) leaves
        the pool: if vLLM computed all its tokens itself, vLLM attends over its own blocks
        from then on; if part of them was only in the pool, its first block is reported
        as a load error, so vLLM discards this step's output and computes it again."""
        reqs, anchors, first, external = [], {}, {}, set()
        for rid, upto in done.items():
            n = scheduler_output.num_scheduled_tokens[rid]
            start = upto - n
            blocks = self._blocks.get(rid, [])
            request = self._requests.get(rid)
            if rid in self._local or request is None or not blocks:
                continue
            if rid in self._admitted and self._pool_len.get(rid, 0) != start:
                self._release(rid)  # what the pool holds for it is not what vLLM computed
            if start == 0:
                self._external.pop(rid, None)  # computed from the start: vLLM holds it all
            elif rid not in self._admitted:
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
            reqs.append(BatchRequest(rid, tuple(tokens)))
            anchors[blocks[start // self.block_size]] = rid
            first[rid] = blocks[0]
            if self._external.get(rid, 0):
                external.add(rid)
        if not reqs:
            return QueryStep(None)
        phase = "decode" if all(len(r.new_token_ids) == 1 for r in reqs) else "prefill"
        try:
            plans = self.cp.gen_plans([Batch(tuple(reqs), phase)], [1], homes=[self.home])
        except TokenLakeError as e:  # nothing reaches the pool this step
            log.warning("query mode: this step cannot be planned in the pool (%s)", e)
            for r in reqs:
                self._release(r.request_id)
            meta.failed_blocks += [first[rid] for rid in external]
            for rid in external:
                self._external.pop(rid, None)
            return QueryStep(None)
        for r in reqs:
            self._admitted.add(r.request_id)
            self._pool_len[r.request_id] = self._pool_len.get(r.request_id, 0) + \
                len(r.new_token_ids)
        return QueryStep(plans, anchors, first, frozenset(external))

    def update_connector_output(self, connector_output) -> None:
        failed = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(failed, FailedRequests):
            for rid in failed.request_ids:  # the pool did not take the step: start over
                self._release(rid)

    def _release(self, rid: str) -> None:
        """Ends ``rid`` in the pool (its leases, its private tail), if it is there."""
        self._pool_len.pop(rid, None)
        if rid in self._admitted:
            self._admitted.discard(rid)
            try:
                self.cp.finish_request(rid)
            except TokenLakeError as e:
                log.warning("request %s: releasing its pool leases failed: %s", rid, e)

    def _plan_store(self, done: dict[str, int]) -> Store | None:
        """One sub-batch storing the prompt segments completed by this step."""
        reqs, rows = [], []
        budget = self.max_rows
        for rid, upto in done.items():
            prompt = self._prompts.get(rid)
            if prompt is None:
                continue
            have = self._pool_len.get(rid, 0)
            end = min(upto, len(prompt)) // self.C * self.C
            end = min(end, have + budget // self.C * self.C)
            if end <= have:
                continue
            prefix = ()
            if rid not in self._admitted:
                prefix = tuple(prompt[:have])
            reqs.append(BatchRequest(rid, tuple(prompt[have:end]), prefix))
            rows.append((rid, self._blocks[rid][have // self.block_size: end // self.block_size]))
            budget -= end - have
        if not reqs:
            return None
        try:
            plans = self.cp.gen_plans([Batch(tuple(reqs))], [1], homes=[self.home])
        except TokenLakeError as e:  # a full pool, an evicted prefix: this step stores nothing
            log.info("not storing this step's segments: %s", e)
            return None
        for r in reqs:
            self._admitted.add(r.request_id)
            self._pool_len[r.request_id] = self._pool_len.get(r.request_id, 0) + \
                len(r.new_token_ids)
        return Store(plans, rows)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        rid = request.request_id
        for table in (self._hits, self._prompts, self._blocks, self._requests, self._external):
            table.pop(rid, None)
        self._local.discard(rid)
        self._release(rid)
        return False, None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():
            self._caches[_layer_index(name)] = cache
        if self.mode == "query":
            self._check_backend()

    def _check_backend(self) -> None:
        """The query mode needs vLLM's attention layers to run TokenLake's backend (the
        ``vllm.general_plugins`` entry point installs it)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(self._vllm_config, Attention)
        plain = [name for name, layer in layers.items()
                 if not getattr(layer.impl, "tokenlake_query", False)]
        if plain:
            raise ConfigError(f"query mode: {len(plain)} attention layers (e.g. {plain[0]}) do "
                              "not run TokenLake's backend; is the 'tokenlake_query_mode' "
                              "vLLM plugin installed and allowed (VLLM_PLUGINS)?")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TokenLakeMetadata)
        self._load_errors.update(meta.failed_blocks)
        if self.mode == "query":  # nothing to load: the pool attends over the prefix
            return
        for load in meta.loads:
            try:
                self._load(load)
            except Exception as e:  # vLLM computes the blocks instead (never wrong tokens)
                log.warning("request %s: loading from the pool failed: %s", load.request_id, e)
                self._load_errors.update(b for blocks in load.blocks for b in blocks)

    def _load(self, load: Load) -> None:
        by_instance: dict[int, list[int]] = {}
        for i, (inst, _slot) in enumerate(load.segments):
            by_instance.setdefault(inst, []).append(i)
        for layer, cache in sorted(self._caches.items()):
            pages = [None] * len(load.segments)
            for inst, idx in by_instance.items():
                slots = tuple(load.segments[i][1] for i in idx)
                data = self._read(inst, layer, slots)
                for i, block in zip(idx, data.blocks):
                    pages[i] = block
            for i, block in enumerate(pages):
                dst = load.blocks[i]
                src = _pages_of_slot(block, self.per_seg, cache.shape)
                skip = load.skip if i == 0 else 0
                if skip < len(dst):
                    cache[dst[skip:]] = src[skip:len(dst)]
        self.loaded_tokens += sum(len(b) for b in load.blocks) * self.block_size - \
            load.skip * self.block_size

    def _read(self, instance: int, layer: int, slots: tuple[int, ...]) -> SegmentData:
        sock = self._sock(instance)
        send(sock, ReadSegment(layer, slots).encode(1), timeout_s=self.cp.timeout_s)
        return expect(wire.recv(sock, self.cp.timeout_s), SegmentData)

    def _sock(self, instance: int):
        if instance not in self._socks:
            import zmq

            info = self.cp.client_info(instance)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            keys = None if info.keys is None else ClusterKeys.from_dict(dict(info.keys))
            connect_secure(sock, keys)
            sock.connect(info.endpoints["transfer"])
            self._socks[instance] = sock
        return self._socks[instance]

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward pass

    # ------------------------------------------------------------ worker side, query mode
    def attend(self, layer_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata, scale: float) -> torch.Tensor:
        """One attention layer of this step (called by the query-mode backend): the new
        K/V put into the pool, q sent to it, merged with attention over the new tokens."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        step = meta.query if isinstance(meta, TokenLakeMetadata) else None
        if self._step is None or step is None or self._step.step is not step:
            # a new step (or a warm-up pass without metadata: attention over its own tokens)
            step = step if step is not None else QueryStep(None)
            client = None
            if step.plans is not None:
                try:
                    client = self._client(self.home)
                except Exception as e:
                    log.warning("query mode: cannot reach pool instance %d: %s", self.home, e)
            self._step = StepState(step, client, self.block_size, self.cp.timeout_s)
        return self._step.attend(_layer_index(layer_name), q, k, v, attn_metadata, scale)

    def _finish_query_step(self) -> None:
        """After the forward pass: wait for the puts and commit the step's plans, or,
        when anything failed, abort them and make vLLM compute the affected requests."""
        state, self._step = self._step, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        step = meta.query if isinstance(meta, TokenLakeMetadata) else None
        if step is None or step.plans is None:
            return
        if state is not None and state.step is not step:
            state = None
        failed = state is None or state.failed
        if not failed:
            try:
                state.finish()
                self.cp.complete(step.plans)
            except Exception as e:
                state.fail(e)
                failed = True
        if failed:
            try:
                self.cp.abort(step.plans)
            except Exception as e:
                log.warning("query mode: aborting the step's plans failed: %s", e)
            requests = {s.request_id for qp in step.plans.query_plans for s in qp.spans}
            self._failed_requests |= requests
            self._load_errors.update(step.first_block[rid] for rid in step.external)

    def build_connector_worker_meta(self):
        if not self._failed_requests:
            return None
        failed, self._failed_requests = frozenset(self._failed_requests), set()
        return FailedRequests(failed)

    # ------------------------------------------------------------ worker side, load mode
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TokenLakeMetadata) or meta.store is None:
            return
        layer = _layer_index(layer_name)
        (tp,) = meta.store.plans.transfer_plans
        client = self._client(tp.home)
        if self._kv_buf is None:
            self._kv_buf = client.init_transfer(tp)
        row = 0
        for _rid, blocks in meta.store.rows:
            n = len(blocks) * self.block_size
            pages = kv_layer[blocks]  # [blocks, kv_heads, block_size, 2 * head_dim]
            self._kv_buf[layer, row:row + n] = pages.reshape(n, *self._kv_buf.shape[2:])
            row += n
        self._puts.append(client.put(layer))

    def _client(self, instance: int):
        if instance not in self._clients:
            self._clients[instance] = self.cp.client(instance)
        return self._clients[instance]

    def wait_for_save(self) -> None:
        if self.mode == "query":
            self._finish_query_step()
            return
        meta = self._get_connector_metadata()
        puts, self._puts, self._kv_buf = self._puts, [], None
        if not isinstance(meta, TokenLakeMetadata) or meta.store is None:
            return
        plans = meta.store.plans
        try:
            for handle in puts:
                handle.wait()
            self.cp.complete(plans)
            self.stored_tokens += sum(len(b) for _, b in meta.store.rows) * self.block_size
        except Exception as e:  # nothing of this step becomes visible
            log.warning("storing this step's segments failed: %s", e)
            try:
                self.cp.abort(plans)
            except TokenLakeError:
                pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
        self.cp.close()


def _layer_index(layer_name: str) -> int:
    m = _LAYER.search(layer_name)
    if m is None:
        raise ConfigError(f"cannot tell the layer of {layer_name!r}")
    return int(m.group(1))


def _pages_of_slot(block: torch.Tensor, per_seg: int, cache_shape) -> torch.Tensor:
    """A slab slot's layer ``[2, kv_heads, C, head_dim]`` back to the vLLM pages it was
    stored from: the put wrote the pages as rows ``[C, 2, kv_heads, head_dim]`` (the
    same bytes), and the transfer engine stored row ``r`` at token ``r`` of the slot."""
    rows = block.permute(2, 0, 1, 3).contiguous()  # [C, 2, kv_heads, head_dim]
    return rows.reshape(per_seg, *cache_shape[1:])
