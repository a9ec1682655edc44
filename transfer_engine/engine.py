"""The transfer engine of one instance (paper §3.3, DESIGN §4).

It maps its instance's slab and the compute engine's ``kv`` buffer from shared memory
and executes:

* ``PUT`` of one layer (or a run of ``layers`` consecutive layers: decode coalesces its
  tiny puts into one message per iteration) of a registered transfer plan: rows stored
  on this instance are written straight from ``kv`` into the slab; rows stored elsewhere
  go to the peer transfer engines (one message per peer, one frame per layer and put
  item), and the compute engine is answered when every store of those layers is done;
* ``COPY_SEGMENT``: one whole segment (all layers: one contiguous block of the slab)
  to a peer, for replication or migration;
* from peers: ``PUT`` items and ``SEGMENT_DATA`` written into the local slab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenlake.core.errors import PlanError
from tokenlake.dataplane import wire
from tokenlake.dataplane.engine import EngineLoop, EngineSpec

Put = tuple[int, int, int, int]  # (slot, offset, start, stop)


@dataclass(frozen=True)
class TransferPlanState:
    rows: int
    local: tuple[Put, ...]
    remote: dict[int, tuple[Put, ...]]


class TransferEngine(EngineLoop):
    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        bufs = self.map_buffers()
        self.slab = bufs["slab"]  # [slots, layers, 2, kv_heads, C, head_dim]
        self.num_slots, self.num_layers, _, self.kv_heads, self.C, self.head_dim = self.slab.shape
        self.kv = bufs["kv"]  # [layers, max_rows, 2, kv_heads, head_dim]
        self.plans: dict[int, TransferPlanState] = {}

    def handle(self, identity, msg: wire.Message) -> None:
        kind, body = msg.kind, msg.body
        if kind == wire.Kind.REGISTER_PLAN:
            self._register(body)
            self.reply(identity, wire.encode(kind, msg.msg_id, {"plan": body["plan"]}))
        elif kind == wire.Kind.RELEASE_PLAN:
            self.plans.pop(int(body["plan"]), None)
            self.reply(identity, wire.encode(kind, msg.msg_id, {"plan": body["plan"]}))
        elif kind == wire.Kind.PUT and "items" in body:
            self._store_peer_put(body, msg.tensors)
            self.reply(identity, wire.encode(wire.Kind.PUT_DONE, msg.msg_id, {"layer": int(body["layer"])}))
        elif kind == wire.Kind.PUT:
            self._put(identity, msg)
        elif kind == wire.Kind.COPY_SEGMENT:
            self._copy(identity, msg)
        elif kind == wire.Kind.READ_SEGMENT:
            self._read(identity, msg)
        elif kind == wire.Kind.SEGMENT_DATA:
            self._store_segment(body, msg.tensors)
            self.reply(identity, wire.encode(wire.Kind.COPY_DONE, msg.msg_id, {"slot": body["slot"]}))
        else:
            raise wire.WireError(f"transfer engine cannot handle {kind.name}")

    # ----------------------------------------------------------- validation
    def _check_put(self, slot: int, offset: int, n: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise PlanError(f"slot {slot} outside [0, {self.num_slots})")
        if n <= 0 or offset < 0 or offset + n > self.C:
            raise PlanError(f"{n} tokens at offset {offset} do not fit a {self.C}-token segment")

    def _check_layer(self, body: dict) -> int:
        layer = int(body["layer"])
        if not 0 <= layer < self.num_layers:
            raise PlanError(f"layer {layer} outside [0, {self.num_layers})")
        return layer

    def _check_layers(self, body: dict) -> range:
        """The layers ``[layer, layer + layers)`` of a ``PUT`` (``layers`` defaults to 1)."""
        first, n = int(body["layer"]), int(body.get("layers", 1))
        if n < 1 or not 0 <= first <= first + n <= self.num_layers:
            raise PlanError(f"layers [{first}, {first + n}) outside [0, {self.num_layers})")
        return range(first, first + n)

    def _register(self, body: dict) -> None:
        pid, rows = int(body["plan"]), int(body["rows"])
        if not 0 < rows <= self.kv.shape[1]:
            raise PlanError(f"plan has {rows} rows; kv_buf holds at most {self.kv.shape[1]}")
        local: list[Put] = []
        remote: dict[int, list[Put]] = {}
        for inst, slot, offset, start, stop in body["puts"]:
            inst, put = int(inst), (int(slot), int(offset), int(start), int(stop))
            if not 0 <= put[2] < put[3] <= rows:
                raise PlanError(f"rows [{put[2]}, {put[3]}) outside [0, {rows})")
            self._check_put(put[0], put[1], put[3] - put[2])
            if inst == self.spec.instance:
                local.append(put)
            elif inst in self.peers:
                remote.setdefault(inst, []).append(put)
            else:
                raise PlanError(f"instance {inst} is not in this cluster")
        self.plans[pid] = TransferPlanState(rows, tuple(local), {i: tuple(p) for i, p in remote.items()})

    # ----------------------------------------------------------------- puts
    def _write(self, slot: int, layer: int, offset: int, rows: torch.Tensor) -> None:
        """rows: [n, 2, kv_heads, head_dim] -> slab[slot, layer, :, :, offset:offset+n, :]."""
        n = rows.shape[0]
        self.slab[slot, layer, :, :, offset : offset + n, :].copy_(rows.permute(1, 2, 0, 3))

    def _put(self, identity, msg: wire.Message) -> None:
        plan = self.plans.get(int(msg.body["plan"]))
        if plan is None:
            raise PlanError(f"unknown transfer plan {msg.body['plan']} on instance {self.spec.instance}")
        layers = self._check_layers(msg.body)
        kv = self.kv
        pending = self.new_pending(None, None)
        done = lambda p: self.reply(identity, wire.encode(wire.Kind.PUT_DONE, msg.msg_id, {"layer": layers.start}))  # noqa: E731
        pending.on_done = done
        pending.on_fail = lambda p, exc: self.reply(identity, wire.error_message(msg.msg_id, exc))
        for inst, puts in plan.remote.items():  # remote first: they store while we do
            items = [[slot, offset, stop - start] for slot, offset, start, stop in puts]
            tensors = tuple(kv[layer, start:stop] for layer in layers for _, _, start, stop in puts)
            body = {"layer": layers.start, "layers": len(layers), "items": items}
            self.ask(inst, wire.Kind.PUT, body, tensors, pending)
        for layer in layers:
            for slot, offset, start, stop in plan.local:
                self._write(slot, layer, offset, kv[layer, start:stop])
        if not pending.waiting:
            done(pending)

    def _store_peer_put(self, body: dict, tensors) -> None:
        layers = self._check_layers(body)
        items = body["items"]
        if len(items) * len(layers) != len(tensors):
            raise PlanError(f"{len(items)} put items x {len(layers)} layers but {len(tensors)} tensors")
        want = (2, self.kv_heads, self.head_dim)
        for (slot, offset, n), rows in zip(items * len(layers), tensors):  # validate all, then write
            self._check_put(int(slot), int(offset), int(n))
            if rows.dtype != self.slab.dtype or tuple(rows.shape) != (int(n), *want):
                raise PlanError(f"put rows must be {self.slab.dtype} [{n}, {', '.join(map(str, want))}]")
        writes = ((layer, slot, offset) for layer in layers for slot, offset, _ in items)
        for (layer, slot, offset), rows in zip(writes, tensors):
            self._write(int(slot), layer, int(offset), rows)

    # ------------------------------------------------------------- segments
    def _copy(self, identity, msg: wire.Message) -> None:
        body = msg.body
        src, dst_inst, dst = int(body["slot"]), int(body["target"]), int(body["target_slot"])
        if not 0 <= src < self.num_slots:
            raise PlanError(f"slot {src} outside [0, {self.num_slots})")
        pending = self.new_pending(None, None)
        pending.on_done = lambda p: self.reply(identity, wire.encode(wire.Kind.COPY_DONE, msg.msg_id, {"slot": dst}))
        pending.on_fail = lambda p, exc: self.reply(identity, wire.error_message(msg.msg_id, exc))
        if dst_inst == self.spec.instance:
            raise PlanError("a segment copy needs another instance as target")
        self.ask(dst_inst, wire.Kind.SEGMENT_DATA, {"slot": dst}, (self.slab[src],), pending)

    def _read(self, identity, msg: wire.Message) -> None:
        """Returns one layer of the named slots (the imperative "fetch the prefix KV"
        path the benchmark compares against): one zero-copy frame per slot."""
        layer = self._check_layer(msg.body)
        slots = [int(s) for s in msg.body["slots"]]
        if any(not 0 <= s < self.num_slots for s in slots):
            raise PlanError(f"slot out of range [0, {self.num_slots})")
        tensors = tuple(self.slab[s, layer] for s in slots)
        self.reply(identity, wire.encode(wire.Kind.SEGMENT_DATA, msg.msg_id, {"layer": layer, "slots": slots}, tensors))

    def _store_segment(self, body: dict, tensors) -> None:
        slot = int(body["slot"])
        if not 0 <= slot < self.num_slots:
            raise PlanError(f"slot {slot} outside [0, {self.num_slots})")
        (data,) = tensors
        if data.dtype != self.slab.dtype or data.shape != self.slab.shape[1:]:
            raise PlanError(f"segment data must be {self.slab.dtype} {tuple(self.slab.shape[1:])}")
        self.slab[slot].copy_(data)


