"""Placement policies (docs/design.md §4, paper §4.3-§4.4), as pure functions and small structures.

* :class:`HashRing` gives every segment a stable home instance (consistent hashing with
  virtual nodes: adding or removing one of N instances moves about 1/N of the homes).
* :class:`AccessWindow` counts segment accesses per replica in a sliding time window.
* :func:`find_heavy_hitters` walks the prefix tree best-first from the root over the
  O(N log N) most accessed segments.
* :func:`plan_replication` picks heavy hitters on overloaded instances to copy to the
  least loaded instance lacking a copy, with hysteresis.
* :func:`choose_replica` is the power-of-two-choices replica selection.

Nothing here allocates slots or moves data: :class:`tokenlake.core.pool.CachePool` applies
the decisions.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from tokenlake.core.errors import ConfigError
from tokenlake.core.segments import SegmentKey


class HashRing:
    """Consistent hashing of segment keys onto instances.

    Each instance owns ``vnodes`` points on a 64-bit ring; a key's home is the owner of
    the first point at or after the key's position. Positions come from blake2b, so the
    ring is the same in every process.
    """

    def __init__(self, instances: Sequence[int] = (), vnodes: int = 64) -> None:
        if vnodes < 1:
            raise ConfigError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[int] = []
        self._instances: set[int] = set()
        for inst in instances:
            self.add(inst)

    @staticmethod
    def _point(instance: int, v: int) -> int:
        digest = hashlib.blake2b(f"instance:{instance}:{v}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    @staticmethod
    def position(key: SegmentKey) -> int:
        """A key's ring position (keys are uniform already; take their first 8 bytes)."""
        return int.from_bytes(key[:8], "little")

    @property
    def instances(self) -> tuple[int, ...]:
        return tuple(sorted(self._instances))

    def add(self, instance: int) -> None:
        if instance in self._instances:
            raise ConfigError(f"instance {instance} is already on the ring")
        self._instances.add(instance)
        for v in range(self.vnodes):
            p = self._point(instance, v)
            i = bisect.bisect_left(self._points, p)
            self._points.insert(i, p)
            self._owners.insert(i, instance)

    def remove(self, instance: int) -> None:
        if instance not in self._instances:
            raise ConfigError(f"instance {instance} is not on the ring")
        self._instances.discard(instance)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != instance]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def home(self, key: SegmentKey) -> int:
        """The home instance of ``key``."""
        if not self._points:
            raise ConfigError("the ring has no instances")
        i = bisect.bisect_left(self._points, self.position(key))
        return self._owners[i % len(self._owners)]

    def preference(self, key: SegmentKey) -> Iterator[int]:
        """Distinct instances in ring order starting with the home (spill order)."""
        if not self._points:
            return
        n = len(self._owners)
        start = bisect.bisect_left(self._points, self.position(key))
        seen: set[int] = set()
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._instances):
                    return


