"""Per-request bookkeeping of the control plane: what a live request holds in the pool.

A live request holds a *chain* of sealed segments (leased for its lifetime, so a
running request never loses its prefix) and at most one private *open tail*: a slot
with fewer than ``C`` tokens that becomes a shared segment when it fills (DESIGN §4).
The query side of a request (which replica of each segment to read) is resolved once
and reused every iteration until the chain grows or replicas change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from tokenlake.core.prefix_tree import SegmentLocation
from tokenlake.core.segments import SegmentKey


@dataclass
class RequestState:
    """Mutable state of one live request (owned by :class:`~tokenlake.core.control.ControlPlane`)."""

    request_id: str
    chain: list[SegmentKey] = field(default_factory=list)
    tail: SegmentLocation | None = None
    tail_tokens: list[int] = field(default_factory=list)
    busy: int = -1  # iteration whose plans are in flight for this request, -1 if none
    lost: bool = False  # part of its prefix went with a removed instance: finish it
    # Query-side resolution cache (see ControlPlane._resolve).
    epoch: int = -1
    keys: tuple[SegmentKey, ...] = ()
    chosen: tuple[int, ...] = ()  # instance read for each of ``keys``
    by_instance: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    histogram: dict[int, int] = field(default_factory=dict)

    def prefix_tokens(self, segment_tokens: int) -> int:
        """Tokens of this request held by the pool (sealed chain plus open tail)."""
        return len(self.chain) * segment_tokens + len(self.tail_tokens)

    version: int = -1  # changes whenever the resolution above is redone

    def snapshot(self) -> tuple:
        """State to restore if the iteration fails (the chain only grows meanwhile)."""
        # During an iteration the tail token list is only extended in place or replaced.
        return (len(self.chain), self.tail, self.tail_tokens, len(self.tail_tokens))

    def restore(self, snap: tuple) -> None:
        del self.chain[snap[0] :]
        self.tail, self.tail_tokens = snap[1], snap[2]
        del self.tail_tokens[snap[3] :]
        self.epoch = -1


class NewTokenPut(NamedTuple):
    """Rows ``[start, stop)`` of a request's new tokens go to ``offset`` of a slot.

    Internal to ``gen_plans`` (a NamedTuple: immutable and cheap to build on the hot
    path); the public form is :class:`tokenlake.core.plans.PutItem`."""

    start: int
    stop: int
    instance: int
    slot: int
    offset: int
    key: SegmentKey | None
