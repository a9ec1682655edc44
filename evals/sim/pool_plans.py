"""How the TokenLake backend calls the control plane: plans, settles, access counts.

Every admitted request advances by one chunk (prefill) or one token (decode) per
iteration of whatever batch the DP puts it in (the DP batches every request it sees
when N >= 2), so what a request adds to the pool is known ahead:

* a **decode** request is planned once for all its output (``gen_plans`` + ``complete``
  at once): its generated segments are private to it, nobody can hit or share them;
* a **prefill** request is planned once for its whole remaining prompt (a
  :class:`PrefillPlan`, in flight) and the plan is *settled* -- aborted and re-made as
  the part done by now (completed) plus the rest (in flight) -- whenever the exact state
  of the pool matters: another request looks up or shares one of its pending segments
  (requests sharing pending segments are then planned together, in one flight, as
  ``gen_plans`` requires), its prompt is complete, or the DP did not schedule it.

So every decision sees the segments stored so far, as single iterations would show it.
Reads per iteration (for the CV and for the pool's access window, which
``gen_plans`` feeds only once per call) come from the plans' query tasks plus the
segments a prefill request stored since its plan was made (at their hash homes).
"""

from __future__ import annotations

from evals.sim.backend import Run, SimRequest
from evals.sim.trace import decode_tokens
from tokenlake.core.errors import CapacityError
from tokenlake.core.plans import Batch, BatchRequest, Plans


def plan_reads(plans: Plans) -> dict[str, dict[int, int]]:
    """Per request: KV tokens each instance serves it in one iteration of ``plans``."""
    out: dict[str, dict[int, int]] = {}
    for qp in plans.query_plans:
        for task in qp.tasks + qp.tails:
            for it in task.items:
                vec = out.setdefault(it.request_id, {})
                vec[task.instance] = vec.get(task.instance, 0) + sum(it.tokens)
    return out


def plan_slots(plans: Plans) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """Per request: ``(instance, slot, tokens)`` of every sealed segment it reads in
    ``plans`` (open tails are its own, never read by another request)."""
    out: dict[str, list] = {}
    for qp in plans.query_plans:
        for task in qp.tasks:
            for it in task.items:
                out.setdefault(it.request_id, []).extend(
                    (task.instance, s, n) for s, n in zip(it.slots, it.tokens))
    return {rid: tuple(v) for rid, v in out.items()}


class PrefillPlan:
    """An in-flight ``gen_plans`` of the rest of some prompts (one flight)."""

    __slots__ = ("plans", "members", "start", "admits", "keys")

    def __init__(self, plans, members, start, admits, keys) -> None:
        self.plans, self.members, self.start = plans, members, start
        self.admits, self.keys = admits, keys  # requests it admitted; keys it stores


