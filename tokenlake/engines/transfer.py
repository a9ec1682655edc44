"""The transfer engine of one instance (paper §3.3, docs/design.md §4).

It maps its instance's slab and the compute engine's ``kv`` buffer from shared memory
and executes:

* ``PUT`` of one layer (or a run of ``layers`` consecutive layers: decode coalesces its
  tiny puts into one message per iteration) of a registered transfer plan
  (``REGISTER_TRANSFER_PLAN``): rows stored on this instance are written straight from
  ``kv`` into the slab; rows stored elsewhere go to the peer transfer engines
  (``PEER_PUT``: one message per peer, one frame per layer and put item), and the
  compute engine is answered (``PUT_DONE``) when every store of those layers is done;
  the plan's page copies (a page hit's shared pages into the request's own tail) are
  done in the same layers by the transfer engine holding the source slot, which sends
  the rows on (``PEER_PUT``) when the tail is on another instance;
* ``COPY_SEGMENT``: one whole segment (all layers: one contiguous block of the slab)
  to a peer (``PEER_SEGMENT``), for replication or migration; into a co-located peer's
  slab (``EngineSpec.shared_slabs``) it is one copy, without a message;
* ``READ_SEGMENT``: one layer of some slots, returned as frames (``SEGMENT_DATA``);
* from peers: ``PEER_PUT`` and ``PEER_SEGMENT`` written into the local slab;
* with a tier (``EngineSpec.tier_bytes``; on disk with ``tier_path``, else in host
  memory): ``TIER_OPS`` (drop copies, copy slots to write through) and ``TIER_READ``
  (copies read back into slots), both from the owner (:mod:`tokenlake.engines.tier_store`).

A transfer plan belongs to the session that registered it
(:class:`~tokenlake.engines.loop.Caller`): its rows come from that session's ``kv``
buffer, and only that session can put through it or release it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tokenlake.core.errors import NotAuthorized, PlanError
from tokenlake.dataplane import grants
from tokenlake.dataplane.messages import (
    CopyDone,
    CopySegment,
    PeerPut,
    PeerSegment,
    PlanAck,
    Put,
    PutDone,
    PutTarget,
    ReadSegment,
    RegisterTransferPlan,
    ReleasePlan,
    SegmentData,
    SlotCopy,
    SlotWrite,
    TierList,
    TierOps,
    TierRead,
    WireMessage,
)
from tokenlake.dataplane.tensor_frames import WireError
from tokenlake.dataplane.wire import error_message
from tokenlake.engines.bells import Answer
from tokenlake.engines.loop import Caller, EngineLoop, EngineSpec, Pending, run_engine
from tokenlake.engines.tier_serving import TierServing

log = logging.getLogger(__name__)

#: Transfer plans one session may have registered at once (the oldest is dropped: a
#: client releases each plan when it registers the next).
MAX_SESSION_PLANS = 64


@dataclass(frozen=True)
class TransferPlanState:
    """A registered transfer plan: its rows, the puts into this slab, the puts per peer,
    its page copies here and per peer, and the session's ``kv`` buffer it reads."""

    rows: int
    local: tuple[PutTarget, ...]
    remote: dict[int, tuple[PutTarget, ...]]
    copies: tuple[SlotCopy, ...]
    remote_copies: dict[int, tuple[SlotCopy, ...]]
    kv: torch.Tensor
    grant: int = -1  # the grant it was registered under (-1: the owner's, which need none)
    expiry: float = float("inf")  # wall-clock seconds after which it may not put (its grant's)


