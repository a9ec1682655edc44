"""TokenLake simulated on the real control plane and the real goodput scheduler.

Everything about the cache is the real code: one :class:`~tokenlake.core.control.ControlPlane`
for the cluster (global prefix tree, hash placement, LRU eviction, heavy-hitter
replication via ``rebalance``), and the policy is
:class:`~scheduler.goodput.GoodputScheduler` (``tokenlake``) or
:class:`~scheduler.baselines.fixed_pd.FixedPD` around it (``tokenlake-1p3d/3p1d``).
Only time is modelled (:mod:`evals.sim.timing`); how plans are made is in
:mod:`evals.sim.pool_plans`.

**Global decisions, asynchronous execution.** The goodput DP batches *all* requests
over *all* N instances (paper §6.2), so it is asked at every change: an arrival that
can be admitted, a request finishing its prompt or its output. A running batch that the
DP gives again goes on undisturbed; every other one stops at the end of its current
iteration, and the DP's new batches start, each on its instances, as soon as those
instances and its requests are done with that iteration (a decode batch usually stays on
its instance and goes on without a gap). Between
changes every batch iterates at its own pace: a decode batch is not held up by a
prefill chunk elsewhere (PD disaggregation). Between two decisions only the requests'
lengths grow (the DP would re-sort by them; see docs/simulator.md).

Admission: the DP has no memory model, so new requests are admitted while the pool can
hold their prompt and output next to those already admitted (as SGLang reserves
memory), cache-first (:mod:`scheduler.admission`) or first come first served.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

from evals.sim import placement
from evals.sim.backend import Backend, Run, SimRequest, SimulationError
from evals.sim.phases import PhaseLog
from evals.sim.pool_plans import PoolPlanner
from evals.sim.run_timing import RunTiming
from evals.sim.trace import prompt_array
from scheduler.admission import admission_order, waits_for_flight
from scheduler.api import BatchDecision, InstanceView, RequestView, Snapshot
from scheduler.latency import slowdown
from tokenlake.core.config import PoolConfig
from tokenlake.core.control import ControlPlane
from tokenlake.core.errors import CapacityError

REBALANCE, REPLICATED, DECIDE = 10, 11, 12


class PooledBackend(Backend):
    """TokenLake: pooled cache, one instance per GPU, any :class:`scheduler.api.Policy`."""

    cuts = False  # every run is stopped at each decision instead

    def __init__(self, setup, system: str, policy) -> None:
        chunk = getattr(getattr(policy, "inner", policy), "chunk_tokens", setup.config.chunk_tokens)
        super().__init__(setup, system, range(setup.instances), chunk_tokens=chunk)
        cfg = self.config
        pool = PoolConfig(setup.segment_tokens, f"{setup.model.name}/sim", setup.slots_per_instance,
                          seed=cfg.seed, page_tokens=cfg.page_tokens,
                          home_eviction=cfg.home_eviction,
                          eviction_choices=cfg.eviction_choices, tier_slots=setup.tier_slots)
        self.cp = ControlPlane(pool, setup.model, list(self.instance_ids),
                               clock=lambda: self.now, rng=random.Random(cfg.seed))
        self.tree = self.cp.get_prefix_tree()
        if self.cp.pool.tier is not None:  # GPUs of one node: a copy is read into any of them
            self.cp.pool.tier.promote_anywhere = True
        self.c = setup.segment_tokens
        self.policy = policy
        self.fixed = policy if hasattr(policy, "allowed_instances") else None
        self.chunk = chunk
        self.cap = setup.instances * setup.slots_per_instance * self.c  # pool, KV tokens
        self.replicating = self._reserved = 0
        self._reservations = 0  # reserve() calls so far (admissions taken or given back)
        self._shared: dict[bytes, int] = {}  # reused prefix segments -> admitted users
        self.blocked: set[SimRequest] = set()  # waiting for a request to finish (memory)
        self.free_at = dict.fromkeys(self.instance_ids, 0.0)
        self.planner = PoolPlanner(self)
        self.timing = RunTiming(self)
        self._decide_at, self._version = None, 0
        self._last: tuple = (None, ())  # the last decision's requests and batches
        self.reused_decisions = 0
        self.decode_moves = 0  # decode steps on another instance than the step before
        self.phases = PhaseLog()  # the instances each decision gave each phase
        import scipy.optimize  # noqa: F401  (dispatch imports it lazily; keep it out of the timing)

    # -------------------------------------------------------------- events
    def start(self) -> None:
        self.push(self.config.rebalance_s, REBALANCE, None)

    def on_arrival(self, req: SimRequest) -> None:
        if req.prompt_len + req.output_len + self.c > self.cap:
            raise SimulationError(f"request {req.request_id} needs {req.prompt_len + req.output_len} "
                                  f"KV tokens; the pool holds {self.cap}")
        req.tokens = prompt_array(req.source)
        req.keys = self.tree.hasher.keys(req.tokens[: req.prompt_len // self.c * self.c])
        if len(self.tracker.waiting()) == 1:  # first in line: it may be admitted now
            self._request_decision(self.now)

    def _request_decision(self, t: float) -> None:
        if self._decide_at is None or t < self._decide_at:
            self._decide_at, self._version = t, self._version + 1
            self.push(t, DECIDE, None, self._version)

    def handle(self, kind: int, obj) -> None:
        if kind == DECIDE:
            return  # the engine's loop calls decide() right after
        if kind == REPLICATED:
            self.cp.finish_replication(obj)
            self.replicating -= 1
            return
        if not (self.tracker or self.pending_arrivals or self.replicating):
            return  # nothing left: let the loop end
        if self.tracker and not (self.runs or self.pending_arrivals or self._decide_at is not None):
            raise SimulationError(f"{len(self.tracker)} requests wait and nothing runs: the pool "
                                  "is too small for them")
        hw, seg = self.setup.hardware, self.setup.model.segment_bytes(self.c)
        for rep in self.cp.rebalance():
            self.replicating += 1
            self.push(self.now + 2 * hw.net_latency_s + seg / hw.net_bw, REPLICATED, rep)
        self.push(self.now + self.config.rebalance_s, REBALANCE, None)

    def on_finish(self, req: SimRequest) -> None:
        self.cp.finish_request(req.request_id)
        self.reserve(req, -1)
        self.planner.forget(req)
        self.timing.forget(req)
        req.tokens = req.keys = None
        for r in self.blocked:
            r.blocked = None
        self.blocked.clear()

    # ----------------------------------------------------------- decisions
    def decide(self) -> None:
        if self._decide_at is None or self.now < self._decide_at:
            return
        self._decide_at = None
        for run in list(self.runs):  # runs in (or done with) their last iteration
            if self.now >= run.sched.t0 and run.sched.first_end_at_or_after(self.now) >= run.k_end:
                self._stop(run)
        fresh = [r for r in self.tracker.running() if r.phase == "decode" and r.aux != "decoding"
                 and r.blocked is None]
        for r in self.planner.plan_decodes(fresh):
            self._block(r)
        while True:
            vis = self._admissible()
            if not vis:
                if self.tracker and not self.pending_arrivals:
                    raise SimulationError("every live request waits for pool capacity and "
                                          "nothing runs: the pool is too small for them")
                return
            load = self.cache_load(vis)
            sig = tuple((r.request_id, r.phase) for r in vis)
            if sig == self._last[0]:  # same requests, same phases: only lengths grew
                batches = self._last[1]
                self.reused_decisions += 1
            else:
                snap = self.snapshot(vis, load)
                decision = self.policy.schedule(snap)
                self.scheduler_calls += 1
                decision.check(snap)
                batches = decision.batches
                self._last = (sig, batches)
                self.phases.record(self.now, decision.instances_per_phase)
            if self._launch(batches, slowdown(load) if self.config.pool_slowdown else 1.0):
                return

    def cache_load(self, vis: list[SimRequest]) -> float:
        """The pool's cache load while ``vis`` run (the tracker's inputs, paper §6.1)."""
        s = self.setup
        return self.tracker.cache_load(vis, s.instances, s.model, s.hardware, self.lat)

    def snapshot(self, vis: list[SimRequest], load: float) -> Snapshot:
        """What the policy decides on: ``vis`` (waiting ones first), all instances."""
        return Snapshot(self.now, tuple(self._view(r) for r in vis if not r.admitted),
                        tuple(self._view(r) for r in vis if r.admitted),
                        tuple(InstanceView(i) for i in self.instance_ids), load, self.lat)

    def _view(self, r: SimRequest) -> RequestView:
        """The tracker's view of ``r`` and, in decode, the instance of its decode batch."""
        view = self.tracker.view(r)
        if view.phase != "decode":
            return view
        at = r.run.group[0] if r.run is not None and r.run.phase == "decode" else r.decode_at
        return view if at is None else replace(view, decode_instance=at)

    def _stop(self, run: Run) -> None:
        """Ends ``run`` after its current iteration (at once if it has not started)."""
        t = self.now
        self.runs.discard(run)
        for inst in run.group:
            self.busy.pop(inst, None)
        for r in run.reqs:
            r.run = None
        if t < run.sched.t0:
            self.timing.stop(run)
            return  # never started: requests and instances are as they were
        k = max(min(run.sched.first_end_at_or_after(t), run.k_end), run.plan_from)
        self._advance(run, k)
        self.timing.stop(run)
        end = run.sched.end(k)
        for r in run.reqs:
            r.ready_s, r.worker = end, run.group[0]
            if run.phase == "decode":
                self.decode_moves += r.decode_at is not None and r.decode_at != run.group[0]
                r.decode_at = run.group[0]
        for inst in run.group:
            self.free_at[inst] = end
        self.planner.finish_prefills(run)
        self.finish_done(run.reqs)

    def _advance(self, run: Run, k: int) -> None:
        """The requests of ``run`` have done its iterations up to ``k``."""
        if k > run.plan_from:
            self.timing.charge(run, run.plan_from, k)
            self.planner.commit(run, run.plan_from, k)
            self.iterations += k - run.plan_from
            self._progress(run, run.plan_from, k)
            run.plan_from = k

    def checkpoint(self, run: Run) -> None:
        """Brings the requests of a running ``run`` up to the iterations done by now."""
        if run in self.runs and self.now >= run.sched.t0:
            self._advance(run, min(run.sched.steps_done_by(self.now), run.k_end - 1))

    def _block(self, r: SimRequest) -> None:
        r.blocked = "capacity"
        self.blocked.add(r)

    def _admissible(self) -> list[SimRequest]:
        """Admitted requests plus new ones the pool can hold, offered admission in the
        order of ``config.admission`` (:mod:`scheduler.admission`: cache-first by
        default, or first come first served); a cache-first request whose next segment
        is being computed waits for it. As SGLang reserves memory: a request holds its
        uncached prompt, its output and one open tail; reused prefixes count once however many requests share them.
        Admission stops at the first request that does not fit, as SGLang's scheduler
        stops adding waiting requests to a batch, and as the baselines' workers do
        (``evals/sim/unpooled.py``, ``evals/sim/xpyd.py``).

        Finding a request's hit can settle another request's plan (it computed segments
        this one reuses), and a settle can take an admission back or admit again; the
        count then starts over on the new state (each settle makes segments visible, so
        this ends)."""
        rule = self.config.admission
        while True:
            version = self._reservations
            held = self._reserved + len(self._shared) * self.c
            out = [r for r in self.tracker.running() if r.blocked is None]
            ready = {r: self._ready_prefix(r) for r in self.tracker.waiting() if r.blocked is None}
            claimed: set[bytes] = set()  # segments the requests admitted here will compute
            for r in admission_order(ready, ready.__getitem__, self._overdue, rule):
                if held + self._need(r, ready[r]) > self.cap:
                    return out
                # One walk of the prompt's segments: ready_hit goes on where _ready_prefix
                # stopped. The hit is kept: its view, its load and its admission use it.
                self.tracker.set_hit(r, self.planner.ready_hit(r, ready[r] // self.c))
                if self._reservations != version:
                    break  # a settle changed the admissions (and the queue): count again
                n = r.hit // self.c
                if waits_for_flight(r.keys[n] if n < len(r.keys) else None,
                                    (self.planner.pending, claimed), self._overdue(r), rule):
                    continue  # it hits that segment once stored (scheduler/admission.py)
                claimed.update(r.keys[n:])
                held += self._need(r, r.hit)
                out.append(r)
            else:
                return out

    def _overdue(self, r: SimRequest) -> bool:
        return self.now - r.arrival_s > self.config.admission_patience * r.ttft_slo_s

    def _need(self, r: SimRequest, hit: int) -> int:
        fresh = sum(1 for k in r.keys[: hit // self.c] if k not in self._shared)
        return r.prompt_len - hit + r.output_len + self.c + fresh * self.c

    def _ready_prefix(self, r: SimRequest) -> int:
        cap = min((r.prompt_len - 1) // self.c, len(r.keys))
        n, tree = 0, self.tree
        while n < cap and r.keys[n] in tree and tree.is_ready(r.keys[n]):
            n += 1
        return n * self.c

    def admit(self, r: SimRequest) -> None:
        """Admits the waiting ``r`` with its kept hit and reserves its memory."""
        self.tracker.admit(r)
        self.reserve(r, 1)

    def take_back(self, r: SimRequest) -> None:
        """Takes back the admission of ``r``, which computed nothing since: it waits
        again at its place in arrival order."""
        self.reserve(r, -1)
        self.tracker.requeue(r)

    def reserve(self, r: SimRequest, sign: int) -> None:
        """Adds (sign=1, at admission) or removes (-1, at finish, or when a settle takes
        an admission back) ``r``'s reservation."""
        self._reservations += 1
        self._reserved += sign * (r.prompt_len - r.hit + r.output_len + self.c)
        for k in r.keys[: r.hit // self.c]:
            n = self._shared.get(k, 0) + sign
            if n:
                self._shared[k] = n
            else:
                del self._shared[k]

    # ---------------------------------------------------------------- runs
    def _launch(self, batches: tuple[BatchDecision, ...], slow: float) -> bool:
        """Starts the decision's batches; False if new requests had to wait for memory.

        A running batch the decision gives again (same requests, phase, DoP) goes on
        undisturbed; every other running batch stops after its current iteration.
        """
        running = {(tuple(r.request_id for r in run.reqs), run.phase, run.dop): run for run in self.runs}
        kept, fresh = [], []
        for b in batches:
            run = running.get((b.request_ids, b.phase, b.dop))
            (kept if run is not None else fresh).append(run if run is not None else b)
        for run in [run for run in self.runs if run not in kept]:
            self._stop(run)
        batches = tuple(fresh)
        # A stopped batch may have finished a prompt or an output in its last iteration:
        # such requests leave the new batches and are seen by the next decision.
        batches = tuple(b for b in batches if all(
            (r := self.tracker.get(rid)) is not None and (r.phase == "decode") == (b.phase == "decode")
            for rid in b.request_ids))
        changed = [r for b in fresh for rid in b.request_ids
                   if (r := self.tracker.get(rid)) is None or r.phase == "decode" and b.phase != "decode"]
        if changed:
            self._request_decision(self.now)
        batches = self._without_prefilling(batches)
        taken = {i for run in kept for i in run.group}
        runs = [self._decode_run([self.tracker[rid] for rid in b.request_ids]) if b.phase == "decode"
                else self._prefill_run([self.tracker[rid] for rid in b.request_ids], b.dop)
                for b in batches]
        try:
            self.planner.prepare(runs, kept)
        except CapacityError:
            new = [r for run in runs for r in run.reqs if not r.admitted]
            if not new:
                raise SimulationError("the pool cannot hold the running requests' new "
                                      "tokens; give it more cache_gb") from None
            for r in new:
                self._block(r)
            return False
        # The plans exist now: where each request's prefix is read is known.
        groups = (placement.fixed_split(self, batches, taken) if self.fixed
                  else placement.kept_or_dispatched(self, batches, runs, taken))
        starts = []
        for run, group in zip(runs, groups):
            run.group = group
            starts.append(max([self.now] + [self.free_at[i] for i in group] + [r.ready_s for r in run.reqs]))
        self.timing.time(runs, starts, slow)
        for run in runs:
            self.runs.add(run)
            for inst in run.group:
                self.busy[inst] = run
            for r in run.reqs:
                r.run = run
        if self.runs:  # decide again when the first run ends by itself
            t = min((run.sched.end(run.k_end) for run in self.runs if run.phase == "decode"),
                    default=math.inf)
            for run in self.runs:
                if run.phase == "prefill":
                    end = run.sched.end_if_before(run.k_end, t)
                    t = t if end is None else end
            self._request_decision(t)
        return True

    def _without_prefilling(self, batches: tuple[BatchDecision, ...]) -> tuple[BatchDecision, ...]:
        """``batches`` less the decode-batch members whose last prompt chunk is still
        computing (its first token comes later): the batch does not wait for them; a
        decision follows when the first of them is out."""
        late = {rid: r.first_token_s for b in batches if b.phase == "decode"
                for rid in b.request_ids if (r := self.tracker[rid]).first_token_s > self.now}
        if late:
            self._request_decision(min(late.values()))
        keeps = [[n for n, rid in enumerate(b.request_ids) if rid not in late] for b in batches]
        return tuple(b if len(k) == len(b.request_ids) else replace(
            b, request_ids=tuple(b.request_ids[n] for n in k), new_tokens=tuple(b.new_tokens[n] for n in k))
            for b, k in zip(batches, keeps) if k)

    def _decode_run(self, reqs) -> Run:
        """Steps until the first request of the batch is done (placed and timed by
        :meth:`_launch` once the plans exist)."""
        k = min(r.output_len - r.generated for r in reqs)
        return Run(reqs, "decode", (), 1, None, k)

    def _prefill_run(self, reqs, dop: int) -> Run:
        """Chunks until the first prompt of the batch is complete."""
        chunk = self.chunk
        done = [r.context for r in reqs]  # prompt tokens cached (hit while waiting)
        k = min(-(-(r.prompt_len - d) // chunk) for r, d in zip(reqs, done))
        chunks = [[min(chunk, r.prompt_len - d - j * chunk) for j in range(k)]
                  for r, d in zip(reqs, done)]
        return Run(reqs, "prefill", (), dop, None, k, chunks)

    def extra(self) -> dict:
        st = self.cp.stats()
        busy = self.timing.load.busy_s
        return {"control_plane_hit_rate": st.hit_rate, "evictions": st.pool.evictions,
                "placed_at_home": st.pool.placed_at_home / max(st.pool.placed, 1),
                "replications": st.pool.replications, "segments": st.pool.segments,
                "dedup_segments": st.pool.dedup_segments, "segment_tokens": self.c,
                "plan_settles": self.planner.settles, "reused_decisions": self.reused_decisions,
                "decode_moves": self.decode_moves,
                "instances_per_phase": self.phases.summary(self.now, self.setup.instances),
                "phase_timeline": self.phases.series(),
                "slots_per_instance": self.setup.slots_per_instance, "chunk_tokens": self.chunk,
                "query_busy_s": [busy[i] for i in self.instance_ids],
                "tier": None if st.pool.tier is None else {
                    "slots_per_instance": self.setup.tier_slots, "promoted": self.planner.promoted,
                    "promote_s": self.planner.promote_s, "demotions": st.pool.tier.demotions,
                    "dropped": st.pool.tier.dropped}}
