"""The query engine of one instance (paper §3.3, DESIGN §4).

It maps its instance's slab and the compute engine's ``q``/``out`` buffers from shared
memory and answers two kinds of work:

* as **home** of a sub-batch (from its compute engine): on ``QUERY`` it sends the q rows
  each remote instance needs to that instance's query engine, computes its own share
  over local slots meanwhile, merges every partial ``(o, lse)`` exactly, writes the
  result into ``out`` and answers the compute engine;
* as **remote** (from a peer query engine): partial attention of the received q rows
  over the slots the plan names, returned as ``(o, lse)``.

Plans are registered once (``REGISTER_PLAN``) and reused for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenlake.core.errors import PlanError
from tokenlake.dataplane import wire
from tokenlake.dataplane.attention import empty_partial, merge, merge_many, slab_partial_attention
from tokenlake.dataplane.engine import EngineLoop, EngineSpec, Pending

Item = tuple[int, int, tuple[int, ...], tuple[int, ...]]  # (start, stop, slots, tokens)


@dataclass(frozen=True)
class HomePlan:
    """A sub-batch plan registered by this instance's compute engine."""

    rows: int
    local: tuple[Item, ...]
    remote: dict[int, tuple[int, int]]  # instance -> (lo, hi) rows it needs


class QueryEngine(EngineLoop):
    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        bufs = self.map_buffers()
        self.slab = bufs["slab"]  # [slots, layers, 2, kv_heads, C, head_dim]
        self.num_slots, self.num_layers, _, self.kv_heads, self.C, self.head_dim = self.slab.shape
        self.q = bufs["q"]  # [max_rows, q_heads, head_dim]
        self.out_o = bufs["out_o"]
        self.out_lse = bufs["out_lse"]
        self.q_heads = self.q.shape[1]
        self.home_plans: dict[int, HomePlan] = {}
        self.peer_plans: dict[str, tuple[Item, ...]] = {}

    # -------------------------------------------------------------- dispatch
    def handle(self, identity, msg: wire.Message) -> None:
        body, kind = msg.body, msg.kind
        if kind == wire.Kind.REGISTER_PLAN and "tasks" in body:
            self._register_home(body)
            self.reply(identity, wire.encode(wire.Kind.REGISTER_PLAN, msg.msg_id, {"plan": body["plan"]}))
        elif kind == wire.Kind.REGISTER_PLAN:
            self.peer_plans[str(body["plan"])] = self._items(body["items"], self.q.shape[0])
            self.reply(identity, wire.encode(wire.Kind.REGISTER_PLAN, msg.msg_id, {"plan": body["plan"]}))
        elif kind == wire.Kind.RELEASE_PLAN:
            self._release(body)
            self.reply(identity, wire.encode(wire.Kind.RELEASE_PLAN, msg.msg_id, {"plan": body["plan"]}))
        elif kind == wire.Kind.QUERY and "key" in body:
            self._serve_peer(identity, msg)
        elif kind == wire.Kind.QUERY:
            self._serve_home(identity, msg)
        else:
            raise wire.WireError(f"query engine cannot handle {kind.name}")

    # ------------------------------------------------------------- plans
    def _items(self, raw, rows: int) -> tuple[Item, ...]:
        """Validates ``[[start, stop, [slots], [tokens]], ...]`` against the slab."""
        items = []
        for it in raw:
            start, stop, slots, tokens = int(it[0]), int(it[1]), tuple(it[2]), tuple(it[3])
            if not 0 <= start < stop <= rows:
                raise PlanError(f"rows [{start}, {stop}) outside [0, {rows})")
            if len(slots) != len(tokens) or not slots:
                raise PlanError("an item needs as many token counts as slots, and at least one")
            if any(not 0 <= s < self.num_slots for s in slots):
                raise PlanError(f"slot out of range [0, {self.num_slots}) in {list(slots)}")
            if any(not 0 < t <= self.C for t in tokens):
                raise PlanError(f"token counts must be in (0, {self.C}], got {list(tokens)}")
            items.append((start, stop, slots, tokens))
        return tuple(items)

    def _register_home(self, body: dict) -> None:
        pid, rows = int(body["plan"]), int(body["rows"])
        if not 0 < rows <= self.q.shape[0]:
            raise PlanError(f"plan has {rows} rows; q_buf holds at most {self.q.shape[0]}")
        local: tuple[Item, ...] = ()
        remote: dict[int, tuple[int, int]] = {}
        checked = []
        for inst, raw in body["tasks"]:
            inst = int(inst)
            items = self._items(raw, rows)
            if inst == self.spec.instance:
                local += items
            elif inst not in self.peers:
                raise PlanError(f"instance {inst} is not in this cluster")
            else:
                checked.append((inst, items))
        for inst, items in checked:  # all validated: now tell the peers
            lo, hi = min(i[0] for i in items), max(i[1] for i in items)
            shifted = [[s - lo, e - lo, list(sl), list(tk)] for s, e, sl, tk in items]
            key = f"{self.spec.instance}:{pid}"
            wire.send_frames(self.peers[inst], wire.encode(wire.Kind.REGISTER_PLAN, 0, {"plan": key, "items": shifted}))
            remote[inst] = (lo, hi)
        self.home_plans[pid] = HomePlan(rows, local, remote)

    def _release(self, body: dict) -> None:
        plan = body["plan"]
        if isinstance(plan, str):
            self.peer_plans.pop(plan, None)
            return
        home = self.home_plans.pop(int(plan), None)
        if home is not None:
            for inst in home.remote:
                key = f"{self.spec.instance}:{plan}"
                wire.send_frames(self.peers[inst], wire.encode(wire.Kind.RELEASE_PLAN, 0, {"plan": key}))

    # ------------------------------------------------------------- compute
    def _partial(self, q: torch.Tensor, items, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of rows ``q`` over the items' slots (rows relative to ``q``).

        Items over the same rows (a request's sealed segments and its open tail) are
        attended in one call; a single group over all rows is returned as it is.
        """
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for start, stop, slots, tokens in items:
            g = groups.setdefault((start, stop), ([], []))
            g[0].extend(slots)
            g[1].extend(tokens)
        if len(groups) == 1:
            ((start, stop), (slots, tokens)), = groups.items()
            if start == 0 and stop == q.shape[0]:
                return slab_partial_attention(q, self.slab, layer, slots, tokens)
        o, lse = empty_partial(q.shape[0], self.q_heads, self.head_dim)
        for (start, stop), (slots, tokens) in groups.items():
            po, plse = slab_partial_attention(q[start:stop], self.slab, layer, slots, tokens)
            o[start:stop], lse[start:stop] = merge(o[start:stop], lse[start:stop], po, plse)
        return o, lse

    def _check_layer(self, body: dict) -> int:
        layer = int(body["layer"])
        if not 0 <= layer < self.num_layers:
            raise PlanError(f"layer {layer} outside [0, {self.num_layers})")
        return layer

    def _serve_peer(self, identity, msg: wire.Message) -> None:
        items = self.peer_plans.get(str(msg.body["key"]))
        if items is None:
            raise PlanError(f"unknown plan {msg.body['key']!r} on instance {self.spec.instance}")
        layer = self._check_layer(msg.body)
        (q,) = msg.tensors
        if q.dim() != 3 or q.shape[1:] != (self.q_heads, self.head_dim) or q.dtype != torch.float32:
            raise PlanError(f"q must be float32 [rows, {self.q_heads}, {self.head_dim}], got {q.dtype} {tuple(q.shape)}")
        if max(it[1] for it in items) > q.shape[0]:
            raise PlanError("q has fewer rows than the plan's items need")
        o, lse = self._partial(q, items, layer)
        self.reply(identity, wire.encode(wire.Kind.QUERY_RESULT, msg.msg_id, {"layer": layer}, (o, lse)))

    def _serve_home(self, identity, msg: wire.Message) -> None:
        pid = int(msg.body["plan"])
        plan = self.home_plans.get(pid)
        if plan is None:
            raise PlanError(f"unknown plan {pid} on instance {self.spec.instance}")
        layer = self._check_layer(msg.body)
        q = self.q[: plan.rows]
        pending = self.new_pending(None, None)
        pending.on_done = lambda p: self._finish_home(identity, msg.msg_id, plan, layer, p)
        pending.on_fail = lambda p, exc: self.reply(identity, wire.error_message(msg.msg_id, exc))
        for inst, (lo, hi) in plan.remote.items():  # q rows out first: peers work meanwhile
            key = f"{self.spec.instance}:{pid}"
            self.ask(inst, wire.Kind.QUERY, {"key": key, "layer": layer}, (q[lo:hi],), pending)
        pending.results.append((self.spec.instance, self._partial(q, plan.local, layer)))
        if not pending.waiting:
            self._finish_home(identity, msg.msg_id, plan, layer, pending)

    def _finish_home(self, identity, msg_id: int, plan: HomePlan, layer: int, pending: Pending) -> None:
        o, lse = self.out_o[: plan.rows], self.out_lse[: plan.rows]
        parts = []  # (lo, hi, o, lse)
        for inst, result in pending.results:
            if inst == self.spec.instance:
                parts.append((0, plan.rows, *result))
            else:
                parts.append((*plan.remote[inst], *result.tensors))
        if all(lo == 0 and hi == plan.rows for lo, hi, _, _ in parts):  # one vectorised merge
            mo, mlse = merge_many(torch.stack([p[2] for p in parts]), torch.stack([p[3] for p in parts]))
            o.copy_(mo)
            lse.copy_(mlse)
        else:
            o.zero_()
            lse.fill_(float("-inf"))
            for lo, hi, po, plse in parts:
                o[lo:hi], lse[lo:hi] = merge(o[lo:hi], lse[lo:hi], po, plse)
        self.reply(identity, wire.encode(wire.Kind.QUERY_RESULT, msg_id, {"layer": layer}))
