"""The control plane: ``get_prefix_tree``, ``get_cache_load`` and ``gen_plans`` (docs/design.md §3).

:class:`ControlPlane` is a facade over the parts that turn the scheduler's batches and
degrees of parallelism into query plans, transfer plans and instance groups:

1. :class:`~tokenlake.core.store_plan.StorePlanner` admits each request into the
   :class:`~tokenlake.core.request_table.RequestTable`, resolves its prefix to one replica
   per segment (power of two choices, cached across iterations) and gives its new
   tokens slots in the :class:`~tokenlake.core.pool.CachePool` (deduplicated against
   the tree; the open tail stays private until it fills);
2. :class:`~tokenlake.core.assembly.PartAssembler` splits every batch into DoP
   sub-batches, matches them to instances (:mod:`tokenlake.core.dispatch`) and builds
   the plans;
3. every change of step 1 is recorded in a :class:`~tokenlake.core.transaction.Transaction`,
   rolled back if planning fails and kept in flight otherwise.

After the data plane has stored every layer the caller reports :meth:`ControlPlane.complete`
(new segments become visible) or :meth:`ControlPlane.abort`.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from tokenlake.core import tier_flow
from tokenlake.core.assembly import PartAssembler, check_homes
from tokenlake.core.config import PoolConfig
from tokenlake.core.cost_model import LatencyModel, LoadRequest
from tokenlake.core.cost_model import get_cache_load as _cache_load
from tokenlake.core.errors import ConfigError, PlanError
from tokenlake.core.plans import Batch, Plans
from tokenlake.core.pool import CachePool, PoolStats
from tokenlake.core.prefix_tree import PrefixTree, SegmentLocation
from tokenlake.core.replication import Replication
from tokenlake.core.request_table import RequestTable
from tokenlake.core.specs import HardwareProfile, ModelSpec
from tokenlake.core.store_plan import StorePlanner
from tokenlake.core.tier import TierDataPlane
from tokenlake.core.transaction import PlanCounts, Transaction


@dataclass(frozen=True)
class ControlStats:
    """Hit accounting of admitted requests (tokens) plus the pool's counters."""

    admitted_requests: int
    hit_tokens: int  # prefix tokens reused from the pool at admission
    prefill_tokens: int  # tokens computed in prefill batches
    dedup_bytes: int  # bytes not stored because the segment was already cached
    pool: PoolStats

    @property
    def hit_rate(self) -> float:
        """Reused prefix tokens / (reused + prefilled) input tokens."""
        total = self.hit_tokens + self.prefill_tokens
        return self.hit_tokens / total if total else 0.0