class AccessWindow:
    """Cache accesses in a sliding window of ``window_s`` seconds (injected time).

    The unit of recording is a *chain*: the tuple of segment keys one request attended
    in one iteration, with the instance each was read from. Recording costs O(distinct
    instances) so that a plan touching thousands of segments stays cheap; per-segment
    counts are expanded once per closed bucket of ``bucket_s`` seconds, with repeated
    records of the same chain object folded together first.
    """

    def __init__(self, window_s: float = 10.0, bucket_s: float = 1.0) -> None:
        if window_s <= 0 or bucket_s <= 0 or bucket_s > window_s:
            raise ConfigError("need 0 < bucket_s <= window_s")
        self.window_s = window_s
        self.bucket_s = bucket_s
        # Closed buckets: (bucket number, per-segment Counter, per-instance Counter).
        self._closed: deque[tuple[int, Counter, Counter]] = deque()
        self._open_bucket: int | None = None
        self._open_chains: dict[int, list] = {}  # id(keys) -> [keys, per_instance, count]
        self._open_insts: Counter | None = None  # per-instance reads of the open chains, cached
        self._total: Counter = Counter()  # per-instance reads since creation, closed buckets
        self._segments: Counter = Counter()  # sum over closed buckets
        self._instances: Counter = Counter()  # sum over closed buckets

    def record(
        self,
        keys: tuple[SegmentKey, ...],
        per_instance: Mapping[int, int],
        now: float,
        count: int = 1,
    ) -> None:
        """Records ``count`` reads of every segment in ``keys``.

        ``per_instance`` says how many of those segment reads each instance served.
        Pass the same ``keys`` tuple object for repeated reads of the same chain.
        """
        self.record_many(((keys, per_instance),), now, count)

    def record_many(
        self,
        chains: Iterable[tuple[tuple[SegmentKey, ...], Mapping[int, int]]],
        now: float,
        count: int = 1,
    ) -> None:
        """:meth:`record` for several ``(keys, per_instance)`` chains at once."""
        self._advance(now)
        open_chains = self._open_chains
        self._open_insts = None
        for keys, per_instance in chains:
            entry = open_chains.get(id(keys))
            if entry is None:
                open_chains[id(keys)] = [keys, per_instance, count]
            else:
                entry[2] += count

    def _advance(self, now: float) -> None:
        bucket = int(now // self.bucket_s)
        if self._open_bucket is not None and bucket != self._open_bucket:
            segs, insts = self._expand_open(), self._open_instance_counts()
            self._closed.append((self._open_bucket, segs, insts))
            self._segments.update(segs)
            self._instances.update(insts)
            self._total.update(insts)
            self._open_chains, self._open_insts = {}, None
        self._open_bucket = bucket
        oldest = int((now - self.window_s) // self.bucket_s)
        while self._closed and self._closed[0][0] <= oldest:
            _, segs, insts = self._closed.popleft()
            self._segments.subtract(segs)
            self._instances.subtract(insts)
            self._segments = +self._segments  # drop zero counts
            self._instances = +self._instances

    def _expand_open(self) -> Counter:
        segs: Counter = Counter()
        for keys, _, count in self._open_chains.values():
            for key in keys:
                segs[key] += count
        return segs

    def _open_instance_counts(self) -> Counter:
        """Per-instance reads of the open bucket's chains (computed once per change:
        every replica choice of an iteration asks for the instances' load)."""
        if self._open_insts is None:
            insts: Counter = Counter()
            for _, per_instance, count in self._open_chains.values():
                for inst, n in per_instance.items():
                    insts[inst] += n * count
            self._open_insts = insts
        return self._open_insts

    def total_instance_accesses(self, now: float) -> Counter:
        """Segment reads served by each instance since the window was created."""
        self._advance(now)
        return self._total + self._open_instance_counts()

    def segment_accesses(self, now: float) -> Counter:
        """Reads of each segment in the window ending at ``now``."""
        self._advance(now)
        return self._segments + self._expand_open()

    def instance_accesses(self, now: float) -> Counter:
        """Segment reads served by each instance in the window ending at ``now``."""
        self._advance(now)
        return self._instances + self._open_instance_counts()

    def forget_instance(self, instance: int) -> None:
        """Drops the per-instance counts of a removed instance."""
        self._instances.pop(instance, None)
        self._total.pop(instance, None)
        self._open_insts = None
        for entry in self._open_chains.values():
            if instance in entry[1]:
                entry[1] = {i: n for i, n in entry[1].items() if i != instance}
        for _, _, insts in self._closed:
            insts.pop(instance, None)


def heavy_hitter_budget(n_instances: int, factor: float = 1.0) -> int:
    """How many heavy hitters to track: ``ceil(factor * N * log2(N))``, at least N."""
    if n_instances <= 1:
        return 0
    return max(n_instances, math.ceil(factor * n_instances * math.log2(n_instances)))


def find_heavy_hitters(
    roots: Sequence[SegmentKey],
    children: Callable[[SegmentKey], Sequence[SegmentKey]],
    accesses: Mapping[SegmentKey, int],
    budget: int,
) -> list[SegmentKey]:
    """The ``budget`` most accessed segments, by a best-first walk from the root.

    A segment is accessed only together with its whole prefix, so accesses never grow
    from parent to child; expanding the hottest frontier node first therefore finds the
    top segments without visiting the cold rest of the tree. Segments with no access
    are never heavy. Ties break by key so the result is deterministic.
    """
    heap = [(-accesses.get(k, 0), k) for k in roots if accesses.get(k, 0) > 0]
    heapq.heapify(heap)
    out: list[SegmentKey] = []
    while heap and len(out) < budget:
        _, key = heapq.heappop(heap)
        out.append(key)
        for child in children(key):
            c = accesses.get(child, 0)
            if c > 0:
                heapq.heappush(heap, (-c, child))
    return out


@dataclass(frozen=True)
class ReplicationDecision:
    """Copy segment ``key`` from ``source`` (an instance holding it) to ``target``."""

    key: SegmentKey
    source: int
    target: int


def expected_load(
    accesses: Mapping[SegmentKey, int], replicas: Callable[[SegmentKey], Sequence[int]]
) -> dict[int, float]:
    """Per-instance load if every segment's accesses split evenly over its replicas.

    Replication decides on this estimate rather than on the measured window, which lags
    behind a new replica and would make replication oscillate.
    """
    load: dict[int, float] = {}
    for key, count in accesses.items():
        reps = replicas(key)
        if not reps:
            continue
        share = count / len(reps)
        for inst in reps:
            load[inst] = load.get(inst, 0.0) + share
    return load


def plan_replication(
    heavy: Sequence[SegmentKey],
    accesses: Mapping[SegmentKey, int],
    replicas: Callable[[SegmentKey], Sequence[int]],
    load: Mapping[int, float],
    instances: Sequence[int],
    high: float = 0.10,
    low: float = 0.03,
    max_decisions: int = 64,
    has_room: Callable[[int], bool] = lambda _inst: True,
) -> list[ReplicationDecision]:
    """Heavy-hitter replication with hysteresis (paper §4.3).

    An instance is overloaded when its load exceeds ``mean * (1 + high)``; its heavy
    hitters, hottest first, are copied to the least loaded instance without a copy until
    its load drops to ``mean * (1 + low)``. A copy is made only if it lowers the source's
    load without pushing the target above the source. ``high > low`` is the hysteresis.
    """
    if not 0 <= low <= high:
        raise ConfigError("need 0 <= low <= high")
    if not instances:
        return []
    est = {i: float(load.get(i, 0.0)) for i in instances}
    mean = sum(est.values()) / len(est)
    if mean <= 0:
        return []
    reps = {k: list(replicas(k)) for k in heavy}
    decisions: list[ReplicationDecision] = []
    for src in sorted(instances, key=lambda i: (-est[i], i)):
        if est[src] <= mean * (1 + high):
            break
        for key in sorted((k for k in heavy if src in reps[k]), key=lambda k: -accesses[k]):
            if est[src] <= mean * (1 + low) or len(decisions) >= max_decisions:
                break
            current = reps[key]
            candidates = [i for i in instances if i not in current and has_room(i)]
            if not candidates:
                continue
            target = min(candidates, key=lambda i: (est[i], i))
            old_share = accesses[key] / len(current)
            new_share = accesses[key] / (len(current) + 1)
            if est[target] + new_share > est[src] - (old_share - new_share):  # target above source
                continue
            for inst in current:
                est[inst] -= old_share - new_share
            est[target] += new_share
            current.append(target)
            decisions.append(ReplicationDecision(key, src, target))
    return decisions


def choose_replica(
    candidates: Sequence[int], load: Mapping[int, float], rng: random.Random
) -> int:
    """Power of two choices: of two random distinct replicas, the less loaded one."""
    if not candidates:
        raise ValueError("no replica to choose from")
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(list(candidates), 2)
    return a if load.get(a, 0) <= load.get(b, 0) else b


def coefficient_of_variation(values: Sequence[float]) -> float:
    """Population standard deviation over mean of ``values`` (0 when empty or all zero):
    the paper's measure of access-load balance across instances (§7)."""
    if not values:
        return 0.0
    mean = sum(values) / len(values)
    if mean == 0:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean
