"""What the scheduler hands to the control plane, and the plans it gets back (docs/design.md §3).

Everything here is a small frozen dataclass. Units: rows are token rows of a
sub-batch's buffers (``q_buf`` and ``kv_buf`` share row numbering: row ``r`` is the
``r``-th new token of the sub-batch); ``tokens`` are token counts; ``offset`` is a token
offset inside a segment slot; instances and slots are integer ids.

Plans are built once per iteration and reused for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["prefill", "decode"]

# RowSpan, QueryItem and PutItem are built for every request of every iteration. Their
# ``__init__`` is written out and fills the instance dict directly: a third of the time
# of the generated frozen ``__init__`` (one ``object.__setattr__`` per field). They stay
# frozen (assignment raises) and compare, hash and print like the other dataclasses.


@dataclass(frozen=True)
class BatchRequest:
    """One request's share of an iteration.

    Attributes:
        request_id: the caller's id of the request, unique among live requests.
        new_token_ids: tokens computed in this iteration; their KV is put into the pool
            and they attend to the request's prefix through the pool.
        prefix_token_ids: only on the request's first iteration: the cached prefix it
            reuses, as ``get_prefix_tree().match(prompt)`` found it: whole segments, all
            ready in the pool, possibly followed by whole pages that a ready next
            segment starts with (a page hit). Empty for a request without a hit and on
            every later iteration (the pool remembers what the request holds).
        cache_salt: the tenant namespace of the request's segments (vLLM's
            ``cache_salt``; at most 256 characters), read on its first iteration: its
            prefix is matched, and its segments stored and shared, only under this salt
            (``get_prefix_tree().match(prompt, salt=...)``). ``None`` or ``""``: no
            salt, shared with every unsalted request. A later iteration repeats it or
            leaves it out (another salt is a ``PlanError``).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    prefix_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None


@dataclass(frozen=True)
class Batch:
    """Requests that run together in one phase (PD disaggregation: one phase per batch)."""

    requests: tuple[BatchRequest, ...]
    phase: Phase = "prefill"

    @property
    def num_new_tokens(self) -> int:
        return sum(len(r.new_token_ids) for r in self.requests)


@dataclass(frozen=True, init=False)
class RowSpan:
    """Rows ``[start, stop)`` of a sub-batch that belong to one request.

    ``position`` is the sequence position of row ``start`` (RoPE, causal masks);
    ``prefix_tokens`` is how many tokens of the request the pool holds before this
    iteration (all of them are attended through the query plan).
    """

    request_id: str
    start: int
    stop: int
    position: int
    prefix_tokens: int

    def __init__(self, request_id: str, start: int, stop: int, position: int,
                 prefix_tokens: int) -> None:
        d = self.__dict__  # frozen; filled directly (see the note at the top)
        d["request_id"], d["start"], d["stop"] = request_id, start, stop
        d["position"], d["prefix_tokens"] = position, prefix_tokens


@dataclass(frozen=True, init=False)
class QueryItem:
    """Rows of one request attending the segments one instance holds for it.

    ``slots[i]`` holds ``tokens[i]`` valid tokens (``C`` for a sealed segment, fewer for
    the request's private open tail).
    """

    request_id: str
    start: int
    stop: int
    slots: tuple[int, ...]
    tokens: tuple[int, ...]

    def __init__(self, request_id: str, start: int, stop: int, slots: tuple[int, ...],
                 tokens: tuple[int, ...]) -> None:
        d = self.__dict__  # frozen; filled directly (see the note at the top)
        d["request_id"], d["start"], d["stop"] = request_id, start, stop
        d["slots"], d["tokens"] = slots, tokens


@dataclass(frozen=True)
class QueryTask:
    """Work for the query engine of ``instance``: partial attention over its slots."""

    instance: int
    items: tuple[QueryItem, ...]

    @property
    def num_rows(self) -> int:
        return sum(it.stop - it.start for it in self.items)


@dataclass(frozen=True)
class QueryPlan:
    """Prefix attention of one sub-batch: scatter q rows to the tasks, merge the partials.

    A request's prefix is the union of its items in ``tasks`` (sealed segments, the
    same from one decode step to the next) and in ``tails`` (its private open tail, at
    most one item). ``home`` is the instance that computes the sub-batch (its local
    share is the tasks whose ``instance == home``). Rows of a request with an empty
    prefix appear in no task and get the empty partial result (``lse = -inf``).
    """

    batch: int
    part: int
    home: int
    num_rows: int
    spans: tuple[RowSpan, ...]
    tasks: tuple[QueryTask, ...]
    tails: tuple[QueryTask, ...] = ()

    def tasks_by_instance(self) -> dict[int, tuple[QueryItem, ...]]:
        """Sealed and tail items together, per instance (what each query engine runs)."""
        out: dict[int, tuple[QueryItem, ...]] = {}
        for task in self.tasks + self.tails:
            out[task.instance] = out.get(task.instance, ()) + task.items
        return out


@dataclass(frozen=True, init=False)
class PutItem:
    """Store rows ``[start, stop)`` of ``kv_buf`` at token ``offset`` of a slot.

    ``key`` names the sealed segment the rows complete, or is ``None`` while the slot is
    a private open tail.
    """

    instance: int
    slot: int
    offset: int
    start: int
    stop: int
    key: bytes | None

    def __init__(self, instance: int, slot: int, offset: int, start: int, stop: int,
                 key: bytes | None) -> None:
        d = self.__dict__  # frozen; filled directly (see the note at the top)
        d["instance"], d["slot"], d["offset"] = instance, slot, offset
        d["start"], d["stop"], d["key"] = start, stop, key


@dataclass(frozen=True)
class PageCopy:
    """Copy the first ``tokens`` tokens (all layers) of ``src_slot`` on ``src_instance``
    into ``dst_slot`` on ``dst_instance`` (the same instance unless its slots ran out): a
    request whose prefix ends inside a cached segment (a page hit) gets the shared pages
    at the head of its own open tail, then writes its own tokens after them
    (docs/design.md §4)."""

    src_instance: int
    src_slot: int
    dst_instance: int
    dst_slot: int
    tokens: int


@dataclass(frozen=True)
class TransferPlan:
    """Where the new KV of one sub-batch is stored (``puts``) and what dedup saved.

    ``dedup_rows`` rows completed segments that the pool already had: they are not
    stored again. ``copies`` are done with the puts, layer by layer (same instance).
    """

    batch: int
    part: int
    home: int
    num_rows: int
    puts: tuple[PutItem, ...]
    dedup_rows: int
    copies: tuple[PageCopy, ...] = ()


@dataclass(frozen=True)
class Plans:
    """The output of :meth:`tokenlake.core.control.ControlPlane.gen_plans` for one iteration.

    ``groups[b]`` is the instance group of batch ``b`` (one instance per sub-batch, in
    sub-batch order). ``query_plans`` and ``transfer_plans`` are in (batch, part) order.
    """

    iteration: int
    query_plans: tuple[QueryPlan, ...]
    transfer_plans: tuple[TransferPlan, ...]
    groups: tuple[tuple[int, ...], ...]

    def __iter__(self):
        """Unpacks as the paper's ``query_plans, transfer_plans, groups``."""
        return iter((self.query_plans, self.transfer_plans, self.groups))

    def read_instances(self) -> frozenset[int]:
        """The instances whose slots the query plans read."""
        return frozenset(t.instance for qp in self.query_plans for t in qp.tasks + qp.tails)
