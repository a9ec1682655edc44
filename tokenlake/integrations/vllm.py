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
finishing a request releases it (:class:`~tokenlake.integrations.vllm_mode.PoolRequests`).
Everything else is the mode's, a strategy object chosen once when the connector starts
(:class:`~tokenlake.integrations.vllm_mode.ModeStrategy`): the load mode
(:class:`~tokenlake.integrations.vllm_load.LoadStrategy`) copies the leased segments into
vLLM's blocks and stores completed prompt segments; the query mode
(:class:`~tokenlake.integrations.vllm_query.QueryStrategy`) attends over them in the pool
and stores every token. The connector itself reads the config, opens the pool session,
refuses pools and vLLM configurations the mode cannot serve, and hands each of vLLM's
calls to the strategy with the step's metadata.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from tokenlake.core.control import check_bf16_products
from tokenlake.core.errors import ConfigError, PlanError
from tokenlake.core.segments import check_salt
from tokenlake.integrations.vllm_load import LoadStrategy
from tokenlake.integrations.vllm_meta import TokenLakeMetadata, layer_index
from tokenlake.integrations.vllm_mode import ModeStrategy, PoolRequests, VllmPool, check_namespace
from tokenlake.integrations.vllm_query import QueryStrategy
from tokenlake.service.remote import connect

log = logging.getLogger(__name__)

#: ``kv_connector_extra_config.mode`` -> its strategy (a ModeStrategy class)
STRATEGIES: dict[str, type[ModeStrategy]] = {"load": LoadStrategy, "query": QueryStrategy}
MODES = tuple(STRATEGIES)
#: The connection number each side of one vLLM instance joins its pool session with
#: (tokenlake.connect); the worker's reads use one more (vllm_reads.READ_CONNECTION).
ROLE_CONNECTION = {KVConnectorRole.SCHEDULER: 1, KVConnectorRole.WORKER: 2}


class TokenLakeConnector(KVConnectorBase_V1):
    """See the module docstring. ``strategy`` is the mode's
    :class:`~tokenlake.integrations.vllm_mode.ModeStrategy`, ``requests`` the scheduler
    side's :class:`~tokenlake.integrations.vllm_mode.PoolRequests`, ``cp`` the pool session."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        if "address" not in extra:
            raise ConfigError("TokenLakeConnector needs kv_connector_extra_config.address")
        self.mode = extra.get("mode", "load")
        if self.mode not in MODES:
            raise ConfigError(f"kv_connector_extra_config.mode must be one of {MODES}, "
                              f"got {self.mode!r}")
        mode = STRATEGIES[self.mode]
        block_size = vllm_config.cache_config.block_size
        try:  # every request's salt in the pool, unless it has its own (vLLM's cache_salt)
            cache_salt = check_salt(extra.get("cache_salt"))
        except PlanError as e:
            raise ConfigError(f"kv_connector_extra_config.cache_salt: {e}") from None
        mode.check_vllm(vllm_config)
        self._bf16_products(extra.get("bf16_products", 0), role)
        # The scheduler side plans and the worker side stores and completes: one session,
        # joined by both processes (their engine id, random per vLLM instance, is the
        # secret they share; a config without one gets a session of this side's own)
        engine_id = getattr(self._kv_transfer_config, "engine_id", None)
        self.cp = connect(extra["address"], float(extra.get("timeout_s", 10.0)),
                          extra.get("credentials"), label=f"vllm-{role.name.lower()}",
                          session=f"vllm:{engine_id}" if engine_id else None,
                          connection=ROLE_CONNECTION[role] if engine_id else 0)
        namespace, segment_tokens = self.cp.layout()
        check_namespace(namespace, mode.layout, mode.holds, extra["address"])
        mode.check_segments(segment_tokens, block_size)
        self.home = extra.get("instance", 0)
        if type(self.home) is not int or self.home not in self.cp.instances:
            raise ConfigError(f"kv_connector_extra_config.instance must be one of the pool's "
                              f"instances {list(self.cp.instances)}, got {self.home!r}")
        # [layers, max_rows, 2, kv_heads, head_dim] of every instance's kv buffer (read
        # without opening this session's buffers: the scheduler side never needs them)
        kv_shape = self.cp.buffer_shapes()["kv"]
        self._check_model(vllm_config, kv_shape, extra["address"])
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is not 'recompute': a request whose load from "
                        "the pool fails (a dead engine) ends with an error instead of being "
                        "computed; set \"kv_load_failure_policy\": \"recompute\"")
        self.pool = VllmPool(self.cp, self.home, segment_tokens, block_size, kv_shape[1])
        self.requests = PoolRequests(self.cp, cache_salt)
        self.strategy: ModeStrategy = mode(self.pool, self.requests)
        self._load_errors: set[int] = set()  # blocks the scheduler side's metadata failed

    def _bf16_products(self, parts: Any, role: KVConnectorRole) -> None:
        """``"bf16_products"`` (0, 1 or 2) of the extra config: in query mode the worker
        attends the pool's bfloat16 slabs in place in this process, with q in that many
        bfloat16 parts and the probabilities rounded where the CPU has the kernel's dot
        path (docs/design.md §4); 0, the default: exact products. (vLLM's bfloat16 q rows
        lose nothing to one part.)"""
        check_bf16_products(parts, "kv_connector_extra_config.bf16_products")
        if parts and self.mode == "query" and role == KVConnectorRole.WORKER:
            from tokenlake.kernels import native

            native.use_bf16_products_if_built(parts)

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

    def _meta(self) -> TokenLakeMetadata | None:
        """This step's metadata, None where vLLM bound none (a warm-up pass)."""
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta if isinstance(meta, TokenLakeMetadata) else None

    # ------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        self.strategy.rematch(request.request_id)
        return self.requests.match(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.requests.allocated(request, blocks)
        self.strategy.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        done = self.requests.scheduled(scheduler_output)
        return self.strategy.build_meta(scheduler_output, done)

    def update_connector_output(self, connector_output) -> None:
        self.strategy.step_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self.strategy.finished(request.request_id)
        self.requests.finished(request.request_id)
        return False, None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches = {layer_index(name): cache for name, cache in kv_caches.items()}
        self.strategy.register_kv_caches(caches, self._vllm_config)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TokenLakeMetadata)
        self._load_errors.update(meta.failed_blocks)
        self.strategy.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.strategy.wait_for_layer_load(layer_index(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        self.strategy.save_kv_layer(layer_index(layer_name), kv_layer, self._meta())

    def wait_for_save(self) -> None:
        self.strategy.wait_for_save(self._meta())

    def attend(self, layer_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata, scale: float):
        """One attention layer of this step, for the query-mode backend
        (:mod:`tokenlake.integrations.vllm_backend`): ``(rows, out, complete)`` through the
        pool, or None where vLLM attends over its own blocks."""
        return self.strategy.attend(layer_index(layer_name), q, k, v, attn_metadata, scale,
                                    self._meta())

    def build_connector_worker_meta(self):
        return self.strategy.worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors | self.strategy.take_load_errors()

    def shutdown(self) -> None:
        self.strategy.close()
        self.cp.close()
