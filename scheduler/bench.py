"""Decision-time benchmark of the goodput DP: ``tokenlake bench scheduler``.

Builds a seeded snapshot of ``n_requests`` requests (a share of them prefill, the rest
decode, log-uniform context lengths up to 128k tokens, TBT SLO 0.2 s on decode) and
times :meth:`GoodputScheduler.schedule` on N free instances (median of ``repeats``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

from scheduler.api import InstanceView, RequestView, Snapshot
from scheduler.goodput import GoodputScheduler
from tokenlake.core.cost_model import LatencyModel


def make_snapshot(n_requests: int, n_instances: int, prefill_share: float = 0.25,
                  seed: int = 0, latency: LatencyModel | None = None) -> Snapshot:
    """A reproducible snapshot for benchmarks and tests."""
    rng = random.Random(seed)
    latency = latency or LatencyModel.load("a100-80gb_llama-2-7b")
    waiting, running = [], []
    for i in range(n_requests):
        ctx = int(math.exp(rng.uniform(math.log(16), math.log(131072))))
        if rng.random() < prefill_share:
            view = RequestView(f"r{i}", "prefill", ctx // 2, max(1, ctx - ctx // 2), 0.0, None)
            (waiting if rng.random() < 0.5 else running).append(view)
        else:
            running.append(RequestView(f"r{i}", "decode", ctx, 0, 0.0, 0.2))
    inst = tuple(InstanceView(i) for i in range(n_instances))
    return Snapshot(1.0, tuple(waiting), tuple(running), inst, 0.1, latency)


def bench_scheduler(ns: Sequence[int] = (8, 16, 64), n_requests: int = 256,
                    prefill_share: float = 0.25, repeats: int = 5, seed: int = 0,
                    prefill_dops: str = "all") -> dict[str, dict[str, float]]:
    """``{"decision_ms": {"8": ms, ...}}``: median wall time of one decision per N."""
    sched = GoodputScheduler(prefill_dops=prefill_dops)
    out: dict[str, float] = {}
    for n in ns:
        snap = make_snapshot(n_requests, n, prefill_share, seed)
        sched.schedule(snap)  # warm up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sched.schedule(snap)
            times.append((time.perf_counter() - t0) * 1e3)
        out[str(n)] = sorted(times)[len(times) // 2]
    return {"decision_ms": out}
