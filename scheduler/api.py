"""The one interface every scheduling policy implements (docs/design.md §6).

A policy is pure: it reads a :class:`Snapshot` (the time, the requests, the instances,
the pool's cache load and a latency model are all passed in; no clock, no RNG, no I/O)
and returns a :class:`Decision` -- which requests run together, in which phase, on how
many instances, and how many new tokens each computes this iteration. A policy that
needs randomness takes a seeded ``random.Random`` in its constructor.

:func:`to_batches` turns a decision into the ``(batches, dops)`` pair that
:meth:`tokenlake.core.control.ControlPlane.gen_plans` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, get_args

from tokenlake.core.cost_model import LatencyModel
from tokenlake.core.plans import Batch, BatchRequest, Phase

PHASES: tuple[str, ...] = get_args(Phase)  # ("prefill", "decode")


class DecisionError(ValueError):
    """A :class:`Decision` breaks a rule of the interface."""


@dataclass(frozen=True)
class RequestView:
    """What a policy sees of one request.

    Attributes:
        request_id: unique id of the request.
        phase: ``"prefill"`` while prompt tokens remain to compute, else ``"decode"``.
        context_tokens: tokens of this request already in the pool (its prefix).
        remaining_prefill: prompt tokens still to compute (0 in decode).
        arrival_s: arrival time, seconds on the snapshot's clock.
        tbt_slo_s: time-between-tokens SLO in seconds, or None for no SLO.
        decode_instance: the instance whose decode batch it ran in at the last
            iteration, or None (not decoding yet, or that batch ended); a policy may keep
            the batch together there (:mod:`scheduler.keep`).
    """

    request_id: str
    phase: Phase
    context_tokens: int
    remaining_prefill: int
    arrival_s: float
    tbt_slo_s: float | None = None
    decode_instance: int | None = None

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise DecisionError(f"request {self.request_id!r}: unknown phase {self.phase!r}")
        if self.decode_instance is not None and self.phase != "decode":
            raise DecisionError(f"request {self.request_id!r}: a decode_instance outside decode")
        if self.context_tokens < 0 or self.remaining_prefill < 0:
            raise DecisionError(f"request {self.request_id!r}: token counts must be >= 0")
        if self.phase == "prefill" and self.remaining_prefill < 1:
            raise DecisionError(f"request {self.request_id!r}: prefill with nothing to compute")
        if self.phase == "decode" and self.remaining_prefill != 0:
            raise DecisionError(f"request {self.request_id!r}: decode with prompt left")
        if self.tbt_slo_s is not None and not self.tbt_slo_s > 0:
            raise DecisionError(f"request {self.request_id!r}: tbt_slo_s must be > 0 or None")


@dataclass(frozen=True)
class InstanceView:
    """One instance: its id and whether it is still busy with a previous iteration."""

    instance: int
    busy: bool = False


@dataclass(frozen=True)
class Snapshot:
    """Everything a policy may read for one decision.

    ``cache_load`` is the share of the cluster the pool itself uses
    (:meth:`ControlPlane.get_cache_load`, paper §6.1); ``latency`` predicts iteration
    times. ``waiting`` are requests not admitted yet, ``running`` the admitted ones.
    """

    now_s: float
    waiting: tuple[RequestView, ...]
    running: tuple[RequestView, ...]
    instances: tuple[InstanceView, ...]
    cache_load: float
    latency: LatencyModel

    @property
    def requests(self) -> tuple[RequestView, ...]:
        return self.waiting + self.running

    @property
    def free_instances(self) -> int:
        return sum(1 for i in self.instances if not i.busy)


@dataclass(frozen=True)
class BatchDecision:
    """One batch: its requests, phase, degree of parallelism and new tokens per request.
    ``instance``: where a decode batch continues (its members ran there at the last
    iteration); None leaves the placement to the dispatch."""

    request_ids: tuple[str, ...]
    phase: Phase
    dop: int
    new_tokens: tuple[int, ...]
    instance: int | None = None

    def __post_init__(self) -> None:
        if not self.request_ids:
            raise DecisionError("a batch needs at least one request")
        if self.phase not in PHASES:
            raise DecisionError(f"unknown phase {self.phase!r}")
        if type(self.dop) is not int or self.dop < 1:
            raise DecisionError(f"dop must be an int >= 1, got {self.dop!r}")
        if self.phase == "decode" and self.dop != 1:
            raise DecisionError(f"a decode batch runs on exactly one instance, got dop={self.dop}")
        if len(self.new_tokens) != len(self.request_ids):
            raise DecisionError("new_tokens needs one count per request")
        if any(type(n) is not int or n < 1 for n in self.new_tokens):
            raise DecisionError(f"new token counts must be ints >= 1, got {self.new_tokens}")
        if self.phase == "decode" and any(n != 1 for n in self.new_tokens):
            raise DecisionError("a decode request computes exactly one new token")
        if self.instance is not None and (self.phase != "decode" or type(self.instance) is not int):
            raise DecisionError(f"only a decode batch names its instance, got {self.instance!r}")


@dataclass(frozen=True)
class Decision:
    """One iteration's batches. ``note`` says anything notable (e.g. an SLO fallback)."""

    batches: tuple[BatchDecision, ...]
    note: str = ""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for b in self.batches:
            for rid in b.request_ids:
                if rid in seen:
                    raise DecisionError(f"request {rid!r} appears twice in one decision")
                seen.add(rid)

    @property
    def dops(self) -> tuple[int, ...]:
        return tuple(b.dop for b in self.batches)

    @property
    def instances_per_phase(self) -> dict[str, int]:
        """How many instances this decision gives each phase: the DoPs of its prefill
        batches, one per decode batch (the split the DP chose, docs/scheduling.md)."""
        out = dict.fromkeys(PHASES, 0)
        for b in self.batches:
            out[b.phase] += b.dop
        return out

    def check(self, snap: Snapshot) -> None:
        """Raise :class:`DecisionError` unless this decision fits ``snap``.

        The DoPs must fit the free instances, every request must be in the snapshot in
        the batch's phase, and a prefill request may compute at most its remaining prompt.
        """
        if sum(self.dops) > snap.free_instances:
            raise DecisionError(
                f"decision uses {sum(self.dops)} instances, {snap.free_instances} are free")
        named = [b.instance for b in self.batches if b.instance is not None]
        free = {i.instance for i in snap.instances if not i.busy}
        if len(set(named)) != len(named) or not free.issuperset(named):
            raise DecisionError(f"batches name instances {named}; free are {sorted(free)}, "
                                "each for one batch")
        views = {r.request_id: r for r in snap.requests}
        for b in self.batches:
            for rid, n in zip(b.request_ids, b.new_tokens):
                view = views.get(rid)
                if view is None:
                    raise DecisionError(f"request {rid!r} is not in the snapshot")
                if view.phase != b.phase:
                    raise DecisionError(f"request {rid!r} is in {view.phase}, batch is {b.phase}")
                if b.phase == "prefill" and n > view.remaining_prefill:
                    raise DecisionError(f"request {rid!r}: {n} new tokens > remaining prompt")


