"""The control plane: ``get_prefix_tree``, ``get_cache_load`` and ``gen_plans`` (DESIGN §3).

:class:`ControlPlane` turns the scheduler's batches and degrees of parallelism into
query plans, transfer plans and instance groups for one iteration:

1. each request's prefix is resolved to one replica per segment (power of two choices,
   cached across iterations), and its new tokens are given slots (deduplicated against
   the tree; the open tail stays private until it fills);
2. every batch becomes DoP sub-batch nodes, each with the bytes it would send to every
   instance, and the nodes are matched to instances (:mod:`tokenlake.core.dispatch`);
3. the plans are assembled with the chosen home of every sub-batch.

After the data plane has stored every layer the caller reports :meth:`ControlPlane.complete`
(new segments become visible) or :meth:`ControlPlane.abort`.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenlake.core.assembly import Part, PartAssembler, Prepared
from tokenlake.core.config import PoolConfig
from tokenlake.core.cost_model import LatencyModel, LoadRequest
from tokenlake.core.cost_model import get_cache_load as _cache_load
from tokenlake.core.dispatch import DispatchNode, dispatch, split_tokens
from tokenlake.core.errors import ConfigError, PlanError, PrefixNotCached
from tokenlake.core.plans import (
    Batch,
    BatchRequest,
    Plans,
    QueryPlan,
    TransferPlan,
)
from tokenlake.core.pool import CachePool, PoolStats, Replication
from tokenlake.core.prefix_tree import PrefixTree, SegmentLocation
from tokenlake.core.requests import NewTokenPut, RequestState
from tokenlake.core.specs import HardwareProfile, ModelSpec

_versions = itertools.count()  # resolution versions, unique across requests


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


@dataclass
class _Inflight:
    commits: list[tuple[bytes, int]]
    release_private: list[tuple[SegmentLocation, str]]  # (open tail, its owner)
    requests: list[str]
    undo: list[Callable[[], None]]
    snapshots: dict[str, tuple]
    stored: set[bytes] = field(default_factory=set)  # keys of ``commits``
    # Keys that went with an instance removed while in flight: the undo and commit of
    # this flight must leave them alone (the same key may be stored again meanwhile).
    gone: set[bytes] = field(default_factory=set)


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
        self._requests: dict[str, RequestState] = {}
        self._inflight: dict[int, _Inflight] = {}
        self._iteration = 0
        self._epoch = 0  # bumps when replicas appear or vanish: resolutions are redone
        self._admitted = self._hit_tokens = self._prefill_tokens = 0
        self._dedup_bytes = 0
        self._assembler = PartAssembler()
        layers = model.num_layers
        # Bytes one q row costs per remote instance (q out, partial o + lse back), all layers.
        self._query_row_bytes = layers * (
            model.q_bytes_per_token_layer + model.partial_bytes_per_token_layer
        )
        self._kv_row_bytes = model.kv_bytes_per_token  # one token's KV, all layers

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

    def gen_plans(self, batches: Sequence[Batch], dops: Sequence[int]) -> Plans:
        """Plans one iteration: where every batch runs and what it reads and stores.

        Raises :class:`PlanError` for malformed batches (empty, duplicate request ids,
        DoPs that do not fit the cluster, a request whose previous plans are still in
        flight), :class:`PrefixNotCached` for a declared prefix the pool does not hold,
        and :class:`~tokenlake.core.errors.CapacityError` when new segments cannot be placed.
        On any error the pool and the requests are left as they were.
        """
        self._validate(batches, dops)
        iteration = self._iteration
        flight = _Inflight([], [], [], [], {})
        evicted: list[tuple] = []
        self.pool.eviction_log = evicted
        try:
            per_request = self._prepare(batches, flight)
            plans = self._assemble(batches, dops, per_request, iteration)
        except BaseException:
            self._rollback(flight)
            self.pool.restore_evicted(evicted)  # no data moved: the evicted are intact
            raise
        finally:
            self.pool.eviction_log = None
        for rid in flight.requests:
            self._requests[rid].busy = iteration
        self._inflight[iteration] = flight
        self._iteration += 1
        return plans

    # ------------------------------------------------------ plan completion
    def complete(self, plans: Plans) -> None:
        """Every put of ``plans`` is stored in all layers: new segments become visible."""
        flight = self._take_flight(plans)
        for key, inst in flight.commits:
            if key in self.pool.tree and key not in flight.gone:
                self.pool.commit(key, inst)
        for loc, owner in flight.release_private:
            self.pool.release_private(loc, owner)
        for rid in flight.requests:
            state = self._requests.get(rid)
            if state is not None:
                state.busy = -1

    def abort(self, plans: Plans) -> None:
        """The data plane failed to run ``plans``: undo them; requests keep their old state."""
        flight = self._take_flight(plans)
        self._rollback(flight)
        for rid in flight.requests:
            if rid in self._requests:
                self._requests[rid].busy = -1

    def finish_request(self, request_id: str) -> None:
        """The request is done: release its prefix lease and its open tail."""
        state = self._requests.pop(request_id, None)
        if state is None:
            raise PlanError(f"unknown request {request_id!r}")
        if state.busy >= 0:
            self._requests[request_id] = state
            raise PlanError(f"request {request_id!r} has plans in flight; complete or abort first")
        tree = self.pool.tree
        now = self.pool.clock()
        for key, inst in zip(state.keys, state.chosen):
            if key in tree and any(loc.instance == inst for loc in tree.replicas(key)):
                tree.touch(key, inst, now)  # last access of a leased replica = release time
        tree.unlease(state.chain, missing_ok=True)
        if state.tail is not None:
            self.pool.release_private(state.tail, request_id)

    def rebalance(self) -> list[Replication]:
        """Starts heavy-hitter replications (see :meth:`CachePool.rebalance`)."""
        return self.pool.rebalance()

    def start_replication(self, key: bytes, target: int) -> Replication:
        """Starts one replication by hand (see :meth:`CachePool.start_replication`)."""
        return self.pool.start_replication(key, target)

    def drop_replica(self, key: bytes, instance: int) -> None:
        """Frees one replica of a segment that has another ready one (migration's last
        step). Raises ``ValueError`` if it is the only ready replica."""
        tree = self.pool.tree
        others = [loc for loc in tree.replicas(key) if loc.instance != instance]
        if not others:
            raise ValueError(f"segment {key.hex()} has no other ready replica")
        self.pool.slots.free(instance, tree.remove_replica(key, instance))
        self._epoch += 1

    def finish_replication(self, rep: Replication) -> None:
        self.pool.finish_replication(rep)
        self._epoch += 1

    def remove_instance(self, instance: int) -> tuple[str, ...]:
        """Takes a failed instance out of the pool. Returns the ids of requests that lost
        part of their prefix: they must be finished and recomputed (planning them again
        raises :class:`PlanError`). Plans in flight can still be completed or aborted."""
        removal = self.pool.remove_instance(instance)
        gone = set(removal.removed_keys)
        lost = set(removal.lost_private)
        for flight in self._inflight.values():
            flight.gone |= gone
        for rid, state in self._requests.items():
            cut = next((i for i, k in enumerate(state.chain) if k in gone), None)
            if cut is not None:
                # The gone keys are a suffix (a subtree went) and their leases went with
                # them: drop them, or finishing the request would unlease a segment that
                # was stored again meanwhile, under another request's lease.
                del state.chain[cut:]
                lost.add(rid)
        for rid in lost:
            state = self._requests.get(rid)
            if state is not None:
                state.lost = True
                if state.tail is not None and state.tail.instance == instance:
                    state.tail = None
        self._epoch += 1
        return tuple(sorted(lost))

    def add_instance(self, instance: int) -> None:
        """An empty instance joins the pool (a new one, or a failed one restarted with an
        empty slab): it takes its share of the hash ring from the next placement on."""
        self.pool.add_instance(instance)
        self._epoch += 1

    def stats(self) -> ControlStats:
        return ControlStats(
            self._admitted, self._hit_tokens, self._prefill_tokens, self._dedup_bytes, self.pool.stats()
        )

    @property
    def live_requests(self) -> tuple[str, ...]:
        return tuple(self._requests)

    def prefix_tokens(self, request_id: str) -> int:
        """Tokens of a live request held by the pool."""
        return self._requests[request_id].prefix_tokens(self.config.segment_tokens)

    # ------------------------------------------------------------ internals
    def _validate(self, batches: Sequence[Batch], dops: Sequence[int]) -> None:
        if len(batches) != len(dops):
            raise PlanError(f"{len(batches)} batches but {len(dops)} DoPs")
        if any(type(d) is not int or d < 1 for d in dops):
            raise PlanError(f"every DoP must be a positive int, got {list(dops)}")
        if sum(dops) > len(self.pool.instances):
            raise PlanError(
                f"sub-batches ({sum(dops)}) exceed instances ({len(self.pool.instances)})"
            )
        seen: set[str] = set()
        for b, batch in enumerate(batches):
            if not batch.requests:
                raise PlanError(f"batch {b} is empty")
            if batch.phase not in ("prefill", "decode"):
                raise PlanError(f"batch {b} has unknown phase {batch.phase!r}")
            for req in batch.requests:
                if req.request_id in seen:
                    raise PlanError(f"request {req.request_id!r} appears twice in one iteration")
                seen.add(req.request_id)
                if not req.new_token_ids:
                    raise PlanError(f"request {req.request_id!r} has no new tokens")
                state = self._requests.get(req.request_id)
                if state is not None and state.busy >= 0:
                    raise PlanError(f"request {req.request_id!r} has plans in flight")
                if state is not None and state.lost:
                    raise PlanError(
                        f"request {req.request_id!r} lost part of its prefix with a removed "
                        "instance; finish it and recompute"
                    )
                if state is not None and req.prefix_token_ids:
                    raise PlanError(
                        f"request {req.request_id!r} is live; send prefix_token_ids only first"
                    )

    def _take_flight(self, plans: Plans) -> _Inflight:
        flight = self._inflight.pop(plans.iteration, None)
        if flight is None:
            raise PlanError(f"iteration {plans.iteration} has no plans in flight")
        return flight

    def _rollback(self, flight: _Inflight) -> None:
        for undo in reversed(flight.undo):
            undo()
        for rid, snap in flight.snapshots.items():
            if snap is None:
                self._requests.pop(rid, None)
            else:
                self._requests[rid].restore(snap)
        flight.undo.clear()

    def _prepare(self, batches: Sequence[Batch], flight: _Inflight):
        """Admits new requests, resolves prefixes and places new tokens, per request.

        Every request is admitted (its declared prefix leased) before any is placed: a
        placement may evict, and must not take a later request's declared prefix.
        """
        out = {}
        c = self.config.segment_tokens
        admitted = [(batch, req, self._admit(req, flight))
                    for batch in batches for req in batch.requests]
        for batch, req, state in admitted:
            have = len(state.tail_tokens)
            prefix_tokens = len(state.chain) * c + have
            self._resolve(state)
            tail = state.tail
            new = req.new_token_ids
            if tail is not None and have + len(new) < c:  # decode fast path: tail grows
                tail_item = (tail.instance, tail.slot, have)
                puts = (NewTokenPut(0, len(new), tail.instance, tail.slot, have, None),)
                state.tail_tokens.extend(new)
            else:
                tail_item = (tail.instance, tail.slot, have) if tail else None
                puts = tuple(self._place_new_tokens(state, new, flight))
            if batch.phase == "prefill":
                self._count(flight, prefill=len(new))
            out[req.request_id] = Prepared(prefix_tokens, state, tail_item, puts)
        return out

    def _admit(self, req: BatchRequest, flight: _Inflight) -> RequestState:
        state = self._requests.get(req.request_id)
        flight.requests.append(req.request_id)
        if state is not None:
            flight.snapshots[req.request_id] = state.snapshot()
            return state
        c = self.config.segment_tokens
        prefix = req.prefix_token_ids
        if len(prefix) % c:
            raise PrefixNotCached(
                f"request {req.request_id!r}: prefix of {len(prefix)} tokens is not a whole "
                f"number of {c}-token segments"
            )
        match = self.pool.tree.match(prefix)
        if match.hit_tokens != len(prefix):
            raise PrefixNotCached(
                f"request {req.request_id!r}: only {match.hit_tokens} of {len(prefix)} prefix "
                "tokens are cached and ready"
            )
        state = RequestState(req.request_id, chain=list(match.keys))
        self.pool.tree.lease(state.chain)
        flight.undo.append(
            lambda keys=tuple(state.chain): self.pool.tree.unlease(
                [k for k in keys if k not in flight.gone], True
            )
        )
        self._requests[req.request_id] = state
        flight.snapshots[req.request_id] = None
        self._count(flight, admitted=1, hit=len(prefix))
        return state

    def _count(self, flight: _Inflight, admitted=0, hit=0, prefill=0, dedup=0) -> None:
        """Adds to the hit and dedup counters; a rollback of ``flight`` takes it back."""
        self._add_counts(admitted, hit, prefill, dedup)
        flight.undo.append(lambda: self._add_counts(-admitted, -hit, -prefill, -dedup))

    def _add_counts(self, admitted: int, hit: int, prefill: int, dedup: int) -> None:
        self._admitted += admitted
        self._hit_tokens += hit
        self._prefill_tokens += prefill
        if dedup:
            self.pool.count_dedup(dedup)
            self._dedup_bytes += dedup * self.model.segment_bytes(self.config.segment_tokens)

    def _resolve(self, state: RequestState) -> None:
        """Chooses one ready replica per chain segment (cached until the chain changes)."""
        if state.epoch == self._epoch and len(state.keys) == len(state.chain):
            return
        tree = self.pool.tree
        load = self.pool.instance_load()
        by_instance: dict[int, tuple[list[int], list[int]]] = {}
        c = self.config.segment_tokens
        chosen: list[int] = []
        for key in state.chain:
            locs = tree.replicas(key)
            if not locs:
                raise PlanError(
                    f"segment {key.hex()} of request {state.request_id!r} is still being "
                    "stored; complete the iteration that stores it first"
                )
            loc = self.pool.choose(locs, load)
            load[loc.instance] = load.get(loc.instance, 0) + 1
            chosen.append(loc.instance)
            slots, toks = by_instance.setdefault(loc.instance, ([], []))
            slots.append(loc.slot)
            toks.append(c)
        state.keys = tuple(state.chain)
        state.by_instance = {i: (tuple(s), tuple(t)) for i, (s, t) in by_instance.items()}
        state.version = next(_versions)
        state.histogram = {i: len(s) for i, (s, _) in by_instance.items()}
        state.chosen = tuple(chosen)
        state.epoch = self._epoch


    def _place_new_tokens(
        self, state: RequestState, tokens: tuple[int, ...], flight: _Inflight
    ) -> list[NewTokenPut]:
        """Gives every new token a slot: fills the open tail, seals full segments
        (deduplicated against the tree), and opens a new private tail for the rest."""
        pool, hasher = self.pool, self.pool.hasher
        c = self.config.segment_tokens
        puts: list[NewTokenPut] = []
        pos, n = 0, len(tokens)
        if state.tail is not None:
            have = len(state.tail_tokens)
            take = min(c - have, n)
            if have + take < c:
                puts.append(NewTokenPut(0, take, state.tail.instance, state.tail.slot, have, None))
                state.tail_tokens.extend(tokens[:take])
                return puts
            seg = state.tail_tokens + list(tokens[:take])
            key = hasher.keys(seg, parent=state.chain[-1] if state.chain else None)[0]
            self._extend_chain(state, key, state.tail, have, 0, take, puts, flight)
            state.tail, state.tail_tokens = None, []
            pos = take
        parent = state.chain[-1] if state.chain else None
        full_end = pos + (n - pos) // c * c
        for key in hasher.iter_keys(tokens[pos:full_end], parent=parent):
            self._extend_chain(state, key, None, 0, pos, pos + c, puts, flight)
            pos += c
        if pos < n:
            hint = state.request_id.encode() + len(state.chain).to_bytes(8, "little")
            loc = pool.allocate_private(state.request_id, hint)
            flight.undo.append(lambda loc=loc: pool.release_private(loc, state.request_id))
            puts.append(NewTokenPut(pos, n, loc.instance, loc.slot, 0, None))
            state.tail, state.tail_tokens = loc, list(tokens[pos:])
        return puts

    def _extend_chain(self, state, key, tail, offset, start, stop, puts, flight) -> None:
        """Adds sealed segment ``key`` to the request's chain, storing rows only if new."""
        pool, tree = self.pool, self.pool.tree
        parent = state.chain[-1] if state.chain else None
        index = len(state.chain)
        if key in tree and not tree.is_ready(key) and key not in flight.stored:
            # Being stored by another iteration in flight: its abort would pull the
            # segment from under this request (and it is not visible to plans yet).
            raise PlanError(
                f"segment {key.hex()} of request {state.request_id!r} is still being stored "
                "by plans in flight; complete them first"
            )
        if key in tree:  # dedup: the pool already has (or this iteration stores) it
            self._count(flight, dedup=1)
            if tail is not None:
                flight.release_private.append((tail, state.request_id))
        elif tail is not None:
            pool.seal_private(tail, key, parent, index)
            flight.undo.append(lambda: key in flight.gone or pool.unseal(key, tail, state.request_id))
            flight.commits.append((key, tail.instance))
            flight.stored.add(key)
            puts.append(NewTokenPut(start, stop, tail.instance, tail.slot, offset, key))
        else:
            loc, _ = pool.place(key, parent, index)
            flight.undo.append(lambda: key in flight.gone or pool.abort(key, loc.instance))
            flight.commits.append((key, loc.instance))
            flight.stored.add(key)
            puts.append(NewTokenPut(start, stop, loc.instance, loc.slot, offset, key))
        tree.lease([key])
        flight.undo.append(lambda: key in flight.gone or tree.unlease([key], missing_ok=True))
        state.chain.append(key)

    def _assemble(self, batches, dops, prepared, iteration: int) -> Plans:
        """Splits batches into sub-batches, dispatches them, and builds the plans."""
        self._assembler.begin_iteration()
        parts: list[Part] = []
        for b, (batch, dop) in enumerate(zip(batches, dops)):
            offsets, total = [], 0
            for req in batch.requests:
                offsets.append(total)
                total += len(req.new_token_ids)
            for p, (lo, hi) in enumerate(split_tokens(total, dop)):
                parts.append(self._assembler.build(b, p, batch, offsets, prepared, lo, hi))
        qb, kb = self._query_row_bytes, self._kv_row_bytes
        nodes = [
            DispatchNode(
                part.batch, part.part,
                {i: qb * r for i, r in part.query_rows.items()},
                {i: kb * r for i, r in part.put_rows.items()},
            )
            for part in parts
        ]
        homes = dispatch(nodes, self.pool.instances)
        query_plans, transfer_plans = [], []
        groups: list[list[int]] = [[] for _ in batches]
        self.pool.record_access(a for part in parts for a in part.accesses)
        for part, home in zip(parts, homes):
            groups[part.batch].append(home)
            query_plans.append(
                QueryPlan(part.batch, part.part, home, part.rows, part.spans, part.tasks, part.tails)
            )
            stored = sum(put.stop - put.start for put in part.puts)
            transfer_plans.append(
                TransferPlan(part.batch, part.part, home, part.rows, part.puts, part.rows - stored)
            )
        return Plans(iteration, tuple(query_plans), tuple(transfer_plans), tuple(map(tuple, groups)))


def pool_control(n_instances: int, model: ModelSpec, pool_bytes: int, segment_tokens: int,
                 dtype_bytes: int, clock: Callable[[], float], seed: int = 0) -> ControlPlane:
    """The control plane of a cluster of ``n_instances`` slabs of ``pool_bytes`` each,
    holding as many whole segments of ``dtype_bytes`` elements as fit (the launchers'
    shared sizing); ``ConfigError`` without instances or when no segment fits."""
    if n_instances < 1:
        raise ConfigError("need at least one instance")
    seg_bytes = model.num_layers * 2 * model.num_kv_heads * segment_tokens * model.head_dim * dtype_bytes
    slots = pool_bytes // seg_bytes
    if slots < 1:
        raise ConfigError(f"pool_bytes={pool_bytes} holds no {seg_bytes}-byte segment")
    config = PoolConfig(segment_tokens, f"{model.name}/f32/C{segment_tokens}", slots, seed=seed)
    return ControlPlane(config, model, list(range(n_instances)), clock=clock)
