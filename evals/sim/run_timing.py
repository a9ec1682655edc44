"""Iteration times of TokenLake's simulated runs, from where their work runs.

:class:`RunTiming` gives every new run of :class:`~evals.sim.pooled.PooledBackend` its
schedule once the decision's plans exist (so the instances serving each request's
prefix are known, :mod:`evals.sim.pool_plans`), with the per-instance model of
:mod:`evals.sim.instance_load`: compute on the run's instances, prefix attention on the
query engines of the instances that hold the prefix (waiting for the busiest), the
plans' bytes over the network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from evals.sim.backend import Run, SimRequest
from evals.sim.instance_load import Held, InstanceLoad, compute_s
from evals.sim.timing import ChunkSchedule, DecodeSchedule
from tokenlake.core.cost_model import comm_bytes_per_query_layer
from tokenlake.core.dispatch import DispatchNode, dispatch, edge_weight, split_tokens

Work = dict[int, float]

#: Rounds of re-timing the runs of one decision against each other's load, and the
#: relative change of every iteration time below which they count as settled.
ROUNDS, SETTLED = 8, 0.01


#: Bytes one second of a decode batch's wait weighs against in its placement: any wait
#: outweighs every byte count a batch can have.
WAIT_BYTES_PER_S = 1e15


class RunTiming:
    def __init__(self, backend) -> None:
        self.b = backend
        s = backend.setup
        self.load = InstanceLoad(backend.instance_ids, s.latency, s.model, s.hardware)
        self.lat, self.c = s.latency, s.segment_tokens
        self._work: dict[Run, Callable[[int], Work]] = {}  # run -> query work of iteration j
        self._home_of: dict[str, list[int]] = {}  # request -> hash home of each prompt segment

    # ------------------------------------------------------------ inputs
    def held(self, r: SimRequest) -> Held:
        """Prefix tokens each instance serves ``r`` now (its plan's reads plus what it
        stored since)."""
        p = self.b.planner
        out = dict(p.reads.get(r.request_id) or {})
        for inst, n in (p.grown.get(r.request_id) or {}).items():
            out[inst] = out.get(inst, 0) + n
        return out

    def _homes(self, r: SimRequest, start: int, stop: int) -> list[int]:
        """Home instances of the segments ``r``'s prompt tokens ``[start, stop)`` complete
        (each request's homes are looked up once, on first use)."""
        homes = self._home_of.get(r.request_id)
        if homes is None:
            home = self.b.cp.home
            homes = self._home_of[r.request_id] = [home(k) for k in r.keys]
        return homes[start // self.c : stop // self.c]

    def forget(self, r: SimRequest) -> None:
        """``r`` finished."""
        self._home_of.pop(r.request_id, None)

    def _put_remote(self, r: SimRequest, group, start: int, stop: int) -> float:
        """Share of ``r``'s new KV (prompt tokens ``[start, stop)``, or a decode token when
        ``start == stop``) stored outside ``group``."""
        if start == stop:  # decode: into the open tail
            st = self.b.cp.requests.get(r.request_id)
            tail = st.tail if st is not None else None
            return 0.0 if tail is not None and tail.instance in group else 1.0
        homes = self._homes(r, start, stop + self.c - 1)  # the segment the chunk writes into too
        if not homes:
            return 1.0 - len(group) / self.load.n
        return sum(1 for h in homes if h not in group) / len(homes)

    # ----------------------------------------------------------- placement
    def place(self, runs: Sequence[Run], free: Sequence[int]) -> list[tuple[int, ...]]:
        """Instances for the sub-batches of each new run, chosen by the control plane's
        dispatch (:func:`~tokenlake.core.dispatch.dispatch`, paper §5.2) among ``free``:
        each sub-batch is a node with the bytes it would send to every instance -- its
        rows' queries and partials to the instances serving their prefix, their new KV to
        where it is stored -- and the matching minimises the bytes that leave their home."""
        model = self.b.setup.model
        q_row = comm_bytes_per_query_layer(model) * model.num_layers
        kv_row = model.kv_bytes_per_token_layer * model.num_layers
        nodes, owner = [], []
        for b, run in enumerate(runs):
            firsts = [1 if c is None else c[0] for c in run.chunks]
            dests = [self._destinations(r, c) for r, c in zip(run.reqs, run.chunks)]
            helds = [self.held(r) for r in run.reqs]
            offsets = [sum(firsts[:n]) for n in range(len(firsts))]
            for p, (lo, hi) in enumerate(split_tokens(sum(firsts), run.dop)):
                query: dict[int, int] = {}
                put: dict[int, int] = {}
                for off, n, held, dest in zip(offsets, firsts, helds, dests):
                    rows = max(0, min(hi, off + n) - max(lo, off))
                    for i, tok in held.items():
                        if rows and tok:
                            query[i] = query.get(i, 0) + rows * q_row
                    for i in dest:
                        put[i] = put.get(i, 0) + rows * kv_row // len(dest)
                nodes.append(DispatchNode.from_counts(b, p, query, put))
                owner.append(b)
        homes = self._match(nodes, [runs[b] for b in owner], list(free))
        groups: list[list[int]] = [[] for _ in runs]
        for b, home in zip(owner, homes):
            groups[b].append(home)
        return [tuple(g) for g in groups]

    def _match(self, nodes, runs, free: list[int]) -> list[int]:
        """The dispatch in two rounds (``config.decode_first``). First the decode
        batches: each to an instance free by the time its requests are ready (their
        current iterations end), fewest bytes leaving their home among those; then the
        prefill sub-batches among the other instances, by the dispatch. A decode step is
        far shorter than its TBT SLO and a prefill iteration often longer, so a decode
        batch matched by bytes alone to an instance still finishing an iteration misses
        its SLO waiting."""
        dec = [n for n, run in enumerate(runs) if run.phase == "decode"]
        pre = [n for n, run in enumerate(runs) if run.phase != "decode"]
        if not (self.b.config.decode_first and dec and pre):
            return list(dispatch(nodes, free))
        now, free_at = self.b.now, self.b.free_at
        cost = np.empty((len(dec), len(free)))
        for row, n in enumerate(dec):
            ready = max([now] + [r.ready_s for r in runs[n].reqs])
            node = nodes[n]
            cost[row] = [max(0.0, free_at[i] - ready) * WAIT_BYTES_PER_S - edge_weight(node, i)
                         for i in free]
        out = [0] * len(nodes)
        for row, col in zip(*linear_sum_assignment(cost)):
            out[dec[row]] = free[col]
        taken = {out[n] for n in dec}
        for n, home in zip(pre, dispatch([nodes[n] for n in pre], [i for i in free if i not in taken])):
            out[n] = home
        return out

    def _destinations(self, r: SimRequest, chunks) -> list[int]:
        """Where ``r``'s new KV of its first iteration goes (hash homes of the segments a
        prefill chunk writes; a decode token's open tail)."""
        if chunks is None:
            st = self.b.cp.requests.get(r.request_id)
            return [st.tail.instance] if st is not None and st.tail is not None else []
        start = r.context
        return self._homes(r, start, start + chunks[0] + self.c - 1)

    # ---------------------------------------------------------- schedules
    def time(self, runs: Sequence[Run], starts: Sequence[float], slow: float = 1.0) -> None:
        """Gives each new run its schedule. The new runs load each other's instances, and
        each one's share of an instance is its work there over its iteration time, which
        depends on the others' shares: starting from every run's time alone, the times
        are recomputed against the others' load until they settle (a fixed point, reached
        from below; :data:`ROUNDS` at most)."""
        parts = [self._parts(run) for run in runs]
        for run, (work1, alone, _) in zip(runs, parts):
            self.load.start(run, alone, work1)
        for _ in range(ROUNDS):
            moved = 0.0
            for run, t0, (work1, _, make) in zip(runs, starts, parts):
                f_c, f_q = self.load.factors(run, run.group, work1)
                run.sched = make(t0, f_c * slow, f_q)
                period = run.sched.duration(1)
                old = self.load.period(run)
                moved = max(moved, abs(period - old) / period)
                self.load.start(run, period, work1)
            if moved < SETTLED or len(runs) == 1 and not self.load.others(runs[0]):
                break

    def _parts(self, run: Run):
        """``(work of iteration 1, its time alone, make(t0, f_compute, f_query))``."""
        return self._decode(run) if run.phase == "decode" else self._prefill(run)

    def _decode(self, run: Run):
        lat, reqs = self.lat, run.reqs
        n = len(reqs)
        helds = [self.held(r) for r in reqs]
        work = self.load.query_work([1] * n, helds)
        if self.b.config.grouped_reads:  # a segment several rows read, read once for all
            slots = self.b.planner.slots
            for inst, saved in self.load.grouped_saving([slots.get(r.request_id, ()) for r in reqs]).items():
                work[inst] = max(0.0, work[inst] - saved)
        comm = self.load.comm_s([1] * n, helds, [self._put_remote(r, run.group, 0, 0) for r in reqs],
                                run.group, 1)
        compute = compute_s(lat, [(1, 0)] * n, 1)
        growth = (lat.c_new_prefix + lat.c_prefix) * n  # one more prefix token each per step
        busy = self.load.busy_work(work, helds, run.group)
        self._work[run] = lambda j: busy

        def make(t0: float, f_c: float, f_q: dict[int, float]) -> DecodeSchedule:
            query = self.load.query_s(work, f_q.__getitem__)
            f_max = max(f_q.values(), default=1.0)
            return DecodeSchedule(t0, compute * f_c + query + comm, growth * f_max, run.k_end)

        return busy, compute + self.load.query_s(work, lambda i: 1.0) + comm, make

    def _prefill(self, run: Run):
        lat, chunk, dop = self.lat, self.b.chunk, run.dop
        reqs, chunks = run.reqs, run.chunks
        base = [(r, self.held(r), r.context) for r in reqs]

        def inputs(j: int):
            news, helds, puts, items = [], [], [], []
            for (r, held, ctx), c in zip(base, chunks):
                done = ctx + (j - 1) * chunk  # prompt tokens in the pool before iteration j
                h = dict(held)
                for home in self._homes(r, ctx, done):
                    h[home] = h.get(home, 0) + self.c
                news.append(c[j - 1])
                helds.append(h)
                puts.append(self._put_remote(r, run.group, done, done + c[j - 1]))
                items.append((c[j - 1], done))
            return news, helds, puts, items

        def work(j: int) -> Work:  # the query engines' busy time: attention and messages
            news, helds, _, _ = inputs(j)
            return self.load.busy_work(self.load.query_work(news, helds, dop), helds, run.group)

        self._work[run] = work

        def make(t0: float, f_c: float, f_q: dict[int, float]) -> ChunkSchedule:
            def duration(j: int) -> float:
                news, helds, puts, items = inputs(j)
                w = self.load.query_work(news, helds, dop)
                query = self.load.query_s(w, lambda i: f_q.get(i) or 1.0 / (1.0 - self.load.share(i, run)))
                return (compute_s(lat, items, dop) * f_c + query
                        + self.load.comm_s(news, helds, puts, run.group, dop))
            return ChunkSchedule(t0, fn=duration, k_max=run.k_end)

        w1 = work(1)
        news, helds, puts, items = inputs(1)
        alone = compute_s(lat, items, dop) + self.load.query_s(self.load.query_work(news, helds, dop),
                                                               lambda i: 1.0) + \
            self.load.comm_s(news, helds, puts, run.group, dop)
        return w1, alone, make

    # ------------------------------------------------------------ accounts
    def charge(self, run: Run, j0: int, j1: int) -> None:
        """Iterations ``j0+1 .. j1`` of ``run`` ran: their query work is busy time."""
        fn = self._work.get(run)
        if fn is None:
            return
        if run.phase == "decode":
            self.load.charge(fn(1), j1 - j0)
            return
        for j in range(j0 + 1, j1 + 1):
            self.load.charge(fn(j), 1)

    def stop(self, run: Run) -> None:
        self.load.stop(run)
        self._work.pop(run, None)

