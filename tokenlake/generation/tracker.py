"""One request tracker for the serving loop and the simulator.

:class:`RequestTracker` keeps every live request's progress -- its phase, prompt length,
prefix hit, prompt tokens computed, tokens generated -- and derives from it, in one
place, what the scheduler sees (:class:`scheduler.api.RequestView`) and what the cache
load is computed from (:class:`tokenlake.core.cost_model.LoadRequest`). The serving
:class:`~tokenlake.generation.loop.Server` and the simulated backends
(:mod:`evals.sim.backend` and the backends built on it) both keep their requests here,
so a policy gets the same inputs in the real server and in the simulator. The module is
pure Python (no torch): the simulator runs it for every event.

Lifecycle (tokens are counted in tokens)::

    add -> WAITING --admit--> PREFILL --advance_prefill (prompt complete)--> DECODE
             ^   set_hit         |  \\                                        |
             +-----requeue-------+   +--advance_decode ... finish ------> DONE --remove
             +-----preempt (PREFILL or DECODE: the KV is lost, computed again)---+

* ``WAITING``: not admitted. ``hit`` is the prefix the cache holds for it, as last
  matched by the owner (:meth:`set_hit`); the owner matches a prompt **once** per
  decision and the tracker keeps the result: the view, the cache load and the admission
  all read that one number (the serving loop used to match a prompt three times per
  admission, and could see three different answers).
* ``PREFILL``: admitted with ``hit`` tokens reused; ``prefilled`` prompt tokens have KV
  (``hit`` included).
* ``DECODE``: the prompt is complete; ``generated`` tokens are out, the first one made
  by the prompt's last prefill iteration. The last generated token is the next
  iteration's input, so the KV holds ``prompt_len + generated - 1`` tokens.
* ``DONE``: the last token is out; the owner still reads the record, then removes it.

Cache-load inputs (paper §6.1: ``input_len`` = tokens computed this iteration,
``prefix_len`` = tokens already cached that they attend over):

* waiting / prefilling: ``(min(chunk_tokens, remaining prompt), hit or prefilled)``: a
  chunked prefill computes at most one chunk per iteration, over what is cached;
* decoding: ``(1, prompt_len + generated - 1)``: one new token over the whole context.
  The serving loop used to charge a decoding request ``(prompt - hit, hit)``, its
  *prompt's* match, as if it prefilled its prompt again every iteration; that charged a
  decode step hundreds of tokens of compute it does not do and ignored the context it
  does read. One new token over the context is what a decode iteration costs the pool
  (a query row per layer against every cached token), so both users now say that.

Invariants (checked by :meth:`RequestTracker.check`):

1. every live record is in exactly one of the waiting and running tables, by phase
   (``WAITING`` -> waiting; ``PREFILL``, ``DECODE``, ``DONE`` -> running), and request
   ids are unique;
2. ``0 <= hit < prompt_len`` (at least one prompt token is computed, so the last
   position's logits exist);
3. ``WAITING``: ``prefilled == generated == 0``; ``PREFILL``: ``hit <= prefilled <
   prompt_len`` and ``generated == 0``; ``DECODE``/``DONE``: ``prefilled == prompt_len``
   and ``generated >= 1``;
4. the live and waiting tables are in add order (the running table keeps the order of
   admission).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping

from scheduler.api import RequestView
from tokenlake.core.cost_model import LatencyModel, LoadRequest, get_cache_load
from tokenlake.core.errors import TokenLakeError
from tokenlake.core.specs import HardwareProfile, ModelSpec

WAITING, PREFILL, DECODE, DONE = "waiting", "prefill", "decode", "done"
PHASES = (WAITING, PREFILL, DECODE, DONE)


class TrackerError(TokenLakeError, ValueError):
    """An operation that the request's phase does not allow (or a broken invariant)."""


