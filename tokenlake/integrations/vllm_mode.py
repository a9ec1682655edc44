"""What the two modes of :class:`~tokenlake.integrations.vllm.TokenLakeConnector` share, and
the interface each implements.

The connector holds one :class:`VllmPool` (the session and the facts every step needs),
one :class:`PoolRequests` (the scheduler side's requests in the pool: matched, leased,
stored, released) and one :class:`ModeStrategy`, chosen by ``"mode"`` when it starts:
:class:`~tokenlake.integrations.vllm_load.LoadStrategy` (vLLM's pages copied in and out
of the pool) or :class:`~tokenlake.integrations.vllm_query.QueryStrategy` (vLLM's
attention over the pooled prefix runs in the pool). Every step where the modes differ is
a method of the strategy; each strategy keeps its own state and is built from these two
objects alone, so it can be made and tested without vLLM's engine.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from tokenlake.core.errors import ConfigError, PlanError, TokenLakeError
from tokenlake.core.prefix_tree import SegmentLocation
from tokenlake.core.segments import check_salt
from tokenlake.integrations.vllm_meta import TokenLakeMetadata
from tokenlake.service.remote import RemoteControlPlane

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmPool:
    """The pool session of one connector object and what both modes know of the pool and
    of vLLM."""

    cp: RemoteControlPlane  # the session (tokenlake.connect), shared with the other side
    home: int  # the pool instance whose buffers this vLLM instance writes (its plans' home)
    segment_tokens: int  # C: tokens per segment
    block_size: int  # tokens per vLLM block
    max_rows: int  # most tokens one plan holds (the rows of a session's kv buffer)

    @property
    def per_seg(self) -> int:
        """vLLM blocks per segment (load mode; at least 1)."""
        return max(1, self.segment_tokens // self.block_size)


def check_namespace(namespace: str, layout: str, holds: str, address: str) -> None:
    """The pool must hold vLLM's KV in ``layout`` (what a mode reads and writes, ``holds``
    in words), in float32 (vLLM's CPU KV dtype: a half pool would round it)."""
    if not namespace.endswith("/" + layout):
        raise ConfigError(f"the pool at {address} holds {namespace!r}, not {holds}: "
                          f"serve it with --kv-layout {layout}")
    if "/f32/" not in namespace:
        raise ConfigError(f"the pool at {address} holds {namespace!r}: the vLLM connector "
                          "needs a float32 pool (--kv-dtype float32)")


class PoolRequests:
    """The scheduler side's requests, for both modes: what the pool matched for each
    (whole segments), its salt, its prompt and vLLM blocks, the tokens the pool holds or
    stores for it, and which requests the pool knows (``admitted``: leased or planned, to
    be finished there). The scheduler side runs on one thread (vLLM's scheduler)."""

    def __init__(self, cp: RemoteControlPlane, cache_salt: str | None) -> None:
        self.cp = cp
        self.cache_salt = cache_salt  # every request's salt unless it has its own
        self.hits: dict[str, int] = {}  # request -> pool hit (tokens) seen at matching
        self.salts: dict[str, str | None] = {}  # request -> its cache salt in the pool
        self.pool_len: dict[str, int] = {}  # request -> its tokens the pool holds or stores
        self.admitted: set[str] = set()
        self.prompts: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}  # request -> its vLLM block ids, in order

    def match(self, request, num_computed_tokens: int) -> int:
        """The tokens of ``request``'s prompt the pool holds beyond the ``num_computed_tokens``
        vLLM has: whole segments (``lease_prefix`` leases those; a page hit needs its copy
        planned with an iteration), at most ``len(prompt) - 1`` tokens."""
        salt = self.salts[request.request_id] = self.salt_of(request)
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) < 2:
            return 0
        match = self.cp.get_prefix_tree().match(prompt, max_tokens=len(prompt) - 1, salt=salt)
        hit = match.whole_tokens
        self.hits[request.request_id] = hit
        return max(0, hit - num_computed_tokens)

    def salt_of(self, request) -> str | None:
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

    def salt(self, request_id: str) -> str | None:
        """The salt ``request_id`` was matched under (this instance's if not matched)."""
        return self.salts.get(request_id, self.cache_salt)

    def allocated(self, request, blocks) -> None:
        """vLLM gave ``request`` its blocks (``update_state_after_alloc``)."""
        self.prompts[request.request_id] = list(request.prompt_token_ids or [])
        self.blocks[request.request_id] = list(blocks.get_block_ids()[0])

    def lease(self, request_id: str) -> tuple[SegmentLocation, ...] | None:
        """Leases the hit seen at matching (no eviction races its use) and admits the
        request; None (logged) when the pool no longer holds it."""
        hit = self.hits.get(request_id, 0)
        try:
            locs = self.cp.lease_prefix(request_id, self.prompts[request_id][:hit],
                                        self.salt(request_id))
        except TokenLakeError as e:
            log.warning("request %s: the pool no longer holds its prefix (%s)", request_id, e)
            return None
        self.admitted.add(request_id)
        self.pool_len[request_id] = hit
        return locs

    def admit(self, request_id: str, tokens: int) -> None:
        """A plan stores ``tokens`` more of ``request_id`` (it is the pool's from now)."""
        self.admitted.add(request_id)
        self.pool_len[request_id] = self.pool_len.get(request_id, 0) + tokens

    def scheduled(self, scheduler_output) -> dict[str, int]:
        """Takes this step's new blocks; returns each scheduled request's tokens with KV
        once the step ran."""
        done: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self.prompts.setdefault(new.req_id, list(new.prompt_token_ids or []))
            self.blocks[new.req_id] = list(new.block_ids[0])
            done[new.req_id] = new.num_computed_tokens + \
                scheduler_output.num_scheduled_tokens[new.req_id]
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if cached.new_block_ids[i] is not None and rid in self.blocks:
                if rid in cached.resumed_req_ids:
                    self.blocks[rid] = list(cached.new_block_ids[i][0])
                else:
                    self.blocks[rid] += list(cached.new_block_ids[i][0])
            done[rid] = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[rid]
        return done

    def release(self, request_id: str) -> None:
        """Ends ``request_id`` in the pool (its leases, its private tail), if it is there."""
        self.pool_len.pop(request_id, None)
        if request_id in self.admitted:
            self.admitted.discard(request_id)
            try:
                self.cp.finish_request(request_id)
            except TokenLakeError as e:
                log.warning("request %s: releasing its pool leases failed: %s", request_id, e)

    def finished(self, request_id: str) -> None:
        """vLLM is done with ``request_id``: forgotten here, released in the pool."""
        for table in (self.hits, self.salts, self.prompts, self.blocks):
            table.pop(request_id, None)
        self.release(request_id)


