"""The serving loop: requests in, iterations scheduled, tokens out (greedy or sampled).

Each iteration a policy picks the batches: by default the goodput DP
(:class:`scheduler.goodput.GoodputScheduler`), or any :class:`scheduler.api.Policy`
(e.g. :class:`scheduler.baselines.fcfs.FCFS`). The server builds its
:class:`~scheduler.api.Snapshot` every iteration -- waiting and running requests with
their phase, pooled context and remaining prompt, the instances, the pool's cache load
and the latency model -- and runs exactly the batches, phases and DoPs it returns. The
requests' progress, their views and their cache-load inputs come from a
:class:`~tokenlake.generation.tracker.RequestTracker`, the same one the simulator uses; a
waiting request's prompt is matched in the tree once per iteration, and that match is
its view, its cache load and, if admitted, its reused prefix.

New requests reuse whatever prefix the pool holds (whole segments, matched in the
global tree); their sealed segments are published as they fill, so a later turn, or
another request with the same document, prefills only what is new."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from scheduler.admission import admission_order
from scheduler.api import PHASES, InstanceView, Snapshot
from scheduler.goodput import GoodputScheduler
from tokenlake.core.cost_model import LatencyModel
from tokenlake.core.errors import CapacityError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import load_hardware
from tokenlake.engines.compute import ComputeEngine
from tokenlake.generation.live import Live as _Live
from tokenlake.generation.live import one_per_phase, plan_without_waiting, take_out
from tokenlake.generation.recovery import Recovery
from tokenlake.generation.requests import GenerationRequest, RequestResult, check_request
from tokenlake.generation.sampling import next_token
from tokenlake.generation.tier_reads import TierReads
from tokenlake.generation.tracker import DECODE, WAITING, RequestTracker

__all__ = ["GenerationLoop", "one_per_phase"]
log = logging.getLogger(__name__)

#: The measured latency model of the CPU compute engine (``tokenlake profile-latency``).
DEFAULT_LATENCY = "cpu_smollm2-135m"


class GenerationLoop(Recovery):
    """Generation through the pool, scheduled every iteration (continuous batching).

    Args:
        cluster: a running :class:`~tokenlake.deploy.local.LocalCluster`.
        weights: model weights (the compute engine is stateless).
        chunk_tokens: most prompt tokens one request prefills per iteration.
        keep_logits: keep every step's logits in the results (tests compare them).
        on_token: called as ``on_token(request_id, token_id)`` for streaming, after the
            request's result is updated (``done`` and ``finish_reason`` set on its last).
        rebalance_every: run heavy-hitter replication every this many iterations
            (0: never).
        policy: a :class:`scheduler.api.Policy` deciding every iteration's batches,
            phases and DoPs (default: the goodput DP, :class:`scheduler.goodput.
            GoodputScheduler` with ``chunk_tokens``; prefill DoP up to every compute slot
            when the engine computes in parallel, else 1, since one engine computing
            every batch in turn gains nothing from a split; :class:`scheduler.baselines.
            fcfs.FCFS` is first-come-first-served). A prefill batch is trimmed to the cluster's
            ``max_rows`` new tokens (the size of its buffers).
        latency: the policy's :class:`~tokenlake.core.cost_model.LatencyModel` (default: the
            measured CPU model ``cpu_smollm2-135m``); hardware: profile for the cache load.
        tbt_slo_s: every request's time-between-tokens SLO (None: no SLO).
        clock: arrival times and the snapshot's ``now_s``.
        compute_slots: how many batches the policy may run per iteration (the
            instances it sees). Default: one per instance when the engine computes
            batches in parallel (``engine.parallel``: the Ray compute actors, a
            :class:`~tokenlake.engines.compute.ParallelComputeEngine`), else 2 (at most
            the instances): one local :class:`ComputeEngine` computes batches in turn,
            so a prefill and a decode batch share an iteration (a new request does not
            wait for the decodes) and one phase's DoP 1 batches run as one.
        engine: what runs the iterations, anything with ``run(plans, batches) ->
            IterationOutput`` (default: ``cluster.compute_engine()`` when the cluster
            has one that is not None, e.g. a ``RayCluster`` with compute actors, else a
            :class:`~tokenlake.engines.compute.ComputeEngine` in this process).
        control: the control plane to call (default ``cluster.control``; a service
            passes one that serialises its calls with remote clients').
        keep_decisions: how many policy decisions :attr:`decisions` keeps (None: all;
            a long-running service bounds it).
    """

    def __init__(self, cluster, weights, chunk_tokens: int = 512, keep_logits: bool = False,
                 on_token: Callable[[str, int], None] | None = None, rebalance_every: int = 4,
                 policy=None, latency=None, hardware: str = "cpu",
                 tbt_slo_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 engine=None, compute_slots: int | None = None, control=None,
                 keep_decisions: int | None = None) -> None:
        if chunk_tokens > cluster.max_rows:
            raise ValueError(f"chunk_tokens={chunk_tokens} exceeds the cluster's max_rows={cluster.max_rows}")

        self.latency = latency if latency is not None else LatencyModel.load(DEFAULT_LATENCY)
        self.hardware = load_hardware(hardware)
        self.tbt_slo_s = tbt_slo_s
        self.clock = clock
        self.decisions: deque = deque(maxlen=keep_decisions)  # policy decisions, in order
        #: instances the last iteration gave each phase (``Decision.instances_per_phase``)
        self.phase_instances: dict[str, int] = dict.fromkeys(PHASES, 0)
        self.cluster = cluster
        self.control = control if control is not None else cluster.control
        if engine is None and hasattr(cluster, "compute_engine"):
            engine = cluster.compute_engine()
        self.engine = engine if engine is not None else ComputeEngine(weights, cluster)
        self.parallel = getattr(self.engine, "parallel", False)  # batches computed at once
        if compute_slots is None:
            compute_slots = cluster.n_instances if self.parallel else min(2, cluster.n_instances)
        if not 1 <= compute_slots <= cluster.n_instances:
            raise ValueError(f"compute_slots must be in [1, {cluster.n_instances}], got {compute_slots}")
        self.compute_slots = compute_slots
        self._alternate = policy is None and compute_slots == 1 and tbt_slo_s is None  # see snapshot
        self._decoded = False  # the last iteration ran a decode batch
        # One engine computing every batch in turn gains nothing from spreading a prefill
        # over k instances (more messages, the same work); engines that compute at once
        # (one per instance) run a DoP k prefill's k sub-batches in parallel.
        if policy is None:
            policy = GoodputScheduler(chunk_tokens=chunk_tokens, max_prefill_dop=None if self.parallel else 1)
        self.policy = policy
        self.cfg = weights.config
        self.chunk_tokens = chunk_tokens
        self.keep_logits = keep_logits
        self.on_token = on_token
        self.tracker = RequestTracker(chunk_tokens)
        self._decode_at: dict[str, int] = {}  # request -> instance of its last decode batch
        self.decode_moves = 0  # decode steps on another instance than in the iteration before
        self.results: dict[str, RequestResult] = {}
        self.iterations = 0
        self.rebalance_every = rebalance_every
        self.replications = 0
        self._tier_reads = TierReads.of(self)  # promotions: in the background, or layer by layer
        self.admit_limit: int | None = None  # most new admissions per iteration (see step)
        self.admission_patience_s = 30.0  # then a waiting request goes first (scheduler/admission.py)
        self.admission_holds = 0  # iterations skipped because the pool was full
        self.waits_in_flight = 0  # requests that waited for a segment another client stored
        self.prefixes_lost = 0  # new requests whose matched prefix went before admission
        self.in_flight_poll_s = 0.005  # how often an iteration of waiting requests is retried
        self._admitted_now: list[_Live] = []

    #: ``on_error(request_id, message)``: a request failed on its own (see :meth:`_emit`);
    #: its result has ``finish_reason == "error"`` and ``error``. None: nobody is told.
    on_error: Callable[[str, str], None] | None = None

    # ------------------------------------------------------------- requests
    def submit(self, req: GenerationRequest) -> RequestResult:
        """Queues a request; raises :class:`~.requests.BadRequest` without touching anything else."""
        check_request(req, self.cfg, self.results)
        result = RequestResult(req.request_id, req.prompt_ids)
        self.results[req.request_id] = result
        self.tracker.add(_Live(req, result, self.clock(), self.tbt_slo_s))
        return result

    # ------------------------------------------------------------ iterations
    def run(self, requests: Sequence[GenerationRequest] = ()) -> dict[str, RequestResult]:
        """Submits ``requests`` and iterates until every request is done."""
        for r in requests:
            self.submit(r)
        while self.tracker:
            self.step()
        return self.results

    def step(self) -> None:
        """One iteration: the policy's batches, plans, compute, completion.

        If the iteration fails, the requests it admitted go back to waiting (the control
        plane never saw them, or its abort took them back): the tracker and the pool
        agree. A full pool (``CapacityError``) while other requests run skips the
        iteration: tried again with half as many new admissions (cache-first:
        :mod:`scheduler.admission`), and with none once a single one does not fit beside
        the running requests (lifted when one finishes). A tier read it attended that
        failed (``TierReadFailed``) skips it too: planned again without that segment."""
        self._admitted_now = []
        batches, dops, prefilling, homes = self._ask_policy()
        if not batches:
            return
        cp = self.control
        try:
            plans = self._plan(batches, dops, prefilling, homes)
            if plans is None:  # every request waits for segments another client stores:
                time.sleep(self.in_flight_poll_s)  # no signal tells when it is done; poll
                return
            for live in self._admitted_now:  # admitted: a preemption later matches again
                live.lost_hit = False
        except CapacityError:
            new = len(self._admitted_now)
            self._take_back(prefilling)
            if self._tier_reads.drain():  # reads were in flight: their slots are segments now
                return
            running = any(live.admitted for live in self.tracker.values())
            if new == 0 or (new == 1 and not running):
                raise  # nothing to take back, or one request alone that cannot fit now
            self.admit_limit = new // 2
            self.admission_holds += 1
            return
        except BaseException:
            self._take_back(prefilling)
            raise
        out = self._tier_reads.compute(self.engine, plans, batches, lambda: self._take_back(prefilling))
        if out is None:  # a tier read it attended failed: planned again without that segment
            return
        self._decoded = any(b.phase == DECODE for b in batches)
        if self.parallel:  # where each decode batch ran (one engine: nothing to keep)
            last, self._decode_at = self._decode_at, {
                r.request_id: group[0] for b, group in zip(batches, plans.groups)
                if b.phase == DECODE for r in b.requests}
            self.decode_moves += sum(1 for rid, i in self._decode_at.items() if last.get(rid, i) != i)
        self.iterations += 1
        if self.rebalance_every and self.iterations % self.rebalance_every == 0:
            reps = cp.rebalance()  # between iterations: no plan is in flight
            self.cluster.replicate(reps)
            self.replications += len(reps)
        tracker = self.tracker
        for rid, n in prefilling.items():
            tracker.advance_prefill(tracker[rid], n)
        for rid, logits in out.logits.items():
            live = tracker[rid]
            if rid not in prefilling:
                tracker.advance_decode(live)
            elif live.phase != DECODE:
                continue  # a prefill chunk that is not the prompt's last
            self._emit(live, logits)

    def _plan(self, batches: list[Batch], dops: list[int], prefilling: dict[str, int],
              homes: list[int | None] | None):
        """``gen_plans`` of the policy's batches (a decode batch the policy keeps on its
        instance pinned there, ``homes``), the requests that must wait for a segment
        another client is storing taken out (:func:`plan_without_waiting`)."""

        def defer(waiting: set[str], lost: bool) -> None:
            if lost:  # their hit went since the match: computed whole next time
                self.prefixes_lost += len(waiting)
                log.warning("requests %s: their matched prefix went before admission; "
                            "computed without a hit", sorted(waiting))
            else:
                self.waits_in_flight += len(waiting)
            take_out(self.tracker, self._admitted_now, waiting, prefilling, lost)

        return plan_without_waiting(self.control, batches, dops, defer, homes, self._tier_reads.promoting())

    def _take_back(self, prefilling: dict[str, int]) -> None:
        """The iteration did not run: its admissions back to waiting, every chunk's count undone."""
        take_out(self.tracker, self._admitted_now,
                 {a.req.request_id for a in self._admitted_now} | prefilling.keys(), prefilling)

    # ------------------------------------------------------------ policies
    def snapshot(self):
        """The :class:`scheduler.api.Snapshot` the policy decides on this iteration.

        Every waiting request's prompt is matched here, once, under its cache salt (one
        whose segments are being read back from a tier is left out); the tracker keeps
        the hit for its view, its cache load and its admission. With one compute slot,
        the default policy and no TBT SLO the phases take turns: after an iteration that
        decoded, the decodes sit out one while a request waits or prefills (the DP alone
        runs no prefill while anything decodes: a new request would wait for them all)."""
        tracker, tree = self.tracker, self.control.get_prefix_tree()
        reading = self._tier_reads.for_snapshot(tracker)
        for live in tracker.waiting():
            if live.request_id not in reading:  # the last token is always computed (its logits)
                m = self._tier_reads.match(tree, live)
                tracker.set_hit(live, 0 if live.lost_hit else m.hit_tokens)
        waiting, running = tracker.views()
        waiting = tuple(v for v in waiting if v.request_id not in reading)
        if self._decode_at:  # where each decode batch ran last (scheduler/keep.py)
            at = self._decode_at
            running = tuple(replace(v, decode_instance=at[v.request_id])
                            if v.request_id in at and at[v.request_id] < self.compute_slots else v
                            for v in running)
        if self.admit_limit is not None:  # the pool was full: admit fewer, cache-first
            late = self.clock() - self.admission_patience_s
            waiting = tuple(admission_order(waiting, lambda v: v.context_tokens,
                                            lambda v: v.arrival_s < late))[: self.admit_limit]
        if self._alternate and self._decoded and any(v.phase == "prefill" for v in (*waiting, *running)):
            # prefill's turn: the decodes sit out this attempt (once: if nothing runs, theirs is next)
            running, self._decoded = tuple(v for v in running if v.phase != "decode"), False
        load = tracker.cache_load(tracker.values(), self.cluster.n_instances,
                                  self.control.model, self.hardware, self.latency)
        instances = tuple(InstanceView(i) for i in range(self.compute_slots))
        return Snapshot(self.clock(), waiting, running, instances, min(load, 0.99), self.latency)

    def _ask_policy(self) -> tuple[list[Batch], list[int], dict[str, int], list[int | None] | None]:
        """The policy's batches for this iteration, trimmed to the buffers, the prompt
        tokens each prefilling request computes in them, and the instance each batch is
        pinned to (engines computing in parallel: a decode batch kept where it ran; else None)."""
        snap = self.snapshot()
        if not snap.requests:
            self.phase_instances = dict.fromkeys(PHASES, 0)
            return [], [], {}, None
        decision = self.policy.schedule(snap)
        decision.check(snap)
        self.phase_instances = decision.instances_per_phase
        if not decision.batches:
            raise RuntimeError(f"policy {self.policy.name!r} scheduled nothing for "
                               f"{len(snap.requests)} requests on free instances ({decision.note})")
        self.decisions.append(decision)
        batches, dops, prefilling, homes = [], [], {}, []
        for b in decision.batches if self.parallel else one_per_phase(decision.batches):
            reqs: list[BatchRequest] = []
            rows = 0  # a sub-batch's rows must fit the instance buffers: keep the batch within
            for rid, n in zip(b.request_ids, b.new_tokens):
                n = min(n, self.cluster.max_rows - rows)
                if n < 1:
                    continue  # the batch is full: this request waits for the next iteration
                live = self.tracker[rid]
                if b.phase == "decode":
                    reqs.append(BatchRequest(rid, (live.result.output_ids[-1],)))
                else:
                    reqs.append(self._chunk(live, n))
                    prefilling[rid] = len(reqs[-1].new_token_ids)
                rows += len(reqs[-1].new_token_ids)
            if reqs:
                batches.append(Batch(tuple(reqs), b.phase))
                dops.append(b.dop)
                homes.append(b.instance if self.parallel else None)
        return batches, dops, prefilling, homes if any(h is not None for h in homes) else None

    def _chunk(self, live: _Live, tokens: int) -> BatchRequest:
        """The next ``tokens`` prompt tokens of ``live``, admitting it (with the hit kept
        from this iteration's match, under its cache salt) if it waits."""
        prompt = live.prompt
        prefix: tuple[int, ...] = ()
        if live.phase == WAITING:
            hit = self.tracker.admit(live)
            self._admitted_now.append(live)
            prefix = prompt[:hit]
            if not live.preemptions:  # the client's cached tokens: its prompt's first match
                live.result.hit_tokens = hit
        new = prompt[live.prefilled : live.prefilled + tokens]
        live.result.prefill_tokens += len(new)
        return BatchRequest(live.req.request_id, new, prefix, live.req.cache_salt)

    def _emit(self, live: _Live, logits: torch.Tensor) -> None:
        """``live``'s next token from its last-row ``logits``: chosen, checked, recorded,
        the request retired on a stop id or its length, the client told. Never raises for
        a fault of this request alone (its sampling, a token outside the vocabulary, its
        stop check, its ``on_token``): that request ends with ``finish_reason == "error"``
        (:meth:`_fail`) and the iteration goes on for the others."""
        req, res = live.req, live.result
        try:
            token = next_token(logits, req.sampling, live.generator)
            if not 0 <= token < self.cfg.vocab_size:  # its next decode would fail the batch
                raise ValueError(f"sampled token {token} is outside the vocabulary "
                                 f"[0, {self.cfg.vocab_size})")
            res.output_ids.append(token)
            if self.keep_logits:
                res.logits.append(logits.clone())
            if token in req.stop_ids or len(res.output_ids) >= req.max_new_tokens:
                self._retire(live, "stop" if token in req.stop_ids else "length")
            if self.on_token is not None:
                self.on_token(res.request_id, token)
        except Exception as e:
            self._fail(live, e)

    def _fail(self, live: _Live, error: Exception) -> None:
        """``live`` failed on its own: it is retired (leases and tail back to the pool)
        with ``finish_reason == "error"`` and ``result.error`` naming the fault, and
        :attr:`on_error` is told. Nothing else changes."""
        res = live.result
        res.error = f"{type(error).__name__}: {error}"
        if not res.done:
            self._retire(live, "error")
        res.finish_reason = "error"
        if self.on_error is not None:
            self.on_error(res.request_id, res.error)

    def _retire(self, live: _Live, reason: str) -> None:
        """``live`` is done: out of the tracker, its leases and tail back to the pool."""
        live.result.done, live.result.finish_reason = True, reason
        self.admit_limit = None  # its slots are free: admit freely again
        admitted = live.phase != WAITING  # the control plane knows it once admitted
        if live.phase == DECODE:
            self.tracker.finish(live)
        self.tracker.remove(live)
        if admitted and live.req.request_id in self.control.live_requests:
            # (a request admitted in an iteration whose gen_plans failed is unknown there)
            self.control.finish_request(live.req.request_id)

    # ------------------------------------------------------------ service
    @property
    def promotions(self) -> int:
        """Segments read back from a tier for waiting requests."""
        return self._tier_reads.promoted

    @property
    def tier_reads(self) -> TierReads:
        """The loop's promotions (``layered``: overlap them with the request's iteration)."""
        return self._tier_reads

    @property
    def busy(self) -> bool:
        """True while a request is live, or a read of a tier (``step`` has work)."""
        return bool(self.tracker) or bool(self._tier_reads.reading())

    def counts(self) -> tuple[int, int]:
        """``(waiting, running)`` requests: not admitted yet, and admitted."""
        return (waiting := sum(1 for _ in self.tracker.waiting())), len(self.tracker) - waiting

    def cancel(self, request_id: str) -> bool:
        """Stops a live request between iterations (its client went away): its prefix
        leases and open tail go back to the pool at once, ``finish_reason`` is
        ``"abort"``. Returns False if it is not live (unknown or already done)."""
        live = self.tracker.get(request_id)
        if live is None:
            return False
        self._retire(live, "abort")
        return True

    def pop_result(self, request_id: str) -> RequestResult | None:
        """Forgets a done request's result (a long-running service keeps none)."""
        res = self.results.get(request_id)
        return self.results.pop(request_id) if res is not None and res.done else None
