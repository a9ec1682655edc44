"""Query messages: a compute engine's client and its home query engine (1x), and the
home query engine and its peers (4x).

A sub-batch's query plan is registered once per iteration and reused for every layer
(plan once, run many): the client sends :class:`RegisterQueryPlan` with every instance's
:class:`AttendItem`\\ s; the home query engine keeps its own and sends each peer its share
(:class:`PeerRegisterPlan`, rows renumbered from the peer's first row). Per layer the
client sends :class:`Query` (ids only: q is in the shared ``q`` buffer); the home sends
each peer its q rows (:class:`PeerQuery`), merges the partials of every
:class:`PeerQueryResult` with its own into the shared ``out`` buffer and answers
:class:`QueryDone`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenlake.core.plans import QueryPlan
from tokenlake.dataplane.messages.base import Fields, WireMessage
from tokenlake.dataplane.wire import Kind


@dataclass(frozen=True)
class AttendItem:
    """Rows ``[start, stop)`` of a sub-batch's q attend over ``slots`` of one instance's
    slab, of which the first ``tokens[i]`` token positions of ``slots[i]`` are valid.
    Wire form ``[start, stop, [slots...], [tokens...]]``."""

    start: int
    stop: int
    slots: tuple[int, ...]
    tokens: tuple[int, ...]

    def to_wire(self) -> list:
        return [self.start, self.stop, list(self.slots), list(self.tokens)]

    @classmethod
    def from_wire(cls, f: Fields, raw: Any, path: str) -> AttendItem:
        start, stop, slots, tokens = f.as_list(raw, path, 4)
        return cls(f.as_int(start, f"{path}[0]"), f.as_int(stop, f"{path}[1]"),
                   f.as_ints(slots, f"{path}[2]"), f.as_ints(tokens, f"{path}[3]"))

    def shifted(self, by: int) -> AttendItem:
        """The same item with its rows moved by ``by`` (negative: towards row 0)."""
        return AttendItem(self.start + by, self.stop + by, self.slots, self.tokens)


def _items(f: Fields, raw: Any, path: str) -> tuple[AttendItem, ...]:
    return tuple(AttendItem.from_wire(f, it, f"{path}[{i}]")
                 for i, it in enumerate(f.as_list(raw, path)))


@dataclass(frozen=True)
class InstanceItems:
    """The items of one instance in a :class:`RegisterQueryPlan`. Wire form
    ``[instance, [item...]]``."""

    instance: int
    items: tuple[AttendItem, ...]


@dataclass(frozen=True)
class RegisterQueryPlan(WireMessage):
    """``REGISTER_QUERY_PLAN`` ``{"plan": int, "rows": int, "tasks": [[instance,
    [item...]], ...], "grant": bin (optional)}``: a client registers a sub-batch's query
    plan with its home query engine. ``plan`` is the client's id for it, ``rows`` the
    sub-batch's q rows, ``tasks`` the items per instance (the home's own included),
    ``grant`` the control server's grant of it to a client session
    (:mod:`tokenlake.dataplane.grants`; the owner's clients send none). Answered with
    ``PLAN_ACK``."""

    KIND = Kind.REGISTER_QUERY_PLAN
    plan: int
    rows: int
    tasks: tuple[InstanceItems, ...]
    grant: bytes = b""

    @classmethod
    def from_plan(cls, plan_id: int, plan: QueryPlan, grant: bytes = b"") -> RegisterQueryPlan:
        """The message for ``plan``: its sealed and open-tail items, by instance."""
        tasks = tuple(
            InstanceItems(inst, tuple(AttendItem(it.start, it.stop, it.slots, it.tokens) for it in items))
            for inst, items in plan.tasks_by_instance().items())
        return cls(plan_id, plan.num_rows, tasks, grant)

    def body(self) -> dict:
        tasks = [[t.instance, [it.to_wire() for it in t.items]] for t in self.tasks]
        body = {"plan": self.plan, "rows": self.rows, "tasks": tasks}
        if self.grant:
            body["grant"] = self.grant
        return body

    @classmethod
    def from_wire(cls, f: Fields) -> RegisterQueryPlan:
        f.tensors(0)
        tasks = []
        for i, raw in enumerate(f.list("tasks")):
            inst, items = f.as_list(raw, f"tasks[{i}]", 2)
            tasks.append(InstanceItems(f.as_int(inst, f"tasks[{i}][0]"), _items(f, items, f"tasks[{i}][1]")))
        return cls(f.int("plan"), f.int("rows"), tuple(tasks), f.bin("grant", default=b""))


@dataclass(frozen=True)
class Query(WireMessage):
    """``QUERY`` ``{"plan": int, "layer": int}``: a client asks its home query engine for
    the prefix attention of the registered plan's q rows (in the shared ``q`` buffer) at
    ``layer``. Answered with :class:`QueryDone` once the result is in ``out``."""

    KIND = Kind.QUERY
    plan: int
    layer: int

    def body(self) -> dict:
        return {"plan": self.plan, "layer": self.layer}

    @classmethod
    def from_wire(cls, f: Fields) -> Query:
        f.tensors(0)
        return cls(f.int("plan"), f.int("layer"))


@dataclass(frozen=True)
class QueryDone(WireMessage):
    """``QUERY_DONE`` ``{"layer": int}``: the merged ``(o, lse)`` of the plan's rows is in
    the shared ``out_o``/``out_lse`` buffers."""

    KIND = Kind.QUERY_DONE
    layer: int

    def body(self) -> dict:
        return {"layer": self.layer}

    @classmethod
    def from_wire(cls, f: Fields) -> QueryDone:
        f.tensors(0)
        return cls(f.int("layer"))


@dataclass(frozen=True)
class PeerRegisterPlan(WireMessage):
    """``PEER_REGISTER_PLAN`` ``{"home": int, "plan": int, "items": [item...]}``: a home
    query engine gives a peer its share of plan ``plan``; the items' rows count from the
    first q row the home will send (:class:`PeerQuery`). ``(home, plan)`` names the plan
    on the peer. Sent without waiting; the peer answers ``PLAN_ACK`` (or ``ERROR``)."""

    KIND = Kind.PEER_REGISTER_PLAN
    home: int
    plan: int
    items: tuple[AttendItem, ...]

    def body(self) -> dict:
        return {"home": self.home, "plan": self.plan, "items": [it.to_wire() for it in self.items]}

    @classmethod
    def from_wire(cls, f: Fields) -> PeerRegisterPlan:
        f.tensors(0)
        return cls(f.int("home"), f.int("plan"), _items(f, f.get("items"), "items"))


@dataclass(frozen=True)
class PeerReleasePlan(WireMessage):
    """``PEER_RELEASE_PLAN`` ``{"home": int, "plan": int}``: the home drops its plan on
    a peer (sent without waiting; answered ``PLAN_ACK``)."""

    KIND = Kind.PEER_RELEASE_PLAN
    home: int
    plan: int

    def body(self) -> dict:
        return {"home": self.home, "plan": self.plan}

    @classmethod
    def from_wire(cls, f: Fields) -> PeerReleasePlan:
        f.tensors(0)
        return cls(f.int("home"), f.int("plan"))


@dataclass(frozen=True, eq=False)  # tensors: equal only to itself
class PeerQuery(WireMessage):
    """``PEER_QUERY`` ``{"home": int, "plan": int, "layer": int}`` + ``q``: partial
    attention of the q rows (float32 ``[rows, q_heads, head_dim]``, the rows the peer's
    items of plan ``(home, plan)`` need) over the peer's slots at ``layer``. Answered
    with :class:`PeerQueryResult`."""

    KIND = Kind.PEER_QUERY
    home: int
    plan: int
    layer: int
    q: torch.Tensor

    def body(self) -> dict:
        return {"home": self.home, "plan": self.plan, "layer": self.layer}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.q,)

    @classmethod
    def from_wire(cls, f: Fields) -> PeerQuery:
        (q,) = f.tensors(1, "q")
        return cls(f.int("home"), f.int("plan"), f.int("layer"), q)


@dataclass(frozen=True, eq=False)  # tensors: equal only to itself
class PeerQueryResult(WireMessage):
    """``PEER_QUERY_RESULT`` ``{"layer": int}`` + ``o``, ``lse``: a peer's partial over
    its slots: ``o`` float32 ``[rows, q_heads, head_dim]`` normalised, ``lse`` float32
    ``[rows, q_heads]`` natural-log log-sum-exp; a row with no slot has ``lse = -inf``,
    ``o = 0``."""

    KIND = Kind.PEER_QUERY_RESULT
    layer: int
    o: torch.Tensor
    lse: torch.Tensor

    def body(self) -> dict:
        return {"layer": self.layer}

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.o, self.lse)

    @classmethod
    def from_wire(cls, f: Fields) -> PeerQueryResult:
        o, lse = f.tensors(2, "o, lse")
        return cls(f.int("layer"), o, lse)
