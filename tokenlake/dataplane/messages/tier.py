"""Tier messages: the driver and the transfer engine of one instance (2x).

The control plane's tier bookkeeping (:mod:`tokenlake.core.tier`) hands its data moves
to the driver, which sends each instance's transfer engine :class:`TierOps` (delete
some files, then stage some slots to be written through) and :class:`TierRead` (read
some files into slots: a promotion); both are answered with :class:`TierDone`. On
start-up the driver asks each engine what its tier holds (:class:`TierList`, answered
with :class:`TierListing`), so a pool started again on the same directory finds the
segments written before. Keys are the segments' 16-byte keys; the engine stages a
slot's bytes before it answers, so the slot may change right after.

A written segment carries where it goes in the prefix tree (:class:`TierEntry`): its
parent's key (``None`` under the unsalted root, a salt's root key for a salted first
segment), its index and its token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenlake.dataplane.messages.base import Fields, WireMessage
from tokenlake.dataplane.wire import Kind

#: What a transfer engine counts of its tier since it started, sent with every
#: :class:`TierDone`: copies written (files, or rows of host memory), writes and removals
#: that failed, copies the staging memory had no room for, reads served and failed
#: (missing, corrupt or truncated), bytes staged but not yet written, seconds the writer
#: waited on the bandwidth limit, and the ``TIER_DONE`` s it sent (``answers``: of two
#: answers that came by different sockets, the one with more is the newer).
TIER_COUNTERS = ("written", "write_errors", "refused", "reads", "read_failures",
                 "staged_bytes", "paced_s", "answers")


def _keys(f: Fields, name: str) -> tuple[bytes, ...]:
    out = []
    for i, k in enumerate(f.list(name, default=[])):
        if not isinstance(k, bytes):
            raise f.error(f"{name}[{i}]", "must be bytes")
        out.append(k)
    return tuple(out)


@dataclass(frozen=True)
class TierEntry:
    """A segment in a tier, as the tree holds it: ``key``, ``parent`` (``None``: under
    the unsalted root), ``index``, ``tokens`` (int32 bytes; ``None``: not recorded).
    Wire form ``[key, parent, index, tokens]``; in ``TIER_OPS`` ``[key, slot, parent,
    index, tokens]``."""

    key: bytes
    parent: bytes | None
    index: int
    tokens: bytes | None

    def to_wire(self) -> list:
        return [self.key, self.parent, self.index, self.tokens]

    @classmethod
    def from_wire(cls, f: Fields, raw, path: str) -> TierEntry:
        key, parent, index, tokens = f.as_list(raw, path, 4)
        for what, v, optional in (("0", key, False), ("1", parent, True), ("3", tokens, True)):
            if not (isinstance(v, bytes) or (optional and v is None)):
                raise f.error(f"{path}[{what}]", "must be bytes" + (" or nil" if optional else ""))
        return cls(key, parent, f.as_int(index, f"{path}[2]"), tokens)


def _items(f: Fields, name: str) -> tuple[tuple[bytes, int, int], ...]:
    out = []
    for i, raw in enumerate(f.list(name, default=[])):
        key, slot, target = f.as_list(raw, f"{name}[{i}]", 3)
        if not isinstance(key, bytes):
            raise f.error(f"{name}[{i}][0]", "must be bytes")
        out.append((key, f.as_int(slot, f"{name}[{i}][1]"), f.as_int(target, f"{name}[{i}][2]")))
    return tuple(out)


@dataclass(frozen=True)
class TierOps(WireMessage):
    """``TIER_OPS`` ``{"drops": [key, ...], "writes": [[key, slot, parent, index,
    tokens], ...]}``: delete the tier files of ``drops``, then stage each write's slot
    (all layers) to be written to the tier as its :class:`TierEntry` in the background.
    Answered with :class:`TierDone` once staged: ``done`` the writes staged, ``failed``
    those refused (the staging memory is full, or the message is fenced off).

    ``epoch`` (both this and :class:`TierRead`; default 0): the driver's fence. An
    engine refuses, whole, a message whose epoch is below the highest it has seen; a
    driver that got no answer sends an empty ``TIER_OPS`` of a higher epoch, and once
    that one is answered the unanswered message can no longer touch a slot."""

    KIND = Kind.TIER_OPS
    drops: tuple[bytes, ...] = ()
    writes: tuple[tuple[int, TierEntry], ...] = ()  # (slot, what it holds)
    epoch: int = 0

    def body(self) -> dict:
        return {"drops": list(self.drops), "epoch": self.epoch,
                "writes": [[e.key, slot, e.parent, e.index, e.tokens] for slot, e in self.writes]}

    @classmethod
    def from_wire(cls, f: Fields) -> TierOps:
        f.tensors(0)
        writes = []
        for i, raw in enumerate(f.list("writes", default=[])):
            item = f.as_list(raw, f"writes[{i}]", 5)
            entry = TierEntry.from_wire(f, [item[0], *item[2:]], f"writes[{i}]")
            writes.append((f.as_int(item[1], f"writes[{i}][1]"), entry))
        return cls(_keys(f, "drops"), tuple(writes), f.int("epoch", default=0))


@dataclass(frozen=True)
class TierRead(WireMessage):
    """``TIER_READ`` ``{"items": [[key, slot, target], ...]}``: read each key's tier file
    into ``slot`` (all layers) of instance ``target`` (-1: this engine's; another: a
    co-located slab this engine maps), its digest checked first (a promotion).
    Answered with :class:`TierDone` once every slot is written: ``failed`` the keys whose
    file is missing, corrupt or of another size, or whose target this engine cannot
    write, or all of them when ``epoch`` is fenced off (:class:`TierOps`; their slots are
    left as they were)."""

    KIND = Kind.TIER_READ
    items: tuple[tuple[bytes, int, int], ...] = ()
    epoch: int = 0
    #: read the items layer by layer (layer 0 of every file, then layer 1, ...) and send
    #: a :class:`TierProgress` once a layer of them all is in its slots, digest checked
    #: (default false: the answer alone)
    layered: bool = False

    def body(self) -> dict:
        return {"items": [list(item) for item in self.items], "epoch": self.epoch, "layered": self.layered}

    @classmethod
    def from_wire(cls, f: Fields) -> TierRead:
        f.tensors(0)
        return cls(_items(f, "items"), f.int("epoch", default=0), f.bool("layered", default=False))


@dataclass(frozen=True)
class TierProgress(WireMessage):
    """``TIER_PROGRESS`` ``{"layers": int}``: sent during a ``layered``
    :class:`TierRead`, under its message id, before its :class:`TierDone`: the first
    ``layers`` layers of every item are in their slots, each checked against its
    digest. Never sent for a layer that failed; the answer says which keys did."""

    KIND = Kind.TIER_PROGRESS
    layers: int = 0

    def body(self) -> dict:
        return {"layers": self.layers}

    @classmethod
    def from_wire(cls, f: Fields) -> TierProgress:
        f.tensors(0)
        layers = f.int("layers")
        if layers < 0:
            raise f.error("layers", "must be >= 0")
        return cls(layers)


@dataclass(frozen=True)
class TierDone(WireMessage):
    """``TIER_DONE`` ``{"done": [key, ...], "failed": [key, ...], "counters": {name:
    number}}``: the answer to :class:`TierOps` and :class:`TierRead`. ``counters``
    (optional) are the engine's :data:`TIER_COUNTERS` as they stand; a name it does not
    send reads 0, one this side does not know is ignored."""

    KIND = Kind.TIER_DONE
    done: tuple[bytes, ...] = ()
    failed: tuple[bytes, ...] = ()
    counters: dict[str, float] = field(default_factory=dict)

    def body(self) -> dict:
        return {"done": list(self.done), "failed": list(self.failed), "counters": dict(self.counters)}

    @classmethod
    def from_wire(cls, f: Fields) -> TierDone:
        f.tensors(0)
        raw = f.body.get("counters", {})
        if not isinstance(raw, dict):
            raise f.error("counters", "must be a map of counter names to numbers")
        counters = {name: f.as_float(raw[name], f"counters.{name}") for name in TIER_COUNTERS if name in raw}
        return cls(_keys(f, "done"), _keys(f, "failed"), counters)


@dataclass(frozen=True)
class TierList(WireMessage):
    """``TIER_LIST`` ``{}``: what does this engine's tier hold? Answered with
    :class:`TierListing`."""

    KIND = Kind.TIER_LIST

    @classmethod
    def from_wire(cls, f: Fields) -> TierList:
        f.tensors(0)
        return cls()


@dataclass(frozen=True)
class TierListing(WireMessage):
    """``TIER_LISTING`` ``{"entries": [[key, parent, index, tokens], ...]}``: the
    segments the tier holds, least recently used first (files written without an entry
    are not listed)."""

    KIND = Kind.TIER_LISTING
    entries: tuple[TierEntry, ...] = ()

    def body(self) -> dict:
        return {"entries": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, f: Fields) -> TierListing:
        f.tensors(0)
        return cls(tuple(TierEntry.from_wire(f, raw, f"entries[{i}]")
                         for i, raw in enumerate(f.list("entries", default=[]))))