class PoolPlanner:
    def __init__(self, backend) -> None:
        self.b = backend
        self.cp, self.tree = backend.cp, backend.tree
        self.c = backend.setup.segment_tokens
        self.pending: dict[bytes, PrefillPlan] = {}  # segment being stored -> its plan
        self.reads: dict[str, dict[int, int]] = {}  # per request, one iteration's reads
        self.slots: dict[str, tuple] = {}  # per decoding request, its sealed segments' slots
        self.grown: dict[str, dict[int, int]] = {}  # stored since its plan, per instance
        self.settles = 0
        self.tier = backend.cp.pool.tier  # the disk tier's bookkeeping (None: no tier)
        self.promoted, self.promote_s = 0, 0.0  # segments promoted, and their read seconds

    # ------------------------------------------------------------ decode
    def plan_decodes(self, reqs: list[SimRequest]) -> list[SimRequest]:
        """Plans and completes all output tokens of ``reqs``; returns those that did not
        fit the pool (they wait for a request to finish)."""
        if not reqs:
            return []
        try:
            self._plan_decodes(reqs)
            return []
        except CapacityError:
            pass
        failed = []
        for r in reqs:  # one by one: as many as fit
            try:
                self._plan_decodes([r])
            except CapacityError:
                failed.append(r)
        return failed

    def _plan_decodes(self, reqs: list[SimRequest]) -> None:
        batch = Batch(tuple(BatchRequest(r.request_id, decode_tokens(
            r.idx, r.generated, r.output_len - r.generated)) for r in reqs), "decode")
        plans = self.cp.gen_plans([batch], [1])
        self.b.plan_calls += 1
        self.cp.complete(plans)
        reads = plan_reads(plans)
        slots = plan_slots(plans) if self.b.config.grouped_reads else {}
        for r in reqs:
            r.aux = "decoding"
            self.reads[r.request_id] = reads.get(r.request_id, {})
            self.slots[r.request_id] = slots.get(r.request_id, ())
            self.grown.pop(r.request_id, None)

    # ----------------------------------------------------------- prefill
    def plan_prefill(self, reqs: list[SimRequest]) -> None:
        """One flight for the rest of these prompts (admitting new requests)."""
        batch, admits, c = [], [], self.c
        for r in reqs:
            start = r.context  # prompt tokens cached: its hit if it waits
            if r.admitted:
                batch.append(BatchRequest(r.request_id, r.tokens[start:]))
            else:
                held = self.tree.match(r.tokens[: r.hit]).hit_tokens
                if held < r.hit:
                    # Part of its hit was evicted since it was found (a settle of the same
                    # decision stored segments first): it computes those tokens too (its
                    # run, made for the larger hit, ends short; the next run does the rest).
                    self.b.tracker.set_hit(r, held)
                    start = r.context
                batch.append(BatchRequest(r.request_id, r.tokens[start:], r.tokens[:r.hit]))
                admits.append(r)
        plans = self._gen(batch)
        for r in admits:
            self.b.admit(r)
        tree = self.tree
        keys = [k for r in reqs for k in r.keys[r.prefilled // c:] if not tree.is_ready(k)]
        plan = PrefillPlan(plans, list(reqs), {r.request_id: r.prefilled for r in reqs}, admits, keys)
        reads = plan_reads(plans)
        for r in reqs:
            r.aux = plan
            self.reads[r.request_id] = reads.get(r.request_id, {})
            self.grown[r.request_id] = {}
        for k in keys:
            self.pending[k] = plan

    def _gen(self, batch: list[BatchRequest]) -> Plans:
        try:
            return self.cp.gen_plans([Batch(tuple(batch), "prefill")], [1])
        finally:
            self.b.plan_calls += 1

    def settle(self, plans: list[PrefillPlan], keep=lambda r: True,
               extra: list[SimRequest] = ()) -> None:
        """Completes what the requests of ``plans`` computed so far, then plans in one
        flight the rest of those ``keep`` accepts, plus ``extra``. Requests a plan had
        admitted that made no progress and are not kept become waiting ones again."""
        members = [r for p in plans for r in p.members]
        for run in {id(r.run): r.run for r in members if r.run is not None}.values():
            self.b.checkpoint(run)  # progress up to now
        if all(r.prefilled >= r.prompt_len for r in members) and not extra:
            for p in plans:  # every prompt is complete: the plans ran as made
                self.cp.complete(p.plans)
                for k in p.keys:
                    if self.pending.get(k) is p:
                        del self.pending[k]
            for r in members:
                r.aux = None
            return
        admits = [r for p in plans for r in p.admits]
        held = [k for r in admits for k in r.keys[: r.hit // self.c]]
        for r in admits:  # a page hit's segment too: the abort releases it
            pkey = self.tree.match(r.tokens[: r.hit]).partial_key if r.hit % self.c else None
            if pkey is not None:
                held.append(pkey)
        self.tree.lease(held)  # keep admitted prefixes cached across the abort
        try:
            for p in plans:
                self.cp.abort(p.plans)
                for k in p.keys:
                    if self.pending.get(k) is p:
                        del self.pending[k]
            unknown = {id(r) for r in admits}  # the control plane forgot them with the abort
            start = {r.request_id: p.start[r.request_id] for p in plans for r in p.members}
            done = [r for r in members if r.prefilled > start[r.request_id]]
            if done:
                batch = [BatchRequest(r.request_id, r.tokens[start[r.request_id]:r.prefilled],
                                      r.tokens[:r.hit] if id(r) in unknown else ()) for r in done]
                self.cp.complete(self._gen(batch))
                unknown.difference_update(id(r) for r in done)
            for r in members:
                r.aux = None
            rest = [r for r in members if r.prefilled < r.prompt_len and keep(r)]
            for r in admits:
                if id(r) in unknown:  # computed nothing: plan_prefill admits it again if kept
                    self.b.take_back(r)
            again = list({id(r): r for r in rest + list(extra)}.values())
            self.settles += 1
            if again:
                self.plan_prefill(again)
        finally:
            self.tree.unlease(held)

    def ready_hit(self, r: SimRequest, start: int = 0) -> int:
        """Prompt tokens the pool holds ready for ``r`` (whole segments, then the whole
        pages of the next segment that a ready one starts with; at least one token left
        to compute), settling plans that already computed the next whole segments.
        ``start``: segments already known to be ready (the walk goes on from there)."""
        cap = min((r.prompt_len - 1) // self.c, len(r.keys))
        n, tree = start, self.tree
        while n < cap:
            key = r.keys[n]
            if key not in tree:
                break
            if not tree.is_ready(key):
                if self.tier is not None and tree.node(key).tier_only:
                    if self._promote(r, r.keys[n:cap]):
                        continue  # back in the pool: read it
                    break
                plan = self.useful_settle(key, n)
                if plan is None:  # still being computed
                    break
                self.settle([plan])  # computed already: make it visible
                continue
            n += 1
        c, tree = self.c, self.tree
        rest = min(r.prompt_len - 1, (n + 1) * c) - n * c
        if tree.page_tokens < c and rest >= tree.page_tokens:
            parent, nxt = r.keys[n - 1] if n else None, r.tokens[n * c : n * c + rest]
            hit = tree.partial(parent, nxt)
            if hit is None and self.tier is not None and (held := tree.partial(parent, nxt, True)) \
                    and self.tier.pool.slots.free_count(tree.node(held[0]).tier):  # evicting nothing
                hit = held if self._promote(r, [held[0]]) else None  # read back whole, for its pages
            if hit is not None:
                return n * c + hit[1]
        return n * c

    def _promote(self, r: SimRequest, keys) -> int:
        """Promotes the segments of ``keys`` held only in the disk tier, from the first
        on (:meth:`~tokenlake.core.tier.TierManager.promote`: at once here, no data
        moves); ``r`` may run once they are read, each instance reading its own at the
        tier's bandwidth. Returns how many came back."""
        tier = self.tier
        promos = tier.promote(keys)
        per_inst: dict[int, int] = {}
        for p in promos:
            tier.promoted(p)
            per_inst[p.instance] = per_inst.get(p.instance, 0) + 1
        if promos:
            setup = self.b.setup
            read_s = max(per_inst.values()) * setup.model.segment_bytes(self.c) / setup.hardware.tier_read_bw
            r.ready_s = max(r.ready_s, self.b.now + read_s)
            self.promoted += len(promos)
            self.promote_s += read_s
        return len(promos)

    def useful_settle(self, key: bytes, q: int) -> PrefillPlan | None:
        """The plan storing segment ``q`` (= ``key``) if its request already computed it."""
        plan = self.pending.get(key)
        if plan is None:
            return None
        for run in {id(r.run): r.run for r in plan.members if r.run is not None}.values():
            self.b.checkpoint(run)
        for r in plan.members:
            if q < len(r.keys) and r.keys[q] == key and r.prefilled >= (q + 1) * self.c:
                return plan
        return None

    def prepare(self, runs: list[Run], kept: list[Run] = ()) -> None:
        """Makes sure every prefilling request of the new ``runs`` is in an in-flight
        plan, with requests that share pending segments in one flight; settles the plans
        of requests the decision left out (neither in ``runs`` nor in ``kept``)."""
        pre = [r for run in runs for r, c in zip(run.reqs, run.chunks) if c is not None]
        scheduled = {id(r) for r in pre}
        scheduled.update(id(r) for run in kept for r in run.reqs)
        plans = {id(p): p for p in self.pending.values()}
        for p in [p for p in plans.values() if any(id(r) not in scheduled for r in p.members)]:
            self.settle([p], keep=lambda r: id(r) in scheduled)
        need = [r for r in pre if r.aux is None]
        if not need:
            return
        shared = {}
        for r in need:
            for k in r.keys[r.context // self.c:]:
                p = self.pending.get(k)
                if p is not None:
                    shared[id(p)] = p
        if shared:
            self.settle(list(shared.values()), extra=need)
        else:
            self.plan_prefill(need)

    def finish_prefills(self, run: Run) -> None:
        """After a run: completes the plans of requests whose prompt is now complete.

        A plan shared by several prompts (they share segments it stores) is completed
        whole when its first prompt completes: the others' remaining segments become
        visible a little early (re-cutting it would store them all over again).
        """
        for r, c in zip(run.reqs, run.chunks):
            plan = r.aux
            if c is None or not isinstance(plan, PrefillPlan) or r.prefilled < r.prompt_len:
                continue
            self.cp.complete(plan.plans)
            for k in plan.keys:
                if self.pending.get(k) is plan:
                    del self.pending[k]
            for m in plan.members:
                m.aux = "committed" if m.prefilled < m.prompt_len else None

    # -------------------------------------------------------------- reads
    def commit(self, run: Run, j0: int, j1: int) -> None:
        """Counts the reads of iterations ``j0+1 .. j1`` (before the requests advance)."""
        k = j1 - j0
        states = self.cp.requests  # the chains the plans resolved
        chains = [(st.keys, st.histogram) for r in run.reqs
                  if (st := states.get(r.request_id)) is not None and st.keys]
        if chains:
            self.cp.record_reads(chains, k)  # at the control plane's clock: the simulator's now
        base: dict[int, int] = {}
        for r in run.reqs:
            for vec in (self.reads.get(r.request_id), self.grown.get(r.request_id)):
                if vec:
                    for inst, n in vec.items():
                        base[inst] = base.get(inst, 0) + n
        prefilling = [(i, r) for i, r in enumerate(run.reqs) if run.chunks[i] is not None]
        if not prefilling:
            self.b.rec.run_reads(run.sched, j0, j1, base)
            return
        cp, c, rec = self.cp, self.c, self.b.rec
        for m in range(j0 + 1, j1 + 1):
            rec.reads(run.sched.end(m), base)
            for i, r in prefilling:  # segments completed by iteration m, read from m+1 on
                before = r.prefilled + run.tokens_between(i, j0, m - 1)
                after = before + run.chunks[i][m - 1]
                grown = self.grown.setdefault(r.request_id, {})
                for q in range(before // c, min(after // c, len(r.keys))):
                    home = cp.home(r.keys[q])
                    base[home] = base.get(home, 0) + c * run.dop
                    grown[home] = grown.get(home, 0) + c

    def forget(self, r: SimRequest) -> None:
        self.reads.pop(r.request_id, None)
        self.grown.pop(r.request_id, None)
        self.slots.pop(r.request_id, None)
