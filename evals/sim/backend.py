"""The discrete-event core shared by every simulated system.

Events are request arrivals, ends of *runs*, and backend-specific events (decisions,
replications, KV transfers, timers). A **run** is a batch on a group of instances that
repeats iterations (decode steps or prefill chunks) with the same composition; its
iteration times are known in advance (:mod:`evals.sim.timing`), so one event covers many
iterations and every token's time is still exact.

The per-worker baselines (:mod:`evals.sim.unpooled`, :mod:`evals.sim.xpyd`) use the run
lifecycle here: a run ends naturally at the first iteration after which one of its
requests leaves the batch (its prompt is complete, or its last token is out), or is
**cut** at its next iteration boundary when the state its worker's policy would see
there has changed (:meth:`Backend.continues` says which changes matter); then its
instances are free and the policy decides again. TokenLake (:mod:`evals.sim.pooled`)
makes cluster-wide decisions and manages its runs itself.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

from evals.sim.config import Setup
from evals.sim.metrics import Recorder, SimResult, as_result
from evals.sim.timing import decode_bs1_s, prefill_bs1_s
from evals.workloads.base import Request
from tokenlake.generation.tracker import DONE, RequestTracker, TrackedRequest

ARRIVAL, PLAN_END = 0, 1


class SimulationError(RuntimeError):
    """The simulated cluster cannot make progress (e.g. memory too small for a request)."""


class SimRequest(TrackedRequest):
    """A request's progress: the tracked part (phase, hit, prefilled, generated, see
    :mod:`tokenlake.generation.tracker`; changed only through the backend's
    :attr:`Backend.tracker`) plus what the simulator keeps. ``worker`` is where it last
    ran (or is routed), ``decode_at`` the instance of the decode batch it ran in last
    (None before its first decode step); ``ready_s`` when its last iteration ends; ``blocked`` why it may
    not be scheduled now (None: it may); ``aux`` is the backend's (TokenLake: its plan;
    xPyD: KV bytes)."""

    __slots__ = ("idx", "source", "output_len", "first_token_s", "last_token_s", "tbt_sum",
                 "tbt_count", "tbt_max", "tbt_max_waited", "run", "blocked", "ttft_slo_s", "tokens", "keys",
                 "worker", "decode_at", "aux", "ready_s")

    def __init__(self, idx: int, source: Request) -> None:
        super().__init__(source.request_id, source.input_length, source.arrival_s)
        self.idx, self.source, self.output_len = idx, source, source.output_length
        self.first_token_s = self.last_token_s = 0.0
        self.tbt_sum, self.tbt_count, self.tbt_max = 0.0, 0, 0.0
        self.tbt_max_waited = False  # the longest TBT spans a wait between two batches
        self.run = self.blocked = self.tokens = self.keys = self.worker = self.aux = None
        self.decode_at = None
        self.ttft_slo_s = self.tbt_slo_s = 0.0
        self.ready_s = self.arrival_s  # when its last iteration ends (it may run again)


class Run:
    """Batches on ``group`` repeating iterations ``1 .. k_end`` of ``sched``.

    ``chunks[i]`` lists request ``i``'s new tokens per iteration while it prefills, or is
    None while it decodes (one token per iteration); ``phase`` is ``"prefill"``,
    ``"decode"`` or ``"mixed"``. ``plan_from``: iterations already accounted for;
    ``plan_to``: the iteration its end event is at; ``version`` invalidates stale events;
    ``state``: the backend state it was decided in.
    """

    __slots__ = ("reqs", "phase", "group", "dop", "sched", "k_end", "plan_from", "plan_to",
                 "chunks", "version", "state")

    def __init__(self, reqs, phase, group, dop, sched, k_end, chunks=None) -> None:
        self.reqs, self.phase, self.group, self.dop = list(reqs), phase, tuple(group), dop
        self.sched, self.k_end, self.chunks, self.state = sched, k_end, chunks, None
        if chunks is None:
            self.chunks = [None] * len(self.reqs)
        self.plan_from, self.plan_to, self.version = 0, k_end, 0

    def tokens_between(self, i: int, j0: int, j1: int) -> int:
        """New tokens of request ``i`` in iterations ``j0+1 .. j1``."""
        c = self.chunks[i]
        return j1 - j0 if c is None else sum(c[j0:j1])


class RunSet(dict):
    """The runs in progress, in start order: a set whose iteration order does not depend
    on memory addresses (a ``set`` of runs hashes them by identity), so that a
    simulation replays identically in every process."""

    def add(self, run: Run) -> None:
        self[run] = None

    def discard(self, run: Run) -> None:
        self.pop(run, None)


class Backend:
    """Event loop plus the run lifecycle; subclasses add placement, caches and policy."""

    name = "backend"

    def __init__(self, setup: Setup, system: str, instance_ids: Sequence,
                 chunk_tokens: int | None = None) -> None:
        self.setup, self.system = setup, system
        self.lat, self.config = setup.latency, setup.config
        self.instance_ids = list(instance_ids)
        self.rec = Recorder(self.instance_ids, self.config.cv_window_s)
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        # The live requests (arrived, not finished), in arrival order; chunk_tokens: the
        # most prompt tokens a request prefills per iteration (default: the config's).
        self.tracker = RequestTracker(chunk_tokens or self.config.chunk_tokens)
        self.busy: dict = {}  # instance -> run
        self.runs = RunSet()
        self.state = 0  # bumps whenever the waiting set or the idle instances change
        self._sig = None
        self.events = self.iterations = self.scheduler_calls = self.plan_calls = 0
        self.busy_s = 0.0  # summed duration of every simulated iteration (per batch)
        self._next_turn: dict[str, SimRequest] = {}  # closed sessions: rid -> next turn
        self.pending_arrivals = 0  # arrival events not handled yet (held turns excluded)

    # ----------------------------------------------------------------- events
    def push(self, t: float, kind: int, obj, version: int = 0) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj, version))

    def simulate(self, requests: Sequence[Request],
                 progress: Callable[[int], None] | None = None) -> SimResult:
        """Runs every request to completion and returns the measurements."""
        wall, cpu = time.perf_counter(), time.process_time()
        sims = [SimRequest(i, src) for i, src in
                enumerate(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))]
        self._next_turn = self._session_chains(sims) if self.config.closed_sessions else {}
        held = {id(r) for r in self._next_turn.values()}
        for r in sims:
            if id(r) not in held:
                self.push(r.arrival_s, ARRIVAL, r)
                self.pending_arrivals += 1
        self.start()
        heap = self._heap
        while heap:
            t, _, kind, obj, version = heapq.heappop(heap)
            self.now = t
            self.events += 1
            if kind == ARRIVAL:
                self._arrive(obj)
            elif kind == PLAN_END:
                if obj.version == version and obj in self.runs:
                    self._plan_end(obj)
            else:
                self.handle(kind, obj)
            if heap and heap[0][0] == t:
                continue  # finish every event of this instant before deciding
            self.decide()
            self._update_cuts()
            if progress is not None:
                progress(len(self.rec.rows))
        if self.tracker:
            stuck = sorted(self.tracker)[:5]
            raise SimulationError(f"{len(self.tracker)} requests never finished (e.g. {stuck}); "
                                  "the cache is probably too small for them")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        extra = self.extra()
        extra["mean_iteration_s"] = self.busy_s / self.iterations if self.iterations else None
        return as_result(self.system, len(self.instance_ids), self.rec.summary(),
                         sim_wall_s=wall, sim_cpu_s=cpu,
                         events=self.events, events_per_s=self.events / wall,
                         iterations=self.iterations, iterations_per_s=self.iterations / wall,
                         scheduler_calls=self.scheduler_calls, plan_calls=self.plan_calls,
                         extra=extra)

    @staticmethod
    def _session_chains(sims: list[SimRequest]) -> dict[str, SimRequest]:
        """Closed-loop sessions: request id -> the session's next turn, which is sent
        only when that request has finished (a chat client waits for the answer)."""
        sessions: dict[str, list[SimRequest]] = {}
        for r in sims:
            if r.source.session_id is not None:
                sessions.setdefault(r.source.session_id, []).append(r)
        out = {}
        for turns in sessions.values():
            turns.sort(key=lambda r: (r.source.turn, r.idx))
            out.update((a.request_id, b) for a, b in zip(turns, turns[1:]))
        return out

    def _arrive(self, req: SimRequest) -> None:
        cfg, lat = self.config, self.lat
        scale = cfg.slo_scale
        req.ttft_slo_s = (cfg.input_token_slo_s * req.prompt_len if cfg.input_token_slo_s
                          else scale * prefill_bs1_s(lat, req.prompt_len, cfg.chunk_tokens))
        req.tbt_slo_s = cfg.output_token_slo_s or scale * decode_bs1_s(lat, req.prompt_len)
        self.tracker.add(req)
        self.pending_arrivals -= 1
        self.on_arrival(req)

    # ------------------------------------------------------------------- runs
    def start_run(self, run: Run) -> None:
        """Occupies the run's instances and schedules its end."""
        run.plan_from, run.plan_to = 0, run.k_end
        self.runs.add(run)
        for inst in run.group:
            if inst in self.busy:
                raise SimulationError(f"instance {inst} given to two runs at {self.now}")
            self.busy[inst] = run
        for r in run.reqs:
            r.run = run
        self.push(run.sched.end(run.plan_to), PLAN_END, run, run.version)

    def cut(self, run: Run, t: float) -> None:
        """Ends ``run`` at its first iteration boundary at or after ``t``."""
        k = max(run.sched.first_end_at_or_after(t), run.plan_from + 1)
        if k >= run.k_end:
            return
        run.k_end = k
        if k < run.plan_to:
            run.plan_to = k
            run.version += 1
            self.push(run.sched.end(k), PLAN_END, run, run.version)

    def _plan_end(self, run: Run) -> None:
        j0, j1 = run.plan_from, run.plan_to
        self.commit(run, j0, j1)
        self.iterations += j1 - j0
        self._progress(run, j0, j1)
        self.runs.discard(run)
        for inst in run.group:
            del self.busy[inst]
        for r in run.reqs:
            r.run = None
        self.run_done(run)
        self.finish_done(run.reqs)

    def finish_done(self, reqs) -> None:
        """Records and releases every request of ``reqs`` that generated its last token
        and is not blocked (xPyD: its KV is still on the way to the decode worker)."""
        for r in reqs:
            if r.phase == DONE and r.blocked is None:
                self.tracker.remove(r)
                self.rec.finish(r, r.ttft_slo_s, r.tbt_slo_s)
                self.on_finish(r)
                nxt = self._next_turn.pop(r.request_id, None)
                if nxt is not None:  # the session's next turn is sent now (or on time)
                    nxt.arrival_s = nxt.ready_s = max(nxt.arrival_s, self.now)
                    self.push(nxt.arrival_s, ARRIVAL, nxt)
                    self.pending_arrivals += 1

    def _progress(self, run: Run, j0: int, j1: int) -> None:
        """Requests of ``run`` advanced by iterations ``j0+1 .. j1``."""
        sched, rec = run.sched, self.rec
        self.busy_s += sched.end(j1) - sched.end(j0)
        tracker = self.tracker
        decoding = [r for r, c in zip(run.reqs, run.chunks) if c is None]
        if decoding:
            t1 = sched.end(j0 + 1)
            step = t1 - sched.end(j0)
            for r in decoding:
                rec.gap(r, t1, step)
            rec.steps(sched, j0 + 2, j1, decoding)
            for r in decoding:
                tracker.advance_decode(r, j1 - j0)
                if r.generated >= r.output_len:
                    tracker.finish(r)
        t_end = sched.end(j1)
        for i, r in enumerate(run.reqs):
            if run.chunks[i] is None:
                continue
            n = run.tokens_between(i, j0, j1)
            rec.prefill_tokens += n
            if tracker.advance_prefill(r, n):
                rec.first_token(r, t_end)
                if r.output_len == 1:
                    tracker.finish(r)

    # ------------------------------------------------------------- decisions
    def waiting(self) -> list[SimRequest]:
        """Live requests in no run and not blocked: what a decision may schedule."""
        return [r for r in self.tracker.values() if r.run is None and r.blocked is None]

    def free_instances(self) -> list:
        return [i for i in self.instance_ids if i not in self.busy]

    cuts = True  # whether runs may be cut by changes elsewhere (see continues)

    def _update_cuts(self) -> None:
        """Cuts every run whose next decision could differ from its current batch."""
        if not self.cuts or not self.runs:
            return
        waiting = self.waiting()
        idle = self.free_instances()
        sig = (tuple(r.request_id for r in waiting), tuple(idle))
        if sig != self._sig:
            self._sig = sig
            self.state += 1
        for run in list(self.runs):
            if run.state is None:  # decided at this instant: it saw this very state
                run.state = self.state
            elif run.state != self.state and run.k_end > run.plan_from + 1 and \
                    not self.continues(run, waiting, idle):
                self.cut(run, self.now)

    # ----------------------------------------------------------- hooks
    def start(self) -> None:
        """Called once before the first event (timers)."""

    def on_arrival(self, req: SimRequest) -> None:
        """A request arrived (it is in :attr:`tracker`)."""

    def decide(self) -> None:
        """Schedule what can run now."""
        raise NotImplementedError

    def continues(self, run: Run, waiting: list[SimRequest], idle: list) -> bool:
        """Would the policy give ``run``'s batch again at its next boundary?"""
        return not waiting and not idle

    def commit(self, run: Run, j0: int, j1: int) -> None:
        """Iterations ``j0+1 .. j1`` of ``run`` ran (count their cache reads)."""

    def run_done(self, run: Run) -> None:
        """``run`` ended; its requests have advanced."""

    def on_finish(self, req: SimRequest) -> None:
        """``req`` generated its last token."""

    def handle(self, kind: int, obj) -> None:
        raise ValueError(f"unknown event kind {kind}")

    def extra(self) -> dict:
        return {}
