"""SGLang + Mooncake xPyD: cache-centric prefill/decode disaggregation (no pool).

Workers are ``tp`` GPUs each (paper §7: 8 GPUs, TP=2 -> 1P3D is one prefill worker and
three decode workers). The real :class:`~scheduler.baselines.xpyd.XPyDRouter` routes:
a request goes to the prefill worker with the longest prefix in its (router-side) tree;
when its prefill ends, to the decode worker with the fewest decodes.

* A prefill worker prefills its requests (chunked, all of them each iteration) with a
  hit from its own :class:`~evals.sim.unpooled.LocalCache`, then caches the prompt.
* The prompt's KV then moves to the decode worker: ``tokens x kv_bytes_per_token`` over
  ``net_bw`` plus a round trip, once the decode worker has memory for the request's
  prompt and output (it waits otherwise; the paper: "requests in the prefill phase have
  to wait for cache slots in decode instances"). The first token reaches the user with
  that KV (TTFT = prefill end + wait + transfer).
* A decode worker decodes all its requests together; they release memory on finishing.
"""

from __future__ import annotations

from collections import deque

from evals.sim.backend import Backend, Run, SimRequest
from evals.sim.trace import prompt_array
from evals.sim.unpooled import (
    Worker,
    admit_in_order,
    local_decode_run,
    local_prefill_run,
    local_reads,
)
from scheduler.baselines.xpyd import XPyDRouter

TRANSFERRED = 30


class XPyDBackend(Backend):
    def __init__(self, setup, system: str, config: str) -> None:
        tp = setup.config.tp
        n = setup.instances // tp
        if n < 2 or setup.instances % tp:
            raise ValueError(f"{setup.instances} GPUs do not make >= 2 TP={tp} workers")
        super().__init__(setup, system, range(n))
        self.tp = tp
        cap = setup.cache_tokens_per_gpu * tp
        self.router = XPyDRouter.split(list(range(n)), _scaled(config, n),
                                       setup.model.kv_bytes_per_token,
                                       cache_capacity_tokens=cap, clock=lambda: self.now)
        prefill = set(self.router.prefill_instances)
        self.workers = [Worker(cap, self.tracker, holds_output=w not in prefill, caches=w in prefill)
                        for w in range(n)]
        self.queues = {d: deque() for d in self.router.decode_instances}
        self.transfers = 0
        self.transfer_s = 0.0

    def on_arrival(self, req: SimRequest) -> None:
        req.tokens = prompt_array(req.source)
        req.worker = self.router.prefill(req.request_id, req.tokens)

    def decide(self) -> None:
        for w in self.free_instances():
            mine = [r for r in self.waiting() if r.worker == w]
            if not mine:
                continue
            worker = self.workers[w]
            if w in self.queues:
                self.start_run(local_decode_run(self, mine, self.tp))
                continue
            ready = admit_in_order(worker, mine)
            if ready:
                self.start_run(local_prefill_run(self, ready, self.tp))

    def commit(self, run: Run, j0: int, j1: int) -> None:
        local_reads(self, run, j0, j1)

    def run_done(self, run: Run) -> None:
        if run.phase != "prefill":
            return
        worker = self.workers[run.group[0]]
        for r in run.reqs:
            if r.prefilled < r.prompt_len:
                continue
            worker.admitted.discard(r)
            worker.cache.insert(r.tokens, self.now, worker.cache_limit())
            for other in self.tracker.values():
                if other.blocked == "memory" and other.worker == run.group[0]:
                    other.blocked = None
            t = self.router.complete_prefill(r.request_id)
            # Decoding (or done, for one output token) once its KV reaches the decode worker.
            r.worker, r.blocked = t.dst, "transfer"
            r.aux = t.bytes
            self.queues[t.dst].append(r)
        self._start_transfers()

    def _start_transfers(self) -> None:
        hw = self.setup.hardware
        for d, queue in self.queues.items():
            worker = self.workers[d]
            while queue and worker.held() + worker.need(queue[0], 0) <= worker.capacity:
                r = queue.popleft()
                worker.admitted.add(r)
                dt = 2 * hw.net_latency_s + r.aux / hw.net_bw
                self.transfers += 1
                self.transfer_s += dt
                self.push(self.now + dt, TRANSFERRED, r)

    def handle(self, kind: int, r: SimRequest) -> None:
        self.rec.first_token(r, self.now)  # the first token reaches the user with the KV
        r.blocked = None
        self.finish_done([r])  # a single output token: done now

    def on_finish(self, req: SimRequest) -> None:
        self.workers[req.worker].admitted.discard(req)
        self.router.finish(req.request_id)
        req.tokens = None
        self._start_transfers()

    def continues(self, run: Run, waiting: list[SimRequest], idle: list) -> bool:
        w = run.group[0]
        return not any(r.worker == w for r in waiting)

    def extra(self) -> dict:
        return {"workers": len(self.workers), "tp": self.tp,
                "prefill_workers": list(self.router.prefill_instances),
                "decode_workers": list(self.router.decode_instances),
                "kv_transfers": self.transfers, "kv_transfer_s": self.transfer_s,
                "worker_cache_tokens": [w.cache.tokens for w in self.workers]}


def _scaled(config: str, n: int) -> str:
    """``"1P3D"`` on ``n`` workers keeps the ratio: ``n/4`` prefill workers (at least 1)."""
    p, d = (int(x) for x in config.upper().rstrip("D").split("P"))
    x = min(max(1, round(n * p / (p + d))), n - 1)
    return f"{x}P{n - x}D"
