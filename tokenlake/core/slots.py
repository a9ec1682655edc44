"""Slot pool: the mechanism that owns each instance's segment slots (mechanism apart from policy).

Each instance owns one slab of ``capacity`` slots (docs/design.md §4); a slot holds one segment
across all layers. This module only hands out and takes back slot numbers; which
segment goes where is decided by placement, what to evict by the cache manager.
"""

from __future__ import annotations

import heapq

from tokenlake.core.errors import ConfigError


class SlotPool:
    """Free lists of segment slots per instance.

    Slots are handed out lowest number first, so a fresh pool fills its slab from the
    front and tests see deterministic slot numbers.
    """

    def __init__(self, capacities: dict[int, int] | None = None) -> None:
        self._capacity: dict[int, int] = {}
        self._free: dict[int, list[int]] = {}  # min-heaps of free slots
        self._free_set: dict[int, set[int]] = {}
        self._n_free = 0  # free slots over all instances
        for instance, capacity in (capacities or {}).items():
            self.add_instance(instance, capacity)

    def add_instance(self, instance: int, capacity: int) -> None:
        """Registers an instance with ``capacity`` empty slots."""
        if instance in self._capacity:
            raise ConfigError(f"instance {instance} is already in the pool")
        if not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"slot capacity must be a non-negative int, got {capacity!r}")
        self._capacity[instance] = capacity
        self._free[instance] = list(range(capacity))  # sorted, hence a valid heap
        self._free_set[instance] = set(range(capacity))
        self._n_free += capacity

    def remove_instance(self, instance: int) -> None:
        """Forgets an instance and all its slots (the caller drops what they held)."""
        self._check(instance)
        self._n_free -= len(self._free[instance])
        del self._capacity[instance]
        del self._free[instance]
        del self._free_set[instance]

    def allocate(self, instance: int) -> int | None:
        """Takes a free slot on ``instance``; ``None`` when the instance is full."""
        self._check(instance)
        free = self._free[instance]
        if not free:
            return None
        slot = heapq.heappop(free)
        self._free_set[instance].discard(slot)
        self._n_free -= 1
        return slot

    def take(self, instance: int, slot: int) -> None:
        """Takes one particular free slot (undoes a :meth:`free`); ``ValueError`` if in use."""
        self._check(instance)
        if slot not in self._free_set[instance]:
            raise ValueError(f"slot {slot} on instance {instance} is not free")
        self._free_set[instance].remove(slot)
        free = self._free[instance]
        free.remove(slot)
        heapq.heapify(free)
        self._n_free -= 1

    def take_many(self, instance: int, slots: list[int]) -> None:
        """Takes these free slots at once (a restart adopting them); ``ValueError`` if one
        is in use or named twice."""
        self._check(instance)
        wanted = set(slots)
        if len(wanted) != len(slots) or not wanted <= self._free_set[instance]:
            raise ValueError(f"slots {sorted(slots)} on instance {instance} are not all free")
        self._free_set[instance] -= wanted
        self._free[instance] = [s for s in self._free[instance] if s not in wanted]
        heapq.heapify(self._free[instance])
        self._n_free -= len(wanted)

    def free(self, instance: int, slot: int) -> None:
        """Returns a slot. Freeing a slot twice or out of range raises ``ValueError``."""
        self._check(instance)
        if not 0 <= slot < self._capacity[instance]:
            raise ValueError(f"slot {slot} out of range on instance {instance}")
        free_set = self._free_set[instance]
        if slot in free_set:
            raise ValueError(f"slot {slot} on instance {instance} is already free")
        free_set.add(slot)
        heapq.heappush(self._free[instance], slot)
        self._n_free += 1

    def capacity(self, instance: int) -> int:
        self._check(instance)
        return self._capacity[instance]

    def free_count(self, instance: int) -> int:
        self._check(instance)
        return len(self._free[instance])

    def used(self, instance: int) -> int:
        """Slots in use on ``instance``."""
        return self.capacity(instance) - self.free_count(instance)

    @property
    def instances(self) -> tuple[int, ...]:
        return tuple(sorted(self._capacity))

    def total_free(self) -> int:
        return self._n_free

    def check(self) -> None:
        """Asserts that each free list (a heap) and its set hold the same in-range slots
        and that the free total is their sum (for tests)."""
        assert self._n_free == sum(len(f) for f in self._free.values()), "free total off"
        for instance, capacity in self._capacity.items():
            free = self._free[instance]
            assert sorted(free) == sorted(self._free_set[instance]), "free heap and set differ"
            assert all(0 <= s < capacity for s in free), "free slot out of range"
            assert all(free[i] <= free[c] for i in range(len(free))
                       for c in (2 * i + 1, 2 * i + 2) if c < len(free)), "free list not a heap"

    def _check(self, instance: int) -> None:
        if instance not in self._capacity:
            raise ConfigError(f"unknown instance {instance}; known: {sorted(self._capacity)}")