class ControlPlane:
    """Single writer of cache metadata for one cluster.

    Args:
        config: placement and pool configuration.
        model: model spec (bytes per token for dispatch and load estimates).
        instances: instance ids.
        clock: injected monotonic clock in seconds (``time.monotonic`` by default).
        rng: injected RNG for replica selection (seeded from ``config.seed`` by default).
    """

    def __init__(
        self,
        config: PoolConfig,
        model: ModelSpec,
        instances: Sequence[int],
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.pool = CachePool(config, instances, clock, rng)
        self._requests = RequestTable(config.segment_tokens)
        self._planner = StorePlanner(self.pool, self._requests)
        # Bytes one q row costs per remote instance (q out, partial o + lse back), all
        # layers; and one token's KV, all layers.
        query_row = model.num_layers * (
            model.q_bytes_per_token_layer + model.partial_bytes_per_token_layer
        )
        self._assembler = PartAssembler(query_row, model.kv_bytes_per_token)
        self._inflight: dict[int, Transaction] = {}
        self._iteration = 0
        self._counts = PlanCounts()
        #: who moves the disk tiers' data (a launcher's driver); None: count it as done
        self.tier_data_plane: TierDataPlane | None = None

    # ----------------------------------------------------------- paper's API
    def get_prefix_tree(self) -> PrefixTree:
        """The global prefix tree (read it; mutate the pool only through this class)."""
        return self.pool.tree

    def get_cache_load(
        self, reqs: Sequence[Sequence[int]], hardware: HardwareProfile, latency: LatencyModel
    ) -> float:
        """Share of the cluster the pool uses to serve ``reqs`` (paper §6.1).

        ``reqs`` are token-id sequences; each one's prefix length is its match in the
        tree, the rest is input to compute.
        """
        loads = []
        for tokens in reqs:
            hit = self.pool.tree.match(tokens, max_tokens=max(len(tokens) - 1, 0)).hit_tokens
            loads.append(LoadRequest(input_len=len(tokens) - hit, prefix_len=hit))
        return _cache_load(loads, len(self.pool.instances), self.model, hardware, latency)

    def gen_plans(self, batches: Sequence[Batch], dops: Sequence[int],
                  homes: Sequence[int | None] | None = None, promoting: Sequence = ()) -> Plans:
        """Plans one iteration: where every batch runs and what it reads and stores.

        ``homes`` (optional, one entry per batch): the instance that must run a DoP 1
        batch (its compute engine owns that instance's buffers, e.g. a vLLM instance
        attached to one pool instance), or None to let dispatch choose.

        Raises :class:`PlanError` for malformed batches (empty, duplicate request ids,
        DoPs that do not fit the cluster, a request whose previous plans are still in
        flight, a pinned home that is unknown, taken twice or given a DoP > 1), :class:`~tokenlake.core.errors.PrefixNotCached` for a declared prefix the
        pool does not hold, and :class:`~tokenlake.core.errors.CapacityError` when new
        segments cannot be placed. On any error the pool and the requests are left
        exactly as they were (evicted replicas are put back).

        ``promoting``: promotions the caller began and reads layer by layer
        (:meth:`begin_promotion`'s batches): their segments may be attended
        (:func:`tokenlake.core.tier_flow.readable`).
        """
        with tier_flow.readable(self.pool, promoting):
            return self._gen_plans(batches, dops, homes)

    def _gen_plans(self, batches, dops, homes) -> Plans:
        self._requests.validate(batches, dops, len(self.pool.instances))
        homes = check_homes(homes, dops, self.pool.instances)
        tx = Transaction(self._iteration)
        try:
            prepared = self._planner.prepare(batches, tx)
            plans, accesses = self._assembler.assemble(
                batches, dops, prepared, tx.iteration, self.pool.instances, homes
            )
        except BaseException:
            tx.rollback(self.pool, self._requests)
            raise
        self.pool.record_access(accesses)
        tx.reads = plans.read_instances()
        self._requests.set_busy(tx.requests, tx.iteration)
        self._count(tx.counts, +1)
        self._inflight[tx.iteration] = tx
        self._iteration += 1
        return plans

    # ------------------------------------------------------ plan completion
    def complete(self, plans: Plans) -> None:
        """Every put of ``plans`` is stored in all layers: new segments become visible.
        Refused (:class:`PlanError`; abort them) if an instance they read was removed."""
        tx = self._inflight.get(plans.iteration)
        if tx is not None and tx.left is not None:
            raise PlanError(f"iteration {plans.iteration} read instance {tx.left}, which left the pool")
        self._take_flight(plans).commit(self.pool, self._requests)
        self.flush_tier()

    def flush_tier(self) -> None:
        """Hands the tiers' queued work to :attr:`tier_data_plane` and records what it
        did (:func:`tokenlake.core.tier_flow.flush`)."""
        tier_flow.flush(self.pool, self.tier_data_plane)

    def adopt_tier(self, listings: Mapping[int, Sequence[tuple]]) -> int:
        """Puts what the instances' tiers already hold (``{instance: entries}``) into
        the tree (:meth:`~tokenlake.core.tier.TierManager.adopt`); returns how many."""
        if self.pool.tier is None:
            return 0
        n = self.pool.tier.adopt(listings)
        self.flush_tier()
        return n

    def promote(self, prompts: Iterable[tuple[Sequence[int], str | None]]) -> int:
        """Brings the segments of each ``(token ids, cache salt)`` prompt's prefix that
        are held only in a tier back into slots, parent first, so that the next match
        reads them; returns how many came back. A segment whose copy is missing or
        corrupt goes, with what follows it (they are computed again). In three steps
        (the reads outside the lock): :meth:`begin_promotion`, the data plane's
        ``tier_read``, :meth:`end_promotion`."""
        if self.pool.tier is None:
            return 0
        n = tier_flow.promote(self.pool, self.tier_data_plane, prompts)
        self.flush_tier()  # the failed ones' copies
        return n

    def begin_promotion(self, prompts: Iterable[tuple[Sequence[int], str | None]]):
        """Slots for the prompts' segments held only in a tier
        (:func:`tokenlake.core.tier_flow.begin`); None: nothing to promote."""
        return None if self.pool.tier is None else tier_flow.begin(self.pool, prompts)

    def match_promoting(self, token_ids: Sequence[int], max_tokens: int | None, salt: str | None,
                        promoting: Sequence):
        """The tree's match of ``token_ids`` with the segments of ``promoting`` (as in
        :meth:`gen_plans`) counted as ready."""
        with tier_flow.readable(self.pool, promoting):
            return self.pool.tree.match(token_ids, max_tokens=max_tokens, salt=salt)

    def end_promotion(self, batch, outcome) -> int:
        """The reads of ``batch`` are over (:func:`tokenlake.core.tier_flow.end`)."""
        n = tier_flow.end(self.pool, batch, outcome)
        self.flush_tier()
        return n

    def abort(self, plans: Plans) -> None:
        """The data plane failed to run ``plans``: undo them; requests keep their old state."""
        tx = self._take_flight(plans)
        tx.abort(self.pool, self._requests)
        self._count(tx.counts, -1)

    def lease_prefix(self, request_id: str, prefix_token_ids: Sequence[int],
                     cache_salt: str | None = None) -> tuple[SegmentLocation, ...]:
        """Admits ``request_id`` (under ``cache_salt``, as :attr:`BatchRequest.cache_salt`:
        its prefix is matched and its later segments stored under that salt) with its
        cached prefix leased, outside any iteration, and
        returns the replica chosen for each of the prefix's segments, in order: a
        framework that copies the prefix's KV out of the pool (the vLLM connector) reads
        those slots, which stay put until :meth:`finish_request`. Later
        :meth:`gen_plans` calls add the request's new tokens (without a prefix).

        Raises :class:`PlanError` if the request is live or the salt is not a string of
        at most 256 characters, :class:`~tokenlake.core.errors.PrefixNotCached` if the
        prefix is not whole segments, all cached and ready under that salt; nothing
        changes then."""
        state = self._requests.admit_leased(request_id, tuple(prefix_token_ids), self.pool,
                                            cache_salt)
        tree = self.pool.tree
        out = []
        for key, inst in zip(state.keys, state.chosen):
            loc = next(loc for loc in tree.replicas(key) if loc.instance == inst)
            out.append(loc)
        self._counts.admitted += 1
        self._counts.hit_tokens += len(state.chain) * self.config.segment_tokens
        return tuple(out)

    def finish_request(self, request_id: str) -> None:
        """The request is done: release its prefix lease and its open tail. Raises
        :class:`PlanError` if it is unknown or has plans in flight."""
        self._requests.finish(request_id, self.pool)

    # ------------------------------------------------- replicas and instances
    def rebalance(self) -> list[Replication]:
        """Starts heavy-hitter replications (see :meth:`CachePool.rebalance`)."""
        return self.pool.rebalance()

    def start_replication(self, key: bytes, target: int) -> Replication:
        """Starts one replication by hand (see :meth:`CachePool.start_replication`)."""
        return self.pool.start_replication(key, target)

    def drop_replica(self, key: bytes, instance: int) -> None:
        """Frees one replica of a segment that has another ready one (migration's last
        step). Raises ``ValueError`` if it is the only ready replica."""
        self.pool.drop_replica(key, instance)
        self._requests.invalidate_reads()

    def finish_replication(self, rep: Replication) -> None:
        """The copy ``rep`` is stored: its target becomes a ready replica."""
        self.pool.finish_replication(rep)
        self._requests.invalidate_reads()

    def abort_replication(self, rep: Replication) -> None:
        """The copy ``rep`` failed: its pending target replica (and slot) and its lease on
        the source go; the source replica stays as it was."""
        self.pool.abort_replication(rep)

    def remove_instance(self, instance: int) -> tuple[str, ...]:
        """Takes a failed instance out of the pool. Returns the ids of requests that lost
        part of their prefix: they must be finished and recomputed (planning them again
        raises :class:`PlanError`). Plans in flight can still be aborted, and completed
        unless they read the instance."""
        removal = self.pool.remove_instance(instance)
        gone = set(removal.removed_keys)
        for tx in self._inflight.values():
            tx.forget(gone, instance)
        lost = self._requests.mark_lost(removal)
        self._requests.invalidate_reads()
        return lost

    def add_instance(self, instance: int) -> None:
        """An empty instance joins the pool (a new one, or a failed one restarted with an
        empty slab): it takes its share of the hash ring from the next placement on."""
        self.pool.add_instance(instance)
        self._requests.invalidate_reads()

    # ------------------------------------------------------------ reading
    def stats(self) -> ControlStats:
        c = self._counts
        seg_bytes = self.model.segment_bytes(self.config.segment_tokens)
        return ControlStats(
            c.admitted, c.hit_tokens, c.prefill_tokens, c.dedup_segments * seg_bytes,
            self.pool.stats(),
        )

    @property
    def instances(self) -> tuple[int, ...]:
        """The ids of the instances in the pool now (read-only)."""
        return self.pool.instances

    def home(self, key: bytes) -> int:
        """The instance segment ``key`` hashes to on the ring: where a new segment is
        placed first (read-only)."""
        return self.pool.ring.home(key)

    def record_reads(self, chains: Sequence[tuple[tuple[bytes, ...], Mapping[int, int]]],
                     iterations: int = 1) -> None:
        """Counts ``iterations`` reads of every segment of each ``(keys, per_instance)``
        chain in the access window at the clock's now (``per_instance``: how many of
        those segment reads each instance served; see ``AccessWindow.record``).
        ``gen_plans`` counts one read per call; a caller that runs several iterations on
        one plan (the simulator) counts the others here."""
        self.pool.window.record_many(chains, self.pool.clock(), iterations)

    @property
    def live_requests(self) -> tuple[str, ...]:
        return self._requests.ids()

    @property
    def requests(self) -> RequestTable:
        """The request table (read it; it changes only through this class)."""
        return self._requests

    def prefix_tokens(self, request_id: str) -> int:
        """Tokens of a live request held by the pool."""
        return self._requests.prefix_tokens(request_id)

    def check(self) -> None:
        """Asserts the invariants of the pool, the request table and every transaction
        in flight, and that a request is busy exactly while its plans are (for tests)."""
        self.pool.check()
        self._requests.check(self.pool)
        for iteration, tx in self._inflight.items():
            tx.check(self.pool)
            for rid in tx.requests:
                state = self._requests.get(rid)
                assert state is None or state.busy == iteration, "busy flag out of date"
        for state in self._requests.states():
            assert state.busy == -1 or state.busy in self._inflight, "busy without plans"

    # ------------------------------------------------------------ internals
    def _take_flight(self, plans: Plans) -> Transaction:
        tx = self._inflight.pop(plans.iteration, None)
        if tx is None:
            raise PlanError(f"iteration {plans.iteration} has no plans in flight")
        return tx

    def _count(self, counts: PlanCounts, sign: int) -> None:
        self._counts.add(counts, sign)
        self.pool.count_dedup(sign * counts.dedup_segments)


#: Whose KV a pool holds: TokenLake's own engines (K in the GGUF's interleaved-RoPE
#: order); vLLM's CPU pages, opaque (``tokenlake.integrations.vllm``, load mode); or
#: vLLM's K/V rows in Hugging Face's head order, attended in the pool (its query mode).
#: Part of the namespace: no two of them ever match each other.
KV_LAYOUTS = ("tokenlake", "vllm-cpu", "hf")
#: The element types a pool may hold its K/V in, with their bytes and the short name
#: the namespace carries (a pool's segments never match another dtype's).
KV_DTYPES: dict[str, tuple[int, str]] = {"float32": (4, "f32"), "bfloat16": (2, "bf16"), "float16": (2, "f16")}


def check_kv_dtype(kv_dtype: str) -> str:
    """``kv_dtype`` if it is one of :data:`KV_DTYPES`, else ``ConfigError``."""
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype must be one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
    return kv_dtype


def check_bf16_products(parts: object, what: str = "bf16_products") -> int:
    """``parts`` if it is 0, 1 or 2 (q's bfloat16 parts on the attention kernel's dot
    path; 0: exact products), else ``ConfigError`` naming ``what``."""
    if isinstance(parts, bool) or parts not in (0, 1, 2) or not isinstance(parts, int):
        raise ConfigError(f"{what} must be 0, 1 or 2, got {parts!r}")
    return parts


def pool_control(n_instances: int, model: ModelSpec, pool_bytes: int, segment_tokens: int,
                 kv_dtype: str, clock: Callable[[], float], seed: int = 0,
                 kv_layout: str = "tokenlake", page_tokens: int | None = None,
                 shared_memory: bool = False, tier_bytes: int = 0) -> ControlPlane:
    """The control plane of a cluster of ``n_instances`` slabs of ``pool_bytes`` each,
    holding as many whole segments of ``kv_dtype`` (:data:`KV_DTYPES`) elements as fit
    (the launchers' shared sizing), in the namespace of ``model``, ``kv_dtype``,
    ``segment_tokens`` and ``kv_layout`` (:data:`KV_LAYOUTS`), with page hits of
    ``page_tokens`` (``None``: the default) and ``shared_memory``
    (:class:`~tokenlake.core.config.PoolConfig`), and a disk tier of ``tier_bytes`` per
    instance (0: none; whole segments); ``ConfigError`` without instances, for an
    unknown dtype or layout, or when no segment fits."""
    if n_instances < 1:
        raise ConfigError("need at least one instance")
    if kv_layout not in KV_LAYOUTS:
        raise ConfigError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    dtype_bytes, short = KV_DTYPES[check_kv_dtype(kv_dtype)]
    seg_bytes = model.num_layers * 2 * model.num_kv_heads * segment_tokens * model.head_dim * dtype_bytes
    slots = pool_bytes // seg_bytes
    if slots < 1:
        raise ConfigError(f"pool_bytes={pool_bytes} holds no {seg_bytes}-byte segment")
    namespace = f"{model.name}/{short}/C{segment_tokens}"
    if kv_layout != "tokenlake":
        namespace += f"/{kv_layout}"
    config = PoolConfig(segment_tokens, namespace, slots, seed=seed, page_tokens=page_tokens,
                        shared_memory=shared_memory, tier_slots=tier_bytes // seg_bytes)
    if model.dtype_bytes != dtype_bytes:  # the byte counts (puts, dedup, dispatch) of this pool's K/V
        model = dataclasses.replace(model, dtype_bytes=dtype_bytes)
    return ControlPlane(config, model, list(range(n_instances)), clock=clock)