class ModeStrategy(Protocol):
    """A mode of the connector: every step where the load and query modes differ. Built
    from a :class:`VllmPool` and a :class:`PoolRequests` alone, it keeps its own state.
    Scheduler-side methods run in vLLM's scheduler, worker-side ones in its model worker
    (one connector object per process and role: each uses its side's methods only).
    ``meta`` is this step's metadata as the worker got it, None where vLLM bound none (a
    warm-up pass)."""

    layout: ClassVar[str]  # the pool's --kv-layout the mode needs
    holds: ClassVar[str]  # what a pool of that layout holds, in words (for the refusal)

    def __init__(self, pool: VllmPool, requests: PoolRequests) -> None:
        """Stores both; opens nothing (the worker side opens what it reads on first use)."""

    @staticmethod
    def check_vllm(vllm_config) -> None:
        """Refuses (``ConfigError``) a vLLM configuration the mode cannot serve."""

    @staticmethod
    def check_segments(segment_tokens: int, block_size: int) -> None:
        """Refuses (``ConfigError``) the pool's segment size where the mode needs another."""

    # ------------------------------------------------------------ scheduler side
    def rematch(self, request_id: str) -> None:
        """``request_id`` is matched again (new, or preempted and scheduled again)."""

    def allocated(self, request, num_external_tokens: int) -> None:
        """vLLM allocated ``request``'s blocks, ``num_external_tokens`` of them to come
        from the pool (:meth:`PoolRequests.allocated` has run)."""

    def build_meta(self, scheduler_output, done: dict[str, int]) -> TokenLakeMetadata:
        """This step's work for the worker side; ``done``: each scheduled request's tokens
        with KV once the step ran."""

    def step_output(self, connector_output) -> None:
        """What the worker side reported of a step (``update_connector_output``)."""

    def finished(self, request_id: str) -> None:
        """vLLM is done with ``request_id`` (the connector then releases it in the pool)."""

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, caches: dict[int, torch.Tensor], vllm_config: Any) -> None:
        """vLLM's KV cache tensor of each decoder layer (by layer index), once its model
        is built (``vllm_config`` names its layers)."""

    def start_load_kv(self, meta: TokenLakeMetadata) -> None:
        """The step begins (before or after vLLM launched its forward pass)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Before ``layer``'s attention: whatever it reads from the pool is in place."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, meta: TokenLakeMetadata | None) -> None:
        """After ``layer``'s attention: ``kv_layer`` is vLLM's KV cache of that layer."""

    def wait_for_save(self, meta: TokenLakeMetadata | None) -> None:
        """After the forward pass: the step's stores committed (or aborted)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_metadata: Any, scale: float, meta: TokenLakeMetadata | None
               ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """``layer``'s attention through the pool, for the query-mode backend
        (:meth:`~tokenlake.integrations.vllm_query_step.StepState.attend`); None: vLLM attends."""

    def worker_meta(self) -> Any | None:
        """What the worker side tells the scheduler side of this step (``build_connector_worker_meta``)."""

    def take_load_errors(self) -> set[int]:
        """vLLM blocks whose KV the pool failed to provide since the last call (vLLM
        computes them)."""

    def close(self) -> None:
        """Lets go of what the strategy opened (not the session: the connector closes it)."""
