"""Disk-tier messages: the driver and the transfer engine of one instance (2x).

The control plane's tier bookkeeping (:mod:`tokenlake.core.tier`) hands its data moves
to the driver, which sends each instance's transfer engine :class:`TierOps` (delete
some files, then stage some slots to be written through) and :class:`TierRead` (read
some files into slots: a promotion); both are answered with :class:`TierDone`. Keys
are the segments' 16-byte keys; the engine stages a slot's bytes before it answers,
so the slot may change right after.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenlake.dataplane.messages.base import Fields, WireMessage
from tokenlake.dataplane.wire import Kind


def _keys(f: Fields, name: str) -> tuple[bytes, ...]:
    out = []
    for i, k in enumerate(f.list(name, default=[])):
        if not isinstance(k, bytes):
            raise f.error(f"{name}[{i}]", "must be bytes")
        out.append(k)
    return tuple(out)


def _items(f: Fields, name: str) -> tuple[tuple[bytes, int], ...]:
    out = []
    for i, raw in enumerate(f.list(name, default=[])):
        key, slot = f.as_list(raw, f"{name}[{i}]", 2)
        if not isinstance(key, bytes):
            raise f.error(f"{name}[{i}][0]", "must be bytes")
        out.append((key, f.as_int(slot, f"{name}[{i}][1]")))
    return tuple(out)


@dataclass(frozen=True)
class TierOps(WireMessage):
    """``TIER_OPS`` ``{"drops": [key, ...], "writes": [[key, slot], ...]}``: delete the
    tier files of ``drops``, then stage each write's slot (all layers) to be written to
    the tier as ``key`` in the background. Answered with :class:`TierDone` once staged:
    ``done`` the writes staged, ``failed`` those refused (the staging memory is full)."""

    KIND = Kind.TIER_OPS
    drops: tuple[bytes, ...] = ()
    writes: tuple[tuple[bytes, int], ...] = ()

    def body(self) -> dict:
        return {"drops": list(self.drops), "writes": [[k, s] for k, s in self.writes]}

    @classmethod
    def from_wire(cls, f: Fields) -> TierOps:
        f.tensors(0)
        return cls(_keys(f, "drops"), _items(f, "writes"))


@dataclass(frozen=True)
class TierRead(WireMessage):
    """``TIER_READ`` ``{"items": [[key, slot], ...]}``: read each key's tier file into
    its slot (all layers), its digest checked first (a promotion). Answered with
    :class:`TierDone` once every slot is written: ``failed`` the keys whose file is
    missing, corrupt or of another size (their slots are left as they were)."""

    KIND = Kind.TIER_READ
    items: tuple[tuple[bytes, int], ...] = ()

    def body(self) -> dict:
        return {"items": [[k, s] for k, s in self.items]}

    @classmethod
    def from_wire(cls, f: Fields) -> TierRead:
        f.tensors(0)
        return cls(_items(f, "items"))


@dataclass(frozen=True)
class TierDone(WireMessage):
    """``TIER_DONE`` ``{"done": [key, ...], "failed": [key, ...]}``: the answer to
    :class:`TierOps` and :class:`TierRead`."""

    KIND = Kind.TIER_DONE
    done: tuple[bytes, ...] = ()
    failed: tuple[bytes, ...] = ()

    def body(self) -> dict:
        return {"done": list(self.done), "failed": list(self.failed)}

    @classmethod
    def from_wire(cls, f: Fields) -> TierDone:
        f.tensors(0)
        return cls(_keys(f, "done"), _keys(f, "failed"))
