"""Transfer messages: a compute engine's client or the driver and a transfer engine
(2x), and transfer engine to transfer engine (5x).

A sub-batch's transfer plan is registered once per iteration
(:class:`RegisterTransferPlan`); per layer (or per run of layers) the client sends
:class:`Put` (ids only: the new K/V rows are in the shared ``kv`` buffer). The home
transfer engine writes its own rows into its slab and sends each peer its rows
(:class:`PeerPut`); it answers :class:`PutDone` once every store is done. A plan's page
copies (a page hit's shared pages into the request's own tail, on one instance) are done
with its puts, layer by layer, by the transfer engine of that instance. Replication
and migration copy one whole segment, a contiguous slab block
(:class:`CopySegment` -> :class:`PeerSegment` -> :class:`CopyDone`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenlake.core.plans import TransferPlan
from tokenlake.dataplane.messages.base import Fields, WireMessage
from tokenlake.dataplane.wire import Kind


@dataclass(frozen=True)
class PutTarget:
    """Rows ``[start, stop)`` of a sub-batch's new K/V go to ``slot`` of ``instance``'s
    slab from token position ``offset`` on. Wire form ``[instance, slot, offset, start,
    stop]``."""

    instance: int
    slot: int
    offset: int
    start: int
    stop: int

    def to_wire(self) -> list:
        return [self.instance, self.slot, self.offset, self.start, self.stop]

    @classmethod
    def from_wire(cls, f: Fields, raw: Any, path: str) -> PutTarget:
        return cls(*(f.as_int(v, f"{path}[{i}]") for i, v in enumerate(f.as_list(raw, path, 5))))


@dataclass(frozen=True)
class SlotWrite:
    """``rows`` token rows written into ``slot`` from token position ``offset`` on (one
    item of a :class:`PeerPut`). Wire form ``[slot, offset, rows]``."""

    slot: int
    offset: int
    rows: int

    def to_wire(self) -> list:
        return [self.slot, self.offset, self.rows]

    @classmethod
    def from_wire(cls, f: Fields, raw: Any, path: str) -> SlotWrite:
        return cls(*(f.as_int(v, f"{path}[{i}]") for i, v in enumerate(f.as_list(raw, path, 3))))


@dataclass(frozen=True)
class SlotCopy:
    """Copy the first ``tokens`` tokens of slot ``src`` on ``src_instance`` into slot
    ``dst`` on ``dst_instance`` (a page hit's shared pages). Wire form ``[src_instance,
    src, dst_instance, dst, tokens]``."""

    src_instance: int
    src: int
    dst_instance: int
    dst: int
    tokens: int

    def to_wire(self) -> list:
        return [self.src_instance, self.src, self.dst_instance, self.dst, self.tokens]

    @classmethod
    def from_wire(cls, f: Fields, raw: Any, path: str) -> SlotCopy:
        return cls(*(f.as_int(v, f"{path}[{i}]") for i, v in enumerate(f.as_list(raw, path, 5))))


@dataclass(frozen=True)
class RegisterTransferPlan(WireMessage):
    """``REGISTER_TRANSFER_PLAN`` ``{"plan": int, "rows": int, "puts": [[instance, slot,
    offset, start, stop], ...], "copies": [[src_instance, src, dst_instance, dst, tokens],
    ...] (optional, default none), "grant": bin (optional)}``: a client registers a
    sub-batch's transfer plan with its home transfer engine; ``grant`` is the control
    server's grant of it to a client session (:mod:`tokenlake.dataplane.grants`).
    Answered with ``PLAN_ACK``."""

    KIND = Kind.REGISTER_TRANSFER_PLAN
    plan: int
    rows: int
    puts: tuple[PutTarget, ...]
    copies: tuple[SlotCopy, ...] = ()
    grant: bytes = b""

    @classmethod
    def from_plan(cls, plan_id: int, plan: TransferPlan, grant: bytes = b"") -> RegisterTransferPlan:
        puts = tuple(PutTarget(p.instance, p.slot, p.offset, p.start, p.stop) for p in plan.puts)
        copies = tuple(SlotCopy(c.src_instance, c.src_slot, c.dst_instance, c.dst_slot, c.tokens)
                       for c in plan.copies)
        return cls(plan_id, plan.num_rows, puts, copies, grant)

    def body(self) -> dict:
        body = {"plan": self.plan, "rows": self.rows, "puts": [p.to_wire() for p in self.puts]}
        if self.copies:
            body["copies"] = [c.to_wire() for c in self.copies]
        if self.grant:
            body["grant"] = self.grant
        return body

    @classmethod
    def from_wire(cls, f: Fields) -> RegisterTransferPlan:
        f.tensors(0)
        puts = tuple(PutTarget.from_wire(f, raw, f"puts[{i}]") for i, raw in enumerate(f.list("puts")))
        copies = tuple(SlotCopy.from_wire(f, raw, f"copies[{i}]")
                       for i, raw in enumerate(f.list("copies", default=[])))
        return cls(f.int("plan"), f.int("rows"), puts, copies, f.bin("grant", default=b""))


@dataclass(frozen=True)
class Put(WireMessage):
    """``PUT`` ``{"plan": int, "layer": int, "layers": int (optional, default 1)}``:
    store layers ``[layer, layer + layers)`` of the plan's rows of the shared ``kv``
    buffer where the plan says (decode sends one put for all layers). Answered with
    :class:`PutDone` once every store is done."""

    KIND = Kind.PUT
    plan: int
    layer: int
    layers: int = 1

    def body(self) -> dict:
        body = {"plan": self.plan, "layer": self.layer}
        if self.layers != 1:
            body["layers"] = self.layers
        return body

    @classmethod
    def from_wire(cls, f: Fields) -> Put:
        f.tensors(0)
        return cls(f.int("plan"), f.int("layer"), f.int("layers", default=1))


@dataclass(frozen=True)
class PutDone(WireMessage):
    """``PUT_DONE`` ``{"layer": int}``: the put starting at ``layer`` is stored (the
    answer to :class:`Put` and :class:`PeerPut`)."""

    KIND = Kind.PUT_DONE
    layer: int

    def body(self) -> dict:
        return {"layer": self.layer}

    @classmethod
    def from_wire(cls, f: Fields) -> PutDone:
        f.tensors(0)
        return cls(f.int("layer"))


@dataclass(frozen=True, eq=False)  # tensors: equal only to itself
class PeerPut(WireMessage):
    """``PEER_PUT`` ``{"layer": int, "layers": int, "items": [[slot, offset, rows],
    ...], "copies": [slot copy, ...] (optional)}`` + one ``kv`` tensor per layer and
    item, layer-major (``[rows, 2, kv_heads, head_dim]`` in the slab's dtype): a home
    transfer engine's rows for a peer's slab, and the page copies whose source is the
    peer, done in those layers (the peer sends rows for another instance on). Answered
    with :class:`PutDone` once all of it is stored."""

    KIND = Kind.PEER_PUT
    layer: int
    layers: int
    items: tuple[SlotWrite, ...]
    kv: tuple[torch.Tensor, ...]
    copies: tuple[SlotCopy, ...] = ()

    def body(self) -> dict:
        body = {"layer": self.layer, "layers": self.layers, "items": [it.to_wire() for it in self.items]}
        if self.copies:
            body["copies"] = [c.to_wire() for c in self.copies]
        return body

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.kv

    @classmethod
    def from_wire(cls, f: Fields) -> PeerPut:
        layers = f.int("layers")
        items = tuple(SlotWrite.from_wire(f, raw, f"items[{i}]") for i, raw in enumerate(f.list("items")))
        kv = f.tensors(len(items) * max(layers, 0), f"{len(items)} items x {layers} layers")
        copies = tuple(SlotCopy.from_wire(f, raw, f"copies[{i}]")
                       for i, raw in enumerate(f.list("copies", default=[])))
        return cls(f.int("layer"), layers, items, kv, copies)


@dataclass(frozen=True)
class CopySegment(WireMessage):
    """``COPY_SEGMENT`` ``{"slot": int, "target": int, "target_slot": int}``: the driver
    has the source transfer engine copy its ``slot`` (all layers) into ``target_slot`` of
    instance ``target`` (replication, migration). Answered with :class:`CopyDone`."""

    KIND = Kind.COPY_SEGMENT
    slot: int
    target: int
    target_slot: int

    def body(self) -> dict:
        return {"slot": self.slot, "target": self.target, "target_slot": self.target_slot}

    @classmethod
    def from_wire(cls, f: Fields) -> CopySegment:
        f.tensors(0)
        return cls(f.int("slot"), f.int("target"), f.int("target_slot"))


@dataclass(frozen=True)
class CopyDone(WireMessage):
    """``COPY_DONE`` ``{"slot": int}``: the segment is in the target's ``slot`` (the
    answer to :class:`CopySegment` and :class:`PeerSegment`)."""

    KIND = Kind.COPY_DONE
    slot: int

    def body(self) -> dict:
        return {"slot": self.slot}

    @classmethod
    def from_wire(cls, f: Fields) -> CopyDone:
        f.tensors(0)
        return cls(f.int("slot"))


@dataclass(frozen=True)
class ReadSegment(WireMessage):
    """``READ_SEGMENT`` ``{"layer": int, "slots": [int, ...], "grant": bin (optional)}``:
    read one layer of the named slots (what the vLLM connector's load mode copies, and the
    imperative "fetch the prefix KV" path a benchmark compares against); a client
    session names exactly the slots a lease of it granted on this instance, with that
    grant (:mod:`tokenlake.dataplane.grants`). Answered with :class:`SegmentData`."""

    KIND = Kind.READ_SEGMENT
    layer: int
    slots: tuple[int, ...]
    grant: bytes = b""

    def body(self) -> dict:
        body = {"layer": self.layer, "slots": list(self.slots)}
        if self.grant:
            body["grant"] = self.grant
        return body

    @classmethod
    def from_wire(cls, f: Fields) -> ReadSegment:
        f.tensors(0)
        return cls(f.int("layer"), f.as_ints(f.get("slots"), "slots"), f.bin("grant", default=b""))


@dataclass(frozen=True, eq=False)  # tensors: equal only to itself
class SegmentData(WireMessage):
    """``SEGMENT_DATA`` ``{"layer": int, "slots": [int, ...]}`` + one tensor per slot,
    ``[2, kv_heads, C, head_dim]`` in the slab's dtype: the answer to
    :class:`ReadSegment`."""

    KIND = Kind.SEGMENT_DATA
    layer: int
    slots: tuple[int, ...]
    blocks: tuple[torch.Tensor, ...]

    def body(self) -> dict:
        return {"layer": self.layer, "slots": list(self.slots)}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.blocks

    @classmethod
    def from_wire(cls, f: Fields) -> SegmentData:
        slots = f.as_ints(f.get("slots"), "slots")
        return cls(f.int("layer"), slots, f.tensors(len(slots), "one per slot"))


@dataclass(frozen=True, eq=False)  # tensors: equal only to itself
class PeerSegment(WireMessage):
    """``PEER_SEGMENT`` ``{"slot": int}`` + ``data``: a whole segment, ``[layers, 2,
    kv_heads, C, head_dim]`` in the slab's dtype (one contiguous slab block), for the
    receiving transfer engine's ``slot``. Answered with :class:`CopyDone`."""

    KIND = Kind.PEER_SEGMENT
    slot: int
    data: torch.Tensor

    def body(self) -> dict:
        return {"slot": self.slot}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.data,)

    @classmethod
    def from_wire(cls, f: Fields) -> PeerSegment:
        (data,) = f.tensors(1, "data")
        return cls(f.int("slot"), data)
