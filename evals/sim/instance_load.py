"""Where TokenLake's simulated work runs: each instance's query engine is a resource.

The latency model (:class:`~tokenlake.core.cost_model.LatencyModel`) splits an
iteration into *compute* (``c_const``, ``c_request``, ``c_new``, ``c_new_sq``: weights and
the new tokens, done by the batch's own instances, divided over its DoP) and *prefix
attention* (``c_new_prefix * new * prefix + c_prefix * prefix``). In TokenLake the
second part is not done by the batch's instances but by the query engines of the
instances that hold the prefix, so :class:`InstanceLoad` charges it there:

* a run's **query work** on instance ``i`` per iteration is
  ``sum over its requests of (c_new_prefix * new + c_prefix * parts) * tokens_i``, with
  ``tokens_i`` the request's prefix tokens that ``i`` serves it, read from the plans'
  query tasks (:func:`evals.sim.pool_plans.plan_reads`) plus the segments it stored
  since, at their instances (``parts``: the sub-batches its rows are in, each querying);
* the query of an iteration **waits for the busiest instance it touches**: on instance
  ``i`` its work takes ``w / (1 - rho_i)``, where ``rho_i`` is the share of ``i``'s query
  engine that the *other* runs in progress keep busy (processor sharing; each run's
  share is its work there over its iteration time), capped at 0.95;
* the run's compute shares its own instances with their query engines: it is slowed by
  ``1 / (1 - rho_h)`` for the busiest of its instances ``h`` (the paper's ``1/(1-L)``
  of §6.1, per instance instead of one cluster-wide load);
* **communication** is the plans' own byte count over the hardware's network: per layer
  a round trip plus each new row's query and partial result to every *other* instance
  that holds some of its prefix, and its new KV to the instances that store it when
  those are not the run's, sent by the DoP sub-batches in parallel. Not overlapped
  with compute (conservative).

* a query engine's **busy time** is its attention work times ``query_work_scale`` plus
  ``query_message_s`` per query message it handles (both measured, ``tokenlake
  profile-latency --query-engine``). That is what an instance's load and busy time
  count (so a hot instance's messages count too), but not what the iteration's critical
  path adds again: the fitted coefficients already hold an iteration's query round
  trips and its prefix work as it overlaps on the machine it was measured on.

An iteration lasts ``compute * f_compute + max_i(query_i * f_i) + comm``. On a
``shared_host`` profile (the ``cpu`` one: every instance on one machine's cores) the
instances' query engines do not work in parallel: the query part is the *sum* over the
instances, and a share is the whole host's. Loads are
taken when a run starts and kept while it runs (a run lasts until the next decision
that changes it). :attr:`busy_s` sums every instance's query work (without waiting), to
compare with the real engines' busy time (``tokenlake eval validate``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenlake.core.cost_model import LatencyModel, comm_bytes_per_query_layer
from tokenlake.core.dispatch import split_tokens
from tokenlake.core.specs import HardwareProfile, ModelSpec

#: The most of an instance's query engine other runs may keep busy (as the DP's cap).
MAX_SHARE = 0.95

Held = dict[int, int]  # instance -> prefix tokens it serves a request


def compute_s(lat: LatencyModel, items: Sequence[tuple[int, int]], k: int) -> float:
    """The compute part of one iteration of ``(new, prefix)`` items on ``k`` instances
    (``iteration_s`` without the prefix-attention terms)."""
    new = sum(n for n, _ in items)
    new_sq = sum(n * n for n, _ in items)
    return lat.c_const + lat.c_request * len(items) + (lat.c_new * new + lat.c_new_sq * new_sq) / lat.speedup(k)


def parts_of(news: Sequence[int], dop: int) -> list[int]:
    """How many of the ``dop`` sub-batches each request's rows fall in (rows split as
    ``gen_plans`` splits them, :func:`~tokenlake.core.dispatch.split_tokens`)."""
    if dop == 1:
        return [1] * len(news)
    ranges = split_tokens(sum(news), dop)
    out, start = [], 0
    for n in news:
        out.append(max(1, sum(1 for a, z in ranges if a < start + n and start < z)))
        start += n
    return out


class InstanceLoad:
    """Query-engine work per instance of the runs in progress (see the module docstring)."""

    def __init__(self, instances: Sequence[int], lat: LatencyModel, model: ModelSpec,
                 hardware: HardwareProfile) -> None:
        self.lat, self.model, self.hw = lat, model, hardware
        self.n = len(instances)
        self.busy_s = dict.fromkeys(instances, 0.0)
        self._runs: dict[object, tuple[float, dict[int, float], float]] = {}  # run -> (period, work, host share)
        self._rho: dict[int, float] = {}  # instance -> summed share of the runs' work there
        self._host = 0.0  # the summed shares over every instance (a shared host's load)
        self._q_bytes = comm_bytes_per_query_layer(model)
        self._kv_bytes = model.kv_bytes_per_token_layer

    # ------------------------------------------------------------ work
    def query_work(self, news: Sequence[int], helds: Sequence[Held], dop: int = 1) -> dict[int, float]:
        """Seconds of query-engine work per instance for one iteration."""
        lat, out = self.lat, {}
        for new, held, parts in zip(news, helds, parts_of(news, dop)):
            per_token = lat.c_new_prefix * new + lat.c_prefix * parts
            for inst, tok in held.items():
                out[inst] = out.get(inst, 0.0) + per_token * tok
        return out

    def grouped_saving(self, slots: Sequence[Sequence[tuple[int, int, int]]]) -> dict[int, float]:
        """Seconds of query work per instance that one iteration of a decode batch saves
        when the rows reading one segment read it once (``slots``: each request's
        ``(instance, slot, tokens)``): ``c_prefix`` per token for every read but the first."""
        seen: set[tuple[int, int]] = set()
        out: dict[int, float] = {}
        for reads in slots:
            for inst, slot, tokens in reads:
                if (inst, slot) in seen:
                    out[inst] = out.get(inst, 0.0) + self.lat.c_prefix * tokens
                else:
                    seen.add((inst, slot))
        return out

    def message_work(self, helds: Sequence[Held], group: Sequence[int]) -> dict[int, float]:
        """Seconds of query-engine message handling per instance for one iteration
        (``lat.query_message_s`` per message, measured): per layer and sub-batch, its home
        takes the compute engine's query and every remote holder's reply, each remote
        holder the home's query."""
        alpha = self.lat.query_message_s
        if not alpha or not group:
            return {}
        touched = {i for held in helds for i, tok in held.items() if tok}
        per_layer = alpha * self.model.num_layers
        out: dict[int, float] = {}
        for home in group:
            remote = touched - {home}
            out[home] = out.get(home, 0.0) + per_layer * (1 + len(remote))
            for i in remote:
                out[i] = out.get(i, 0.0) + per_layer
        return out

    def busy_work(self, work: dict[int, float], helds: Sequence[Held], group: Sequence[int]) -> dict[int, float]:
        """What an iteration keeps each query engine busy: its attention ``work`` times the
        measured ``query_work_scale``, plus its messages (:meth:`message_work`)."""
        scale = self.lat.query_work_scale
        out = {i: w * scale for i, w in work.items()}
        for i, m in self.message_work(helds, group).items():
            out[i] = out.get(i, 0.0) + m
        return out

    def comm_s(self, news: Sequence[int], helds: Sequence[Held], put_remote: Sequence[float],
               group: Sequence[int], dop: int) -> float:
        """Seconds one iteration spends on the network: ``put_remote[r]`` is the share of
        request ``r``'s new KV stored on instances outside ``group``."""
        if self.n <= 1:
            return 0.0
        total = 0.0
        for new, held, remote_put in zip(news, helds, put_remote):
            remote = sum(1 for i, tok in held.items() if tok and i not in group)
            total += new * (remote * self._q_bytes + remote_put * self._kv_bytes)
        if total <= 0:
            return 0.0
        return self.model.num_layers * (2 * self.hw.net_latency_s + total / (dop * self.hw.net_bw))

    # ---------------------------------------------------------- sharing
    def share(self, inst: int, exclude: object = None) -> float:
        """The share of ``inst``'s query engine the runs in progress (but ``exclude``)
        keep busy, capped at :data:`MAX_SHARE` (on a shared host: of the host's). Kept
        as running sums, so a call costs the same however many runs there are."""
        got = self._runs.get(exclude) if exclude is not None else None
        if self.hw.shared_host:
            rho = self._host - (got[2] if got else 0.0)
        else:
            rho = self._rho.get(inst, 0.0) - (got[1].get(inst, 0.0) / got[0] if got and got[0] > 0 else 0.0)
        return min(MAX_SHARE, max(0.0, rho))

    def query_s(self, work: dict[int, float], f_q) -> float:
        """How long an iteration's query takes: its work on each instance stretched by
        that instance's factor ``f_q(i)``; the busiest instance (all of them in turn on a
        shared host)."""
        times = [w * f_q(i) for i, w in work.items()]
        if not times:
            return 0.0
        return sum(times) if self.hw.shared_host else max(times)

    def factors(self, run: object, group: Sequence[int], touched) -> tuple[float, dict[int, float]]:
        """``(f_compute, {instance: f_query})`` for ``run`` against the others."""
        f_c = 1.0 / (1.0 - max((self.share(h, run) for h in group), default=0.0))
        return f_c, {i: 1.0 / (1.0 - self.share(i, run)) for i in touched}

    def start(self, run: object, period_s: float, work: dict[int, float]) -> None:
        """``run`` iterates every ``period_s`` doing ``work`` on the query engines."""
        self.stop(run)
        total = sum(work.values()) / period_s if period_s > 0 else 0.0
        self._runs[run] = (period_s, work, total)
        if period_s > 0:
            for i, w in work.items():
                self._rho[i] = self._rho.get(i, 0.0) + w / period_s
            self._host += total

    def stop(self, run: object) -> None:
        got = self._runs.pop(run, None)
        if got is not None and got[0] > 0:
            for i, w in got[1].items():
                self._rho[i] -= w / got[0]
            self._host -= got[2]
        if not self._runs:  # no drift of the running sums
            self._rho.clear()
            self._host = 0.0

    def period(self, run: object) -> float:
        """The iteration time ``run`` is registered with (0: none)."""
        got = self._runs.get(run)
        return got[0] if got else 0.0

    def others(self, run: object) -> bool:
        """Whether any other run is in progress."""
        return any(r is not run for r in self._runs)

    def charge(self, work: dict[int, float], iterations: int) -> None:
        """``iterations`` iterations of ``work`` ran (the busy-time account)."""
        for inst, w in work.items():
            self.busy_s[inst] = self.busy_s.get(inst, 0.0) + w * iterations