class TransferEngine(TierServing, EngineLoop):
    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        bufs = self.map_buffers()
        self.slab = bufs["slab"]  # [slots, layers, 2, kv_heads, C, head_dim]
        self.num_slots, self.num_layers, _, self.kv_heads, self.C, self.head_dim = self.slab.shape
        self.kv = bufs["kv"]  # [layers, max_rows, 2, kv_heads, head_dim]
        self.shared = self.map_shared_slabs(self.slab)  # co-located peers' slabs: copies go straight in
        self.plans: dict[tuple[bytes, int], TransferPlanState] = {}  # (session, its plan id) -> plan
        self._init_tier()  # tier_serving.py

    def handle(self, identity, msg_id: int, message: WireMessage, caller: Caller) -> None:
        match message:
            case Put():
                self._put(identity, msg_id, message, caller)
            case PeerPut():
                self._peer_put(identity, msg_id, message)
            case RegisterTransferPlan():
                self._register(message, caller)
                self.reply(identity, PlanAck(message.plan).encode(msg_id))
            case ReleasePlan():
                self.plans.pop((caller.require_session(), message.plan), None)
                self.reply(identity, PlanAck(message.plan).encode(msg_id))
            case CopySegment():
                self._copy(identity, msg_id, message)
            case ReadSegment():
                self.check_grant(caller, grants.READ, message.grant,
                                 lambda: {"slots": list(message.slots)})
                self._read(identity, msg_id, message)
            case PeerSegment():
                self._store_segment(message)
                self.reply(identity, CopyDone(message.slot).encode(msg_id))
            case TierOps() | TierRead() | TierList():
                self.tier_request(identity, msg_id, message)
            case _:
                raise WireError(f"transfer engine cannot handle {message.KIND.name}")

    # ----------------------------------------------------------- validation
    def _check_put(self, slot: int, offset: int, n: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise PlanError(f"slot {slot} outside [0, {self.num_slots})")
        if n <= 0 or offset < 0 or offset + n > self.C:
            raise PlanError(f"{n} tokens at offset {offset} do not fit a {self.C}-token segment")

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise PlanError(f"layer {layer} outside [0, {self.num_layers})")
        return layer

    def _check_layers(self, first: int, n: int) -> range:
        """The layers ``[first, first + n)`` of a put, checked against the slab."""
        if n < 1 or not 0 <= first <= first + n <= self.num_layers:
            raise PlanError(f"layers [{first}, {first + n}) outside [0, {self.num_layers})")
        return range(first, first + n)

    def drop_session(self, token: bytes) -> None:
        for key in [k for k in self.plans if k[0] == token]:
            del self.plans[key]

    def drop_grants(self, token: bytes, grant_ids: frozenset[int]) -> None:
        for key in [k for k, p in self.plans.items() if k[0] == token and p.grant in grant_ids]:
            del self.plans[key]

    def _register(self, message: RegisterTransferPlan, caller: Caller) -> None:
        session, bufs = self.session_buffers(caller)
        grant, expiry = self.check_grant(caller, grants.TRANSFER_PLAN, message.grant, message.body)
        rows = message.rows
        if not 0 < rows <= self.kv.shape[1]:
            raise PlanError(f"plan has {rows} rows; kv_buf holds at most {self.kv.shape[1]}")
        local: list[PutTarget] = []
        remote: dict[int, list[PutTarget]] = {}
        for put in message.puts:
            if not 0 <= put.start < put.stop <= rows:
                raise PlanError(f"rows [{put.start}, {put.stop}) outside [0, {rows})")
            self._check_put(put.slot, put.offset, put.stop - put.start)
            if put.instance == self.spec.instance:
                local.append(put)
            elif put.instance in self.peers:
                remote.setdefault(put.instance, []).append(put)
            else:
                raise PlanError(f"instance {put.instance} is not in this cluster")
        copies: list[SlotCopy] = []
        remote_copies: dict[int, list[SlotCopy]] = {}
        for cp in message.copies:
            for inst in (cp.src_instance, cp.dst_instance):
                if inst != self.spec.instance and inst not in self.peers:
                    raise PlanError(f"instance {inst} is not in this cluster")
            if cp.src_instance == self.spec.instance:
                self._check_copy(cp)
                copies.append(cp)
            else:
                remote_copies.setdefault(cp.src_instance, []).append(cp)
        self.plans.pop((session, message.plan), None)  # an id registered again replaces its plan
        self.plans[(session, message.plan)] = TransferPlanState(
            rows, tuple(local), {i: tuple(p) for i, p in remote.items()}, tuple(copies),
            {i: tuple(c) for i, c in remote_copies.items()}, bufs["kv"], grant, expiry)
        mine = [k for k in self.plans if k[0] == session]
        for old in mine[: max(0, len(mine) - MAX_SESSION_PLANS)]:  # the oldest first
            del self.plans[old]

    def _check_copy(self, cp: SlotCopy) -> None:
        """A copy whose source is this instance (slots of the destination are checked
        there, as a put)."""
        if cp.src_instance != self.spec.instance:
            raise PlanError(f"a page copy from instance {cp.src_instance} sent to {self.spec.instance}")
        here = cp.dst_instance == self.spec.instance
        for slot in (cp.src, cp.dst) if here else (cp.src,):
            if not 0 <= slot < self.num_slots:
                raise PlanError(f"slot {slot} outside [0, {self.num_slots})")
        if (here and cp.src == cp.dst) or not 0 < cp.tokens < self.C:
            raise PlanError(f"a page copy of {cp.tokens} tokens from slot {cp.src} to {cp.dst} "
                            f"does not fit a {self.C}-token segment")

    def _copy_pages(self, copies: tuple[SlotCopy, ...], layers: range, pending) -> None:
        """The copies whose source is this slab, for ``layers``: into this slab directly,
        to another instance as a ``PEER_PUT`` of the rows (answered into ``pending``)."""
        lo, hi = layers.start, layers.stop
        out: dict[int, list[SlotCopy]] = {}
        for cp in copies:
            if cp.dst_instance == self.spec.instance:
                n = cp.tokens
                self.slab[cp.dst, lo:hi, :, :, :n].copy_(self.slab[cp.src, lo:hi, :, :, :n])
            else:
                out.setdefault(cp.dst_instance, []).append(cp)
        for inst, cps in out.items():
            items = tuple(SlotWrite(cp.dst, 0, cp.tokens) for cp in cps)
            rows = tuple(self.slab[cp.src, layer, :, :, : cp.tokens].permute(2, 0, 1, 3).contiguous()
                         for layer in layers for cp in cps)
            self.ask(inst, PeerPut(lo, hi - lo, items, rows), pending)

    # ----------------------------------------------------------------- puts
    def _write(self, slot: int, layer: int, offset: int, rows: torch.Tensor) -> None:
        """rows: [n, 2, kv_heads, head_dim] -> slab[slot, layer, :, :, offset:offset+n, :]."""
        n = rows.shape[0]
        self.slab[slot, layer, :, :, offset : offset + n, :].copy_(rows.permute(1, 2, 0, 3))

    def _put(self, identity, msg_id: int, message: Put, caller: Caller) -> None:
        def answer(exc: BaseException | None) -> None:
            self.reply(identity, PutDone(message.layer).encode(msg_id) if exc is None
                       else error_message(msg_id, exc))
        self._put_layers(caller, message.plan, message.layer, message.layers, answer)

    def handle_bell(self, caller: Caller, plan: int, layer: int, layers: int, answer: Answer) -> None:
        """A ``PUT`` posted on the session's bell."""
        self._put_layers(caller, plan, layer, layers, answer)

    def _put_layers(self, caller: Caller, pid: int, layer: int, n: int, answer: Answer) -> None:
        """Stores layers ``[layer, layer + n)`` of plan ``pid``: this slab's rows written,
        peers' sent; ``answer`` once every store is done (a failed check raises instead)."""
        session, _ = self.session_buffers(caller)
        plan = self.plans.get((session, pid))
        if plan is None:
            raise PlanError(f"unknown transfer plan {pid} on instance {self.spec.instance}")
        if plan.expiry < time.time():
            raise NotAuthorized(f"transfer plan {pid}'s grant expired")
        layers = self._check_layers(layer, n)
        kv = plan.kv
        pending = self.new_pending(PutDone, session)
        pending.on_done = lambda p: answer(None)
        pending.on_fail = lambda p, exc: answer(exc)
        remote_copies = plan.remote_copies
        for inst in plan.remote.keys() | remote_copies.keys():  # remote first: they store while we do
            puts = plan.remote.get(inst, ())
            items = tuple(SlotWrite(p.slot, p.offset, p.stop - p.start) for p in puts)
            tensors = tuple(kv[layer, p.start : p.stop] for layer in layers for p in puts)
            peer_put = PeerPut(layers.start, len(layers), items, tensors, remote_copies.get(inst, ()))
            self.ask(inst, peer_put, pending)
        for layer in layers:
            for p in plan.local:
                self._write(p.slot, layer, p.offset, kv[layer, p.start : p.stop])
        self._copy_pages(plan.copies, layers, pending)
        if not pending.waiting:
            pending.on_done(pending)

    def _peer_put(self, identity, msg_id: int, message: PeerPut) -> None:
        """Stores a peer's rows and does the page copies whose source is here, answering
        once the rows sent on (copies to a third instance) are stored too."""
        self._store_peer_put(message)
        pending = self._answer(identity, msg_id, PutDone(message.layer))
        self._copy_pages(message.copies, self._check_layers(message.layer, message.layers), pending)
        if not pending.waiting:
            pending.on_done(pending)

    def _answer(self, identity, msg_id: int, answer: WireMessage, session: bytes = b"") -> Pending:
        """A :class:`Pending` for the peers asked on behalf of request ``msg_id`` (of
        ``session``): its ``on_done`` replies ``answer``, a failure replies the error."""
        pending = self.new_pending(type(answer), session)
        pending.on_done = lambda p: self.reply(identity, answer.encode(msg_id))
        pending.on_fail = lambda p, exc: self.reply(identity, error_message(msg_id, exc))
        return pending

    def _store_peer_put(self, message: PeerPut) -> None:
        layers = self._check_layers(message.layer, message.layers)
        want = (2, self.kv_heads, self.head_dim)
        items = message.items * len(layers)  # layer-major, as the tensors
        for it, rows in zip(items, message.kv):  # validate all, then write
            self._check_put(it.slot, it.offset, it.rows)
            if rows.dtype != self.slab.dtype or tuple(rows.shape) != (it.rows, *want):
                raise PlanError(f"put rows must be {self.slab.dtype} [{it.rows}, {', '.join(map(str, want))}]")
        for cp in message.copies:
            self._check_copy(cp)
        writes = ((layer, it) for layer in layers for it in message.items)
        for (layer, it), rows in zip(writes, message.kv):
            self._write(it.slot, layer, it.offset, rows)

    # ------------------------------------------------------------- segments
    def _copy(self, identity, msg_id: int, message: CopySegment) -> None:
        src, dst_inst, dst = message.slot, message.target, message.target_slot
        if not 0 <= src < self.num_slots:
            raise PlanError(f"slot {src} outside [0, {self.num_slots})")
        if dst_inst == self.spec.instance:
            raise PlanError("a segment copy needs another instance as target")
        target = self.shared.get(dst_inst)
        if target is not None and dst_inst in self.peers:  # co-located: one memcpy, no message
            if not 0 <= dst < self.num_slots:
                raise PlanError(f"slot {dst} outside [0, {self.num_slots})")
            target[dst].copy_(self.slab[src])
            self.reply(identity, CopyDone(dst).encode(msg_id))
            return
        pending = self._answer(identity, msg_id, CopyDone(dst))
        self.ask(dst_inst, PeerSegment(dst, self.slab[src]), pending)

    def _read(self, identity, msg_id: int, message: ReadSegment) -> None:
        """Returns one layer of the named slots (the imperative "fetch the prefix KV"
        path the benchmark compares against): one zero-copy frame per slot."""
        layer = self._check_layer(message.layer)
        if any(not 0 <= s < self.num_slots for s in message.slots):
            raise PlanError(f"slot out of range [0, {self.num_slots})")
        if len(set(message.slots)) != len(message.slots):  # bounds the reply: each slot once
            raise PlanError(f"READ_SEGMENT names a slot twice ({len(message.slots)} slots)")
        blocks = tuple(self.slab[s, layer] for s in message.slots)
        self.reply(identity, SegmentData(layer, message.slots, blocks).encode(msg_id))

    def close(self) -> None:
        self.close_tier()
        super().close()

    def _store_segment(self, message: PeerSegment) -> None:
        slot, data = message.slot, message.data
        if not 0 <= slot < self.num_slots:
            raise PlanError(f"slot {slot} outside [0, {self.num_slots})")
        if data.dtype != self.slab.dtype or data.shape != self.slab.shape[1:]:
            raise PlanError(f"segment data must be {self.slab.dtype} {tuple(self.slab.shape[1:])}")
        self.slab[slot].copy_(data)


def main(spec_bytes: bytes, conn) -> None:
    """Runs one transfer engine process (a ``multiprocessing`` target; see
    :func:`tokenlake.engines.loop.run_engine` for the handshake over ``conn``)."""
    run_engine(TransferEngine, spec_bytes, conn)
