"""The query engine of one instance (paper §3.3, docs/design.md §4).

It maps its instance's slab and the compute engine's ``q``/``out`` buffers from shared
memory and answers two kinds of work:

* as **home** of a sub-batch (from its compute engine): on ``QUERY`` it sends the q rows
  each remote instance needs to that instance's query engine (``PEER_QUERY``), computes
  its own share over local slots meanwhile, merges every partial ``(o, lse)`` exactly,
  writes the result into ``out`` and answers the compute engine (``QUERY_DONE``);
* as **peer** (from a home query engine): partial attention of the received q rows
  over the slots the plan names, returned as ``(o, lse)`` (``PEER_QUERY_RESULT``).

Plans are registered once (``REGISTER_QUERY_PLAN``, which the home passes on to each
peer as ``PEER_REGISTER_PLAN``) and reused for every layer. A plan belongs to the session
that registered it (:class:`~tokenlake.engines.loop.Caller`): its id is the
session's, its q rows and results are in that session's buffers, and only that session
can query or release it. Towards peers the home names a plan by an id of its own
(unique on this engine), so the plans of different sessions never meet there. A peer whose slab is on this
machine (``EngineSpec.shared_slabs``) is not asked at all: the home maps that slab and
attends its slots itself, the plan's leases keeping them as they were (docs/data-plane.md
"Co-located slabs"). Their items arrive typed
(:class:`~tokenlake.dataplane.messages.AttendItem`) and are checked against this slab
here, before anything is stored or sent on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenlake.core.errors import EngineUnavailable, NotAuthorized, PlanError
from tokenlake.dataplane import grants
from tokenlake.dataplane.attend_layout import AttendLayout
from tokenlake.dataplane.messages import (
    AttendItem,
    PeerQuery,
    PeerQueryResult,
    PeerRegisterPlan,
    PeerReleasePlan,
    PlanAck,
    Query,
    QueryDone,
    RegisterQueryPlan,
    ReleasePlan,
    WireMessage,
)
from tokenlake.dataplane.tensor_frames import WireError
from tokenlake.dataplane.wire import error_message
from tokenlake.engines.bells import Answer
from tokenlake.engines.loop import Caller, EngineLoop, EngineSpec, Pending, run_engine
from tokenlake.kernels.attention import merge, merge_many, write_into
from tokenlake.kernels.paged_torch import gpu_slab_attention, warm_up

#: Plans one home may have registered on this engine at once (the oldest is dropped).
#: Only engines send peer plans (docs/security.md), and a home releases every plan it
#: replaces or drops, so the bound is a guard against lost releases: it is sized for
#: the plans of many sessions homed there at once (a session keeps one query plan per
#: home registered, and one more while the release of the last is on its way; a server
#: serves 64 sessions by default).
MAX_PEER_PLANS = 256
#: Plans one session may have registered with its home at once (the oldest is dropped:
#: a client releases each plan when it registers the next, so only a client that loses
#: its releases ever reaches the bound).
MAX_SESSION_PLANS = 64


@dataclass(frozen=True)
class HomePlan:
    """A sub-batch plan registered by a compute engine homed on this instance."""

    rows: int
    local: AttendLayout  # the items attended here (own and shared slabs)
    remote: dict[int, tuple[int, int]]  # instance -> (lo, hi) rows its query engine needs
    peer_id: int  # the plan's id towards the peers (unique on this engine)
    session: bytes  # whose plan it is
    grant: int  # the grant it was registered under (-1: the owner's, which need none)
    expiry: float  # wall-clock seconds after which it may not be queried (its grant's)
    q: torch.Tensor  # the plan's rows of the session's buffers (views, made once): q in,
    out: tuple[torch.Tensor, torch.Tensor]  # the merged partial (o, lse) out


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
        # instance -> a slab this engine attends itself: its own, and co-located peers'
        self.slabs = {spec.instance: self.slab, **self.map_shared_slabs(self.slab)}
        self.home_plans: dict[tuple[bytes, int], HomePlan] = {}  # (session, its plan id) -> plan
        self.peer_plans: dict[tuple[int, int], AttendLayout] = {}  # (home, peer id) -> its items here
        self._peer_ids = itertools.count(1)
        if self.slab.is_cuda:  # before the engine reports ready: a first use compiles the kernel
            warm_up(self.slab, self.q_heads)

    # -------------------------------------------------------------- dispatch
    def handle(self, identity, msg_id: int, message: WireMessage, caller: Caller) -> None:
        match message:
            case Query():
                self._serve_home(identity, msg_id, message, caller)
            case PeerQuery():
                self._serve_peer(identity, msg_id, message)
            case RegisterQueryPlan():
                self._register_home(message, caller)
                self.reply(identity, PlanAck(message.plan).encode(msg_id))
            case PeerRegisterPlan():
                if message.home not in self.peers:  # a home is a peer of this engine
                    raise PlanError(f"instance {message.home} is not a peer of instance {self.spec.instance}")
                self._check_items(message.items, self.q.shape[0])
                self._keep_peer_plan((message.home, message.plan), message.items)
                self.reply(identity, PlanAck(message.plan).encode(msg_id))
            case ReleasePlan():
                self._release((caller.require_session(), message.plan))
                self.reply(identity, PlanAck(message.plan).encode(msg_id))
            case PeerReleasePlan():
                self.peer_plans.pop((message.home, message.plan), None)
                self.reply(identity, PlanAck(message.plan).encode(msg_id))
            case _:
                raise WireError(f"query engine cannot handle {message.KIND.name}")

    # ------------------------------------------------------------- plans
    def _check_items(self, items: Sequence[AttendItem], rows: int) -> None:
        """Checks items against the slab and a plan of ``rows`` q rows (PlanError)."""
        for it in items:
            if len(set(it.slots)) != len(it.slots):  # a chain holds a segment once: bounds work
                raise PlanError(f"an item names a slot twice ({len(it.slots)} slots)")
            if not 0 <= it.start < it.stop <= rows:
                raise PlanError(f"rows [{it.start}, {it.stop}) outside [0, {rows})")
            if len(it.slots) != len(it.tokens) or not it.slots:
                raise PlanError("an item needs as many token counts as slots, and at least one")
            if any(not 0 <= s < self.num_slots for s in it.slots):
                raise PlanError(f"slot out of range [0, {self.num_slots}) in {list(it.slots)}")
            if any(not 0 < t <= self.C for t in it.tokens):
                raise PlanError(f"token counts must be in (0, {self.C}], got {list(it.tokens)}")
        work = sum((it.stop - it.start) * len(it.slots) for it in items)
        if work > rows * self.num_slots:  # each row reads each slot at most once
            raise PlanError(f"plan asks for {work} row-slot reads; {rows} rows x "
                            f"{self.num_slots} slots at most")

    def _keep_peer_plan(self, key: tuple[int, int], items: tuple[AttendItem, ...]) -> None:
        """Registers a peer's plan; a home keeps at most ``MAX_PEER_PLANS`` here, the
        oldest going first (a home releases each plan when it registers the next, so
        only a lost release or a hostile peer ever reaches the bound)."""
        self.peer_plans.pop(key, None)
        self.peer_plans[key] = AttendLayout.of({self.spec.instance: items})
        mine = [k for k in self.peer_plans if k[0] == key[0]]
        for old in mine[: max(0, len(mine) - MAX_PEER_PLANS)]:
            del self.peer_plans[old]

    def _register_home(self, message: RegisterQueryPlan, caller: Caller) -> None:
        session, bufs = self.session_buffers(caller)
        grant, expiry = self.check_grant(caller, grants.QUERY_PLAN, message.grant, message.body)
        pid, rows = message.plan, message.rows
        if not 0 < rows <= self.q.shape[0]:
            raise PlanError(f"plan has {rows} rows; q_buf holds at most {self.q.shape[0]}")
        local: dict[int, tuple[AttendItem, ...]] = {}
        checked = []
        for task in message.tasks:
            self._check_items(task.items, rows)
            if task.instance != self.spec.instance and task.instance not in self.peers:
                raise PlanError(f"instance {task.instance} is not in this cluster")
            if task.instance in self.slabs:  # its own, or a co-located peer's slab
                local[task.instance] = local.get(task.instance, ()) + task.items
            else:
                checked.append(task)
        key = (session, pid)
        self._release(key)  # an id registered again replaces its plan
        peer_id = next(self._peer_ids)
        remote: dict[int, tuple[int, int]] = {}
        for task in checked:  # all validated: now tell the peers
            lo, hi = min(it.start for it in task.items), max(it.stop for it in task.items)
            shifted = tuple(it.shifted(-lo) for it in task.items)
            self.tell(task.instance, PeerRegisterPlan(self.spec.instance, peer_id, shifted))
            remote[task.instance] = (lo, hi)
        self.home_plans[key] = HomePlan(rows, AttendLayout.of(local), remote,
                                        peer_id, session, grant, expiry, bufs["q"][:rows],
                                        (bufs["out_o"][:rows], bufs["out_lse"][:rows]))
        mine = [k for k in self.home_plans if k[0] == session]
        for old in mine[: max(0, len(mine) - MAX_SESSION_PLANS)]:  # the oldest first
            self._release(old)

    def _release(self, key: tuple[bytes, int]) -> None:
        home = self.home_plans.pop(key, None)
        if home is not None:
            for inst in home.remote:
                if inst in self.peers:
                    self.tell(inst, PeerReleasePlan(self.spec.instance, home.peer_id))

    def drop_session(self, token: bytes) -> None:
        for key in [k for k in self.home_plans if k[0] == token]:
            self._release(key)

    def drop_grants(self, token: bytes, grant_ids: frozenset[int]) -> None:
        for key in [k for k, p in self.home_plans.items() if k[0] == token and p.grant in grant_ids]:
            self._release(key)

    def connect_peers(self, endpoints: dict[int, str | None]) -> None:
        """As the loop's, and forgets the plans that a re-pointed (restarted or removed)
        home had registered here: a new home process numbers its plans afresh."""
        super().connect_peers(endpoints)
        for key in [k for k in self.peer_plans if k[0] in endpoints]:
            del self.peer_plans[key]

    # ------------------------------------------------------------- compute
    def _partial(self, q: torch.Tensor, layout: AttendLayout, layer: int,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of rows ``q`` over a plan's items here (rows relative to
        ``q``), as its :class:`AttendLayout` says; the partials are merged exactly, and
        a single one over all rows is returned as it is. Given ``out`` (the session's
        ``o`` and ``lse`` rows), the result is written there (by the kernel itself on
        the csrc path: no copy) and ``out`` is returned."""
        if self.slab.is_cuda:  # own slab only; every group in one batched launch (docs/design.md "GPU path")
            return write_into(gpu_slab_attention(q.to(self.slab.device), self.slab, layer, layout.paged_groups), out)
        return layout.attend(q, layer, [self.slabs[inst] for inst in layout.insts], self.q_heads, out)

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise PlanError(f"layer {layer} outside [0, {self.num_layers})")
        return layer

    def _serve_peer(self, identity, msg_id: int, message: PeerQuery) -> None:
        key = (message.home, message.plan)
        layout = self.peer_plans.get(key)
        if layout is None:
            raise PlanError(f"unknown plan {message.home}:{message.plan} on instance {self.spec.instance}")
        layer = self._check_layer(message.layer)
        q = message.q
        if q.dim() != 3 or q.shape[1:] != (self.q_heads, self.head_dim) or q.dtype != torch.float32:
            raise PlanError(f"q must be float32 [rows, {self.q_heads}, {self.head_dim}], got {q.dtype} {tuple(q.shape)}")
        if layout.stop > q.shape[0]:
            raise PlanError("q has fewer rows than the plan's items need")
        o, lse = self._partial(q, layout, layer)
        self.reply(identity, PeerQueryResult(layer, o, lse).encode(msg_id))

    def _serve_home(self, identity, msg_id: int, message: Query, caller: Caller) -> None:
        def answer(exc: BaseException | None) -> None:
            self.reply(identity, QueryDone(message.layer).encode(msg_id) if exc is None
                       else error_message(msg_id, exc))
        self._query(caller, message.plan, message.layer, answer)

    def handle_bell(self, caller: Caller, plan: int, layer: int, layers: int, answer: Answer) -> None:
        """A ``QUERY`` posted on the session's bell (``layers`` is 1)."""
        self._query(caller, plan, layer, answer)

    def _query(self, caller: Caller, pid: int, layer: int, answer: Answer) -> None:
        """Serves a query of plan ``pid`` at ``layer``: peers asked, the own share attended,
        every partial merged into the session's ``out``; ``answer`` once (a check that
        fails before anything is asked raises instead)."""
        session, _ = self.session_buffers(caller)
        plan = self.home_plans.get((session, pid))
        if plan is None:
            raise PlanError(f"unknown plan {pid} on instance {self.spec.instance}")
        if plan.expiry < time.time():
            raise NotAuthorized(f"plan {pid}'s grant expired")
        layer = self._check_layer(layer)
        gone = [i for i in plan.local.insts if i != self.spec.instance and i not in self.peers]
        if gone:  # its slab may be zeroed for a restart: never read it after it left
            raise EngineUnavailable(f"instance {gone[0]} left the cluster after plan {pid} was registered")
        q = plan.q
        if not plan.remote:  # every slot is attended here: nothing to wait for
            self._partial(q, plan.local, layer, plan.out)
            answer(None)
            return
        pending = self.new_pending(PeerQueryResult, session)
        pending.on_done = lambda p: self._finish_home(plan, layer, p, answer)
        pending.on_fail = lambda p, exc: answer(exc)
        for inst, (lo, hi) in plan.remote.items():  # q rows out first: peers work meanwhile
            self.ask(inst, PeerQuery(self.spec.instance, plan.peer_id, layer, q[lo:hi]), pending)
        try:
            own = PeerQueryResult(layer, *self._partial(q, plan.local, layer))  # merged like a peer's
        except Exception as exc:  # one reply only: the ERROR; the peers' late results are dropped
            self._fail(pending, exc)
            return
        pending.results.append((self.spec.instance, own))
        if not pending.waiting:
            self._finish_home(plan, layer, pending, answer)

    def _finish_home(self, plan: HomePlan, layer: int, pending: Pending, answer: Answer) -> None:
        o, lse = plan.out
        parts = []  # (lo, hi, o, lse), every one checked before the caller's buffers are written
        for inst, result in pending.results:  # PeerQueryResults (Pending.expect)
            lo, hi = (0, plan.rows) if inst == self.spec.instance else plan.remote[inst]
            rows = (hi - lo, self.q_heads)
            if result.layer != layer or tuple(result.o.shape) != (*rows, self.head_dim) \
                    or tuple(result.lse.shape) != rows:
                raise WireError(f"instance {inst} answered layer {result.layer} with o "
                                f"{tuple(result.o.shape)}, lse {tuple(result.lse.shape)}; "
                                f"expected layer {layer}, {rows} rows x heads")
            parts.append((lo, hi, result.o.to(o.device), result.lse.to(o.device)))  # a GPU pool: peers' arrive on the host
        if len(parts) == 1 and parts[0][:2] == (0, plan.rows):  # all attended here: nothing to merge
            o.copy_(parts[0][2])
            lse.copy_(parts[0][3])
        elif all(lo == 0 and hi == plan.rows for lo, hi, _, _ in parts):  # one vectorised merge
            mo, mlse = merge_many(torch.stack([p[2] for p in parts]), torch.stack([p[3] for p in parts]))
            o.copy_(mo)
            lse.copy_(mlse)
        else:
            o.zero_()
            lse.fill_(float("-inf"))
            for lo, hi, po, plse in parts:
                o[lo:hi], lse[lo:hi] = merge(o[lo:hi], lse[lo:hi], po, plse)
        answer(None)


def main(spec_bytes: bytes, conn) -> None:
    """Runs one query engine process (a ``multiprocessing`` target; see
    :func:`tokenlake.engines.loop.run_engine` for the handshake over ``conn``)."""
    run_engine(QueryEngine, spec_bytes, conn)