class Policy(Protocol):
    """A scheduling policy: ``schedule`` must be pure (same snapshot -> same decision)."""

    name: str

    def schedule(self, snap: Snapshot) -> Decision: ...


TokenSource = Callable[[str, int], Sequence[int]]
PrefixSource = Callable[[str], Sequence[int]]


def to_batches(decision: Decision, token_source: TokenSource,
               prefix_source: PrefixSource | None = None) -> tuple[list[Batch], list[int]]:
    """The ``(batches, dops)`` for :meth:`ControlPlane.gen_plans` from a decision.

    ``token_source(request_id, n)`` returns the request's next ``n`` new token ids;
    ``prefix_source(request_id)`` (optional) returns the cached prefix token ids to send
    on a request's first iteration (empty otherwise, see :class:`BatchRequest`).
    """
    batches = []
    for b in decision.batches:
        reqs = []
        for rid, n in zip(b.request_ids, b.new_tokens):
            tokens = tuple(token_source(rid, n))
            if len(tokens) != n:
                raise DecisionError(f"token_source gave {len(tokens)} tokens for {rid!r}, want {n}")
            prefix = tuple(prefix_source(rid)) if prefix_source else ()
            reqs.append(BatchRequest(rid, tokens, prefix))
        batches.append(Batch(tuple(reqs), b.phase))
    return batches, list(decision.dops)
