"""Strict-locality pooling (paper §4.1): a segment lives where it was computed.

A request's new segments go to the instance computing it (``home``) while that instance
has free slots; only when the home slab is full do the rest spill to other instances,
the one with the most free slots first (ties by instance order in ``free_slots``). This
is the placement whose skew TokenLake's hash placement and replication remove.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping


class PoolFull(RuntimeError):
    """Fewer free slots in the whole pool than segments to place."""


def place(segment_count: int, home: Hashable, free_slots: Mapping[Hashable, int]) -> list:
    """Instances for ``segment_count`` new segments, in segment order. Pure."""
    if segment_count < 0:
        raise ValueError("segment_count must be >= 0")
    if home not in free_slots:
        raise ValueError(f"home {home!r} is not in free_slots")
    free = {k: max(0, int(v)) for k, v in free_slots.items()}
    if sum(free.values()) < segment_count:
        raise PoolFull(f"{segment_count} segments, {sum(free.values())} free slots")
    local = min(segment_count, free[home])
    out = [home] * local
    free[home] -= local
    order = {k: i for i, k in enumerate(free)}
    while len(out) < segment_count:
        target = min((k for k in free if k != home and free[k] > 0),
                     key=lambda k: (-free[k], order[k]))
        out.append(target)
        free[target] -= 1
    return out


class StrictLocalityPlacement:
    """Stateful wrapper: tracks free slots per instance across placements and frees."""

    def __init__(self, slots_per_instance: Mapping[Hashable, int]) -> None:
        self.free = dict(slots_per_instance)

    def place(self, segment_count: int, home: Hashable,
              free_slots: Mapping[Hashable, int] | None = None) -> list:
        targets = place(segment_count, home, self.free if free_slots is None else free_slots)
        if free_slots is None:
            for t in targets:
                self.free[t] -= 1
        return targets

    def release(self, instance: Hashable, count: int = 1) -> None:
        self.free[instance] += count
