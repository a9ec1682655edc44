"""The simulated systems by name, and :func:`simulate`, the one entry point.

| name | policy | cache |
|---|---|---|
| ``tokenlake`` | :class:`GoodputScheduler` (elastic DoP, PD per batch) | pooled: real ControlPlane |
| ``tokenlake-1p3d`` / ``-3p1d`` | :class:`FixedPD` around it (N/4 or 3N/4 prefill instances) | pooled |
| ``sglang-router`` | :class:`CacheAwareRouter` via :class:`RoutedPolicy`, TP workers | per-worker radix caches |
| ``round-robin`` | :class:`RoundRobinRouter` via :class:`RoutedPolicy` | per-worker radix caches |
| ``flowkv`` | :class:`FlowKVRouter` (load score) via :class:`RoutedPolicy` | per-worker radix caches |
| ``mooncake-1p3d`` / ``-3p1d`` | :class:`XPyDRouter`, KV moved P -> D | prefill workers' radix caches |
| ``banaserve`` | :class:`LeastLoadRouter` (load only), TP workers | one global store, prefixes fetched layer by layer |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from evals.sim.config import SimConfig
from evals.sim.global_store import GlobalStoreBackend
from evals.sim.metrics import SimResult
from evals.sim.pooled import PooledBackend
from evals.sim.unpooled import FlowKVAdapter, RoutedBackend
from evals.sim.xpyd import XPyDBackend
from evals.workloads.base import Request
from scheduler.baselines.cache_aware_router import CacheAwareRouter
from scheduler.baselines.fixed_pd import FixedPD
from scheduler.baselines.round_robin import RoundRobinRouter
from scheduler.goodput import GoodputScheduler

SYSTEMS = ("tokenlake", "tokenlake-1p3d", "tokenlake-3p1d", "sglang-router", "round-robin",
           "flowkv", "mooncake-1p3d", "mooncake-3p1d", "banaserve")


def make_backend(system: str, config: SimConfig):
    """The backend simulating ``system`` on ``config`` (``ValueError`` for unknown names)."""
    setup = config.resolve()
    if system in ("tokenlake", "tokenlake-1p3d", "tokenlake-3p1d"):

        policy = GoodputScheduler(chunk_tokens=config.chunk_tokens,
                                  max_prefill_dop=config.max_prefill_dop,
                                  decode_batches=config.decode_batches)
        if system != "tokenlake":

            n = config.instances
            if n < 2:
                raise ValueError(f"{system} needs at least 2 instances")
            share = 1 if system.endswith("1p3d") else 3
            p = min(max(1, round(n * share / 4)), n - 1)
            policy = FixedPD.split(list(range(n)), f"{p}P{n - p}D", policy)
        return PooledBackend(setup, system, policy)
    if system in ("sglang-router", "round-robin", "flowkv"):

        workers = list(range(config.instances // config.tp))
        if system == "sglang-router":

            holder: list = []
            router = CacheAwareRouter(workers, clock=lambda: holder[0].now)
            backend = RoutedBackend(setup, system, router)
            holder.append(backend)
            return backend
        if system == "round-robin":

            return RoutedBackend(setup, system, RoundRobinRouter(workers))
        return RoutedBackend(setup, system,
                             FlowKVAdapter(workers, setup.cache_tokens_per_gpu * config.tp))
    if system in ("mooncake-1p3d", "mooncake-3p1d"):

        return XPyDBackend(setup, system, system.split("-")[1])
    if system == "banaserve":
        return GlobalStoreBackend(setup, system)
    raise ValueError(f"unknown system {system!r}; valid: {', '.join(SYSTEMS)}")


def simulate(requests: Sequence[Request], system: str = "tokenlake",
             config: SimConfig | None = None,
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Replays ``requests`` (any :class:`~evals.workloads.base.Request` s, e.g. from a
    workload loader or :func:`evals.sim.trace.load_trace`) on ``system``.

    Deterministic for a fixed ``config.seed``. ``progress(finished)`` is called as
    requests finish.
    """
    if not requests:
        raise ValueError("no requests to simulate")
    backend = make_backend(system, config or SimConfig())
    return backend.simulate(requests, progress)


def p90_goodput(requests_at: Callable[[float], Sequence[Request]], rates: Sequence[float],
                system: str = "tokenlake", config: SimConfig | None = None,
                target: float = 0.9) -> tuple[float, list[SimResult]]:
    """P90 goodput (paper §7): the highest of ``rates`` (requests/s) at which at least
    ``target`` of the requests meet the SLO. ``requests_at(rate)`` gives the workload at
    a rate (e.g. ``lambda r: arrange(reqs, rate=r)``). Returns ``(rate or 0.0, results)``.
    """
    best, results = 0.0, []
    for rate in sorted(rates):
        res = simulate(requests_at(rate), system, config)
        results.append(res)
        if res.slo_attainment >= target:
            best = rate
    return best, results