class TrackedRequest:
    """One request's progress (see the module docstring for the phases).

    Owners subclass it to attach their own data (the server's request and result, the
    simulator's timing), adding ``__slots__``. Change the progress fields only through
    :class:`RequestTracker`; read them freely.

    Attributes:
        request_id: unique among the live requests of a tracker.
        prompt_len: prompt tokens (>= 1).
        arrival_s: arrival time, seconds on the owner's clock.
        tbt_slo_s: time-between-tokens SLO in seconds, or None.
        phase: one of :data:`PHASES`.
        hit: prompt tokens reused from the cache (see :meth:`RequestTracker.set_hit`).
        prefilled: prompt tokens with KV (``hit`` included), 0 while waiting.
        generated: output tokens produced so far.
        seq: the tracker's add order (set by :meth:`RequestTracker.add`).
    """

    __slots__ = ("request_id", "prompt_len", "arrival_s", "tbt_slo_s", "phase", "hit",
                 "prefilled", "generated", "seq")

    def __init__(self, request_id: str, prompt_len: int, arrival_s: float = 0.0,
                 tbt_slo_s: float | None = None) -> None:
        self.request_id, self.prompt_len = request_id, prompt_len
        self.arrival_s, self.tbt_slo_s = arrival_s, tbt_slo_s
        self.phase = WAITING
        self.hit = self.prefilled = self.generated = self.seq = 0

    @property
    def admitted(self) -> bool:
        return self.phase != WAITING

    @property
    def context(self) -> int:
        """Tokens cached for this request that its next iteration attends over: the hit
        while waiting, the prompt computed so far, then prompt plus outputs fed back."""
        phase = self.phase
        if phase == WAITING:
            return self.hit
        if phase == PREFILL:
            return self.prefilled
        return self.prompt_len + self.generated - 1

    @property
    def remaining(self) -> int:
        """Prompt tokens still to compute (0 once the prompt is complete)."""
        return self.prompt_len - (self.hit if self.phase == WAITING else self.prefilled)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.request_id!r}, {self.phase}, prompt={self.prompt_len}, "
                f"hit={self.hit}, prefilled={self.prefilled}, generated={self.generated})")


