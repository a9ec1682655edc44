"""``TokenLakeConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on a TokenLake pool.

    python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config \\
      '{"kv_connector": "TokenLakeConnector", "kv_connector_module_path":
        "tokenlake.integrations.vllm", "kv_role": "kv_both", "kv_load_failure_policy":
        "recompute", "kv_connector_extra_config": {"address": "tcp://127.0.0.1:7400"}}'

against a pool served with ``tokenlake serve --kv-layout vllm-cpu --segment-tokens 128``
(docs/vllm.md). Extra config: ``address`` (required), ``credentials`` (the file ``tokenlake
serve`` wrote; default: the one for that port on this machine), ``timeout_s``, ``instance``
(the pool instance whose buffers this vLLM instance writes: give each vLLM instance its
own; default 0), ``cache_salt`` (the tenant namespace of every request of this vLLM
instance in the pool, at most 256 characters: only requests under the same salt share
segments; a request's own ``cache_salt``, vLLM's per-request field, wins; default: none,
shared) and ``mode``: ``"load"`` (default, below) or ``"query"``
(:mod:`tokenlake.integrations.vllm_query`: the pooled prefix is attended in the pool,
never copied into vLLM; a pool served with ``--kv-layout hf``, vLLM run with
``--no-enable-prefix-caching``).

Both modes share the scheduler side's matching: a prompt is matched in the pool (whole
segments), the hit beyond vLLM's own prefix cache is leased (``lease_prefix``) and
finishing a request releases it. The load mode (:mod:`tokenlake.integrations.vllm_load`)
then copies the leased segments into vLLM's blocks and stores completed prompt segments;
the query mode (:mod:`tokenlake.integrations.vllm_query`) attends over them in the pool
and stores every token.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from tokenlake.core.errors import ConfigError, PlanError, TokenLakeError
from tokenlake.core.segments import check_salt
from tokenlake.integrations.vllm_load import LoadMode, _Loading
from tokenlake.integrations.vllm_meta import Load, TokenLakeMetadata, layer_index
from tokenlake.integrations.vllm_query import QueryMode, StepState
from tokenlake.service.remote import connect

log = logging.getLogger(__name__)

LAYOUT = "vllm-cpu"  # load mode: vLLM's pages, opaque
QUERY_LAYOUT = "hf"  # query mode: K/V rows [tokens, 2, kv_heads, head_dim], Hugging Face order
MODES = ("load", "query")
#: The connection number each side of one vLLM instance joins its pool session with
#: (tokenlake.connect); the worker's reads use one more (vllm_load.READ_CONNECTION).
ROLE_CONNECTION = {KVConnectorRole.SCHEDULER: 1, KVConnectorRole.WORKER: 2}


class TokenLakeConnector(QueryMode, LoadMode, KVConnectorBase_V1):
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
        try:  # every request's salt in the pool, unless it has its own (vLLM's cache_salt)
            self.cache_salt = check_salt(extra.get("cache_salt"))
        except PlanError as e:
            raise ConfigError(f"kv_connector_extra_config.cache_salt: {e}") from None
        if self.mode == "query":
            self._check_query_mode(vllm_config)
        # The scheduler side plans and the worker side stores and completes: one session,
        # joined by both processes (their engine id, random per vLLM instance, is the
        # secret they share; a config without one gets a session of this side's own)
        engine_id = getattr(self._kv_transfer_config, "engine_id", None)
        self.cp = connect(extra["address"], float(extra.get("timeout_s", 10.0)),
                          extra.get("credentials"), label=f"vllm-{role.name.lower()}",
                          session=f"vllm:{engine_id}" if engine_id else None,
                          connection=ROLE_CONNECTION[role] if engine_id else 0)
        namespace, self.C = self.cp.layout()
        self._check_namespace(namespace, self.mode, extra["address"])
        if self.mode == "load" and self.C % self.block_size:
            raise ConfigError(f"the pool's segments ({self.C} tokens) are not whole vLLM blocks "
                              f"of {self.block_size}: serve it with --segment-tokens "
                              f"{self.block_size} (or a multiple)")
        self.per_seg = max(1, self.C // self.block_size)
        self.home = extra.get("instance", 0)
        if type(self.home) is not int or self.home not in self.cp.instances:
            raise ConfigError(f"kv_connector_extra_config.instance must be one of the pool's "
                              f"instances {list(self.cp.instances)}, got {self.home!r}")
        # [layers, max_rows, 2, kv_heads, head_dim] of every instance's kv buffer (read
        # without opening this session's buffers: the scheduler side never needs them)
        kv_shape = self.cp.buffer_shapes()["kv"]
        self._check_model(vllm_config, kv_shape, extra["address"])
        self.max_rows = kv_shape[1]  # most tokens one store plan can hold
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is not 'recompute': a request whose load from "
                        "the pool fails (a dead engine) ends with an error instead of being "
                        "computed; set \"kv_load_failure_policy\": \"recompute\"")
        self._init_scheduler_side()
        self._init_worker_side()
        self._init_query_mode()

    def _init_scheduler_side(self) -> None:
        """The scheduler side's state, per request (both modes), empty."""
        self._hits: dict[str, int] = {}  # request -> pool hit (tokens) seen at matching
        self._salts: dict[str, str | None] = {}  # request -> its cache salt in the pool
        self._pool_len: dict[str, int] = {}  # request -> its tokens the pool holds or stores
        self._admitted: set[str] = set()
        self._prompts: dict[str, list[int]] = {}
        self._blocks: dict[str, list[int]] = {}
        self._loads: list[Load] = []
        self._failed: list[int] = []

    def _init_worker_side(self) -> None:
        """The worker side's state (load mode: caches, sockets, loads and puts), empty."""
        self._caches: dict[int, torch.Tensor] = {}  # layer index -> its KV cache tensor
        self._clients: dict[int, Any] = {}
        self._socks: dict[int, Any] = {}
        self._slabs: dict[int, Any] = {}  # instance -> its slab mapped (SharedTensor) or None
        self._puts: list = []
        self._load_errors: set[int] = set()
        self._kv_buf = None
        self._loading: list[_Loading] = []  # this pass's loads, received layer by layer
        self._layers: list[int] = []
        self._next = 0
        self._msg_ids = itertools.count(1)
        self.loaded_tokens = self.stored_tokens = 0

    def _init_query_mode(self) -> None:
        """The query mode's state, on both sides, empty."""
        self._requests: dict[str, Any] = {}  # scheduler: request id -> vLLM's live Request
        self._external: dict[str, int] = {}  # scheduler: pooled tokens vLLM never computed
        self._local: set[str] = set()  # scheduler: requests vLLM attends alone
        self._step: StepState | None = None  # worker: this step's plans and buffers
        self._failed_requests: set[str] = set()  # worker: reported to the scheduler side
        self.pooled_tokens = 0  # scheduler: prefix tokens found in the pool (query mode)

    @staticmethod
    def _check_namespace(namespace: str, mode: str, address: str) -> None:
        """The pool must hold vLLM's KV in this mode's layout, in float32 (vLLM's CPU KV
        dtype: a half pool would round it)."""
        layout = QUERY_LAYOUT if mode == "query" else LAYOUT
        if not namespace.endswith("/" + layout):
            what = "vLLM's K/V rows" if mode == "query" else "vLLM's pages"
            raise ConfigError(f"the pool at {address} holds {namespace!r}, not {what}: "
                              f"serve it with --kv-layout {layout}")
        if "/f32/" not in namespace:
            raise ConfigError(f"the pool at {address} holds {namespace!r}: the vLLM connector "
                              "needs a float32 pool (--kv-dtype float32)")

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

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if self.mode == "query":  # preempted by vLLM and scheduled again: start over
            self._release(request.request_id)
            self._local.discard(request.request_id)
            self._external.pop(request.request_id, None)
        salt = self._salts[request.request_id] = self._salt_of(request)
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) < 2:
            return 0, False
        match = self.cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1, salt=salt)
        # Whole segments: lease_prefix leases those (a page hit needs its copy planned
        # with an iteration, which the connector's lease at allocation is not).
        hit = match.whole_tokens
        self._hits[request.request_id] = hit
        return max(0, hit - num_computed_tokens), False

    def _salt_of(self, request) -> str | None:
        """``request``'s cache salt in the pool: its own (vLLM's ``Request.cache_salt``),
        else this instance's (``kv_connector_extra_config.cache_salt``), else none. A
        salt of vLLM's that the pool refuses (over 256 characters) enters it as its
        digest: the same namespace for the same salt, and no error in vLLM's scheduler."""
        salt = getattr(request, "cache_salt", None)
        if not salt:
            return self.cache_salt
        try:
            return check_salt(salt)
        except PlanError:
            raw = str(salt).encode("utf-8", "surrogatepass")
            return "blake2b:" + hashlib.blake2b(raw, digest_size=32).hexdigest()

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        rid = request.request_id
        self._prompts[rid] = list(request.prompt_token_ids or [])
        self._blocks[rid] = list(blocks.get_block_ids()[0])
        if self.mode == "query":
            self._requests[rid] = request
        if num_external_tokens <= 0:
            return
        hit = self._hits.get(rid, 0)
        salt = self._salts.get(rid, self.cache_salt)
        if self.mode == "query":  # lease the prefix; it is attended where it lives
            try:
                self.cp.lease_prefix(rid, self._prompts[rid][:hit], salt)
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
            locs = self.cp.lease_prefix(rid, self._prompts[rid][:hit], salt)
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
        self._loads.append(Load(rid, segs, per, skip, self.cp.lease_grants(rid)))

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

    def _release(self, rid: str) -> None:
        """Ends ``rid`` in the pool (its leases, its private tail), if it is there."""
        self._pool_len.pop(rid, None)
        if rid in self._admitted:
            self._admitted.discard(rid)
            try:
                self.cp.finish_request(rid)
            except TokenLakeError as e:
                log.warning("request %s: releasing its pool leases failed: %s", rid, e)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        rid = request.request_id
        for table in (self._hits, self._salts, self._prompts, self._blocks, self._requests,
                      self._external):
            table.pop(rid, None)
        self._local.discard(rid)
        self._release(rid)
        return False, None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, cache in kv_caches.items():
            self._caches[layer_index(name)] = cache
        if self.mode == "query":
            self._check_backend()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TokenLakeMetadata)
        self._load_errors.update(meta.failed_blocks)
        if self.mode == "load":  # the query mode loads nothing: the pool attends
            self._start_loads(meta)

    def wait_for_save(self) -> None:
        if self.mode == "query":
            self._finish_query_step()
        else:
            self._finish_loads()
            self._finish_store()

    def _client(self, instance: int):
        if instance not in self._clients:
            self._clients[instance] = self.cp.client(instance)
        return self._clients[instance]

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for sock in self._socks.values():
            sock.close(0)
        self._socks.clear()
        self._close_slabs()
        self.cp.close()