class RequestTracker(Mapping[str, TrackedRequest]):
    """The live requests of one serving loop or one simulated cluster.

    A read-only mapping ``request_id -> record`` in add order; the phase changes go
    through the methods below, which raise :class:`TrackerError` when the phase does not
    allow them. ``chunk_tokens`` is the most prompt tokens one request prefills per
    iteration (for the cache-load inputs).
    """

    def __init__(self, chunk_tokens: int) -> None:
        if type(chunk_tokens) is not int or chunk_tokens < 1:
            raise TrackerError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        self.chunk_tokens = chunk_tokens
        self._live: dict[str, TrackedRequest] = {}  # every live record, in add order
        self._waiting: dict[str, TrackedRequest] = {}  # WAITING, in add order
        self._running: dict[str, TrackedRequest] = {}  # admitted, in admission order
        self._seq = itertools.count()

    # ------------------------------------------------------------- mapping
    def __getitem__(self, request_id: str) -> TrackedRequest:
        return self._live[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live

    # dict's own views and get: the simulator reads these for every event, and Mapping's
    # generic ones go through __getitem__ for every record.
    def values(self):
        return self._live.values()

    def items(self):
        return self._live.items()

    def get(self, request_id: str, default=None):
        return self._live.get(request_id, default)

    def waiting(self) -> Iterable[TrackedRequest]:
        """Requests not admitted, in add order (a live view: stop iterating before
        changing the tracker)."""
        return self._waiting.values()

    def running(self) -> Iterable[TrackedRequest]:
        """Admitted requests, in admission order (a live view, as :meth:`waiting`)."""
        return self._running.values()

    # ----------------------------------------------------------- lifecycle
    def add(self, rec: TrackedRequest) -> TrackedRequest:
        """Starts tracking a new ``rec`` (phase ``WAITING``, nothing done yet)."""
        if rec.request_id in self._live:
            raise TrackerError(f"request {rec.request_id!r} is already tracked")
        if rec.phase != WAITING or rec.hit or rec.prefilled or rec.generated:
            raise TrackerError(f"request {rec.request_id!r} must be new to be added, got {rec!r}")
        if type(rec.prompt_len) is not int or rec.prompt_len < 1:
            raise TrackerError(f"request {rec.request_id!r}: prompt_len must be >= 1")
        rec.seq = next(self._seq)
        self._live[rec.request_id] = self._waiting[rec.request_id] = rec
        return rec

    def set_hit(self, rec: TrackedRequest, hit: int) -> None:
        """Records a waiting request's prefix match (tokens the cache holds for it, at
        most ``prompt_len - 1``): its view, cache load and admission use this value."""
        self._expect(rec, WAITING, "set its hit")
        if not 0 <= hit < rec.prompt_len:
            raise TrackerError(f"request {rec.request_id!r}: hit {hit} not in [0, {rec.prompt_len})")
        rec.hit = hit

    def admit(self, rec: TrackedRequest, hit: int | None = None) -> int:
        """``WAITING -> PREFILL`` reusing ``hit`` tokens (default: the kept match);
        returns the hit. The request moves to the end of the running table."""
        if hit is not None:
            self.set_hit(rec, hit)
        self._expect(rec, WAITING, "be admitted")
        rec.phase, rec.prefilled = PREFILL, rec.hit
        del self._waiting[rec.request_id]
        self._running[rec.request_id] = rec
        return rec.hit

    def requeue(self, rec: TrackedRequest) -> None:
        """Takes back an admission before any prompt token was computed (``PREFILL ->
        WAITING``); the request returns to its place in add order."""
        self._expect(rec, PREFILL, "be requeued")
        if rec.prefilled != rec.hit:
            raise TrackerError(f"request {rec.request_id!r} computed {rec.prefilled - rec.hit} "
                               "tokens: it cannot go back to waiting")
        rec.phase, rec.prefilled = WAITING, 0
        del self._running[rec.request_id]
        self._waiting[rec.request_id] = rec
        self._waiting = dict(sorted(self._waiting.items(), key=lambda kv: kv[1].seq))

    def preempt(self, rec: TrackedRequest, prompt_len: int) -> None:
        """An admitted request lost its KV (its instance failed, say) and will compute it
        again: back to ``WAITING``, in its place in add order, with nothing done and a
        prompt of ``prompt_len`` tokens (the owner's prompt plus what it already
        generated: the prefill of that prompt produces the next output token)."""
        if rec.phase not in (PREFILL, DECODE) or self._live.get(rec.request_id) is not rec:
            raise TrackerError(f"request {rec.request_id!r} in phase {rec.phase} cannot be preempted")
        if type(prompt_len) is not int or prompt_len < 1:
            raise TrackerError(f"request {rec.request_id!r}: prompt_len must be >= 1")
        rec.phase, rec.prompt_len = WAITING, prompt_len
        rec.hit = rec.prefilled = rec.generated = 0
        del self._running[rec.request_id]
        self._waiting[rec.request_id] = rec
        self._waiting = dict(sorted(self._waiting.items(), key=lambda kv: kv[1].seq))

    def advance_prefill(self, rec: TrackedRequest, n: int) -> bool:
        """``n`` more prompt tokens have KV; True when that completes the prompt, which
        also produced the first output token (``PREFILL -> DECODE``, ``generated = 1``)."""
        self._expect(rec, PREFILL, "prefill")
        if not 0 <= n <= rec.prompt_len - rec.prefilled:
            raise TrackerError(f"request {rec.request_id!r}: cannot prefill {n} tokens, "
                               f"{rec.prompt_len - rec.prefilled} remain")
        rec.prefilled += n
        if rec.prefilled < rec.prompt_len:
            return False
        rec.phase, rec.generated = DECODE, 1
        return True

    def advance_decode(self, rec: TrackedRequest, n: int = 1) -> None:
        """``n`` more output tokens are out (one per decode iteration)."""
        self._expect(rec, DECODE, "decode")
        if n < 0:
            raise TrackerError(f"request {rec.request_id!r}: cannot decode {n} tokens")
        rec.generated += n

    def finish(self, rec: TrackedRequest) -> None:
        """The request produced its last token (``DECODE -> DONE``); it stays readable
        until :meth:`remove`."""
        self._expect(rec, DECODE, "finish")
        rec.phase = DONE

    def remove(self, rec: TrackedRequest) -> None:
        """Stops tracking ``rec`` (in any phase: the owner gave up on it or it is done)."""
        if self._live.get(rec.request_id) is not rec:
            raise TrackerError(f"request {rec.request_id!r} is not tracked")
        del self._live[rec.request_id]
        table = self._waiting if rec.phase == WAITING else self._running
        del table[rec.request_id]

    def _expect(self, rec: TrackedRequest, phase: str, what: str) -> None:
        if rec.phase != phase or self._live.get(rec.request_id) is not rec:
            raise TrackerError(f"request {rec.request_id!r} in phase {rec.phase} cannot {what}")

    # -------------------------------------------------------- derivations
    def view(self, rec: TrackedRequest) -> RequestView:
        """What a policy sees of ``rec`` (a waiting request shows as a prefill over its
        hit). ``rec`` must not be ``DONE``."""
        if rec.phase == DECODE:
            return RequestView(rec.request_id, DECODE, rec.context, 0, rec.arrival_s, rec.tbt_slo_s)
        ctx = rec.context
        return RequestView(rec.request_id, PREFILL, ctx, rec.prompt_len - ctx, rec.arrival_s,
                           rec.tbt_slo_s)

    def views(self) -> tuple[tuple[RequestView, ...], tuple[RequestView, ...]]:
        """``(waiting, running)`` views for a :class:`scheduler.api.Snapshot` (DONE ones
        left out)."""
        return (tuple(self.view(r) for r in self._waiting.values()),
                tuple(self.view(r) for r in self._running.values() if r.phase != DONE))

    def load(self, rec: TrackedRequest) -> LoadRequest:
        """``rec``'s input to the cache load this iteration (see the module docstring)."""
        if rec.phase == DECODE:
            return LoadRequest(1, rec.context)
        ctx = rec.context
        return LoadRequest(min(self.chunk_tokens, rec.prompt_len - ctx), ctx)

    def cache_load(self, recs: Iterable[TrackedRequest], n_instances: int, model: ModelSpec,
                   hardware: HardwareProfile, latency: LatencyModel) -> float:
        """The pool's cache load (paper §6.1) for ``recs`` (none ``DONE``) running on
        ``n_instances``: :func:`tokenlake.core.cost_model.get_cache_load` of their
        :meth:`load` s; 0.0 for none."""
        loads = [self.load(r) for r in recs]
        return get_cache_load(loads, n_instances, model, hardware, latency) if loads else 0.0

    # ---------------------------------------------------------- invariants
    def check(self) -> None:
        """Raises :class:`TrackerError` unless invariants 1-4 of the module hold."""
        if self._live.keys() != self._waiting.keys() | self._running.keys() or \
                self._waiting.keys() & self._running.keys():
            raise TrackerError("the waiting and running tables do not split the live requests")
        for rid, rec in self._live.items():
            table = self._waiting if rec.phase == WAITING else self._running
            if rec.request_id != rid or table.get(rid) is not rec:
                raise TrackerError(f"request {rid!r} is in the wrong table for {rec!r}")
            _check_counts(rec)
        seqs = [r.seq for r in self._waiting.values()]
        if seqs != sorted(seqs) or [r.seq for r in self._live.values()] != \
                sorted(r.seq for r in self._live.values()):
            raise TrackerError("the waiting table is not in add order")


def _check_counts(rec: TrackedRequest) -> None:
    """Invariants 2 and 3 for one record."""
    ok = 0 <= rec.hit < rec.prompt_len
    if rec.phase == WAITING:
        ok = ok and rec.prefilled == rec.generated == 0
    elif rec.phase == PREFILL:
        ok = ok and rec.hit <= rec.prefilled < rec.prompt_len and rec.generated == 0
    elif rec.phase in (DECODE, DONE):
        ok = ok and rec.prefilled == rec.prompt_len and rec.generated >= 1
    else:
        ok = False
    if not ok:
        raise TrackerError(f"inconsistent counts: {rec!r}")
