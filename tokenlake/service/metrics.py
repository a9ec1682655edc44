"""``/metrics``: the service's Prometheus metrics (``prometheus_client``).

Two kinds, in one registry per service:

* what the serving loop observes as it runs: requests by outcome, prompt, hit and
  generated tokens, the generation requests being answered, histograms of time to
  first token, time between tokens, the iteration time and the pool's query latency, and
  the instances the scheduler gives each phase (the last iteration's, and their running
  sum over iterations, whose rate is the mean instances per phase over a window)
  (:class:`ServiceMetrics` methods, called from the engine thread and the HTTP handlers);
* what the pool holds, read from the control plane when scraped
  (:class:`_PoolCollector`): slots used and their capacity, cumulative segment reads
  per instance, replications, evictions, segments, whether each instance is up, and
  the queue length and running requests of the loop.

Names start with ``tokenlake_``; counters end in ``_total`` as Prometheus expects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenlake.generation.requests import RequestResult

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds: a local CPU model answers in milliseconds to seconds
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_QUERY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 1.0)


class _PoolCollector(Collector):
    """The pool's state, read at scrape time."""

    def __init__(self, stats: Callable[[], object] | None, instances: Iterable[int],
                 loop_counts: Callable[[], tuple[int, int]],
                 sessions: Callable[[], tuple[int, int]] | None = None) -> None:
        self.stats, self.loop_counts, self.sessions = stats, loop_counts, sessions
        self.known = tuple(instances)  # instances at start: one gone reports up 0

    def collect(self):
        queue, running = self.loop_counts()
        yield GaugeMetricFamily("tokenlake_queue_length", "Requests waiting for admission",
                                value=queue)
        yield GaugeMetricFamily("tokenlake_running_requests", "Requests admitted, not done",
                                value=running)
        if self.stats is None:  # the baseline engine: no pool
            return
        st = self.stats()
        pool = st.pool
        used = GaugeMetricFamily("tokenlake_slots_used", "Segment slots in use",
                                 labels=["instance"])
        cap = GaugeMetricFamily("tokenlake_slots_capacity", "Segment slots", labels=["instance"])
        reads = CounterMetricFamily("tokenlake_cache_reads", "Segment reads served",
                                    labels=["instance"])
        up = GaugeMetricFamily("tokenlake_instance_up", "1 while the instance is in the pool",
                               labels=["instance"])
        for i in sorted(set(self.known) | set(pool.slots_capacity)):
            label = [str(i)]
            up.add_metric(label, 1 if i in pool.slots_capacity else 0)
            if i in pool.slots_capacity:
                used.add_metric(label, pool.slots_used.get(i, 0))
                cap.add_metric(label, pool.slots_capacity[i])
                reads.add_metric(label, pool.reads.get(i, 0))
        yield from (used, cap, reads, up)
        yield CounterMetricFamily("tokenlake_replications", "Replicas created by rebalancing",
                                  value=pool.replications)
        yield CounterMetricFamily("tokenlake_evictions", "Replicas evicted to make room",
                                  value=pool.evictions)
        yield GaugeMetricFamily("tokenlake_segments", "Segments in the global prefix tree",
                                value=pool.segments)
        if pool.tier is not None:
            yield from _tier_metrics(pool.tier)
        if self.sessions is not None:
            open_now, ended = self.sessions()
            yield GaugeMetricFamily("tokenlake_sessions", "Client sessions open on the pool "
                                    "(tokenlake.connect callers, vLLM connectors)", value=open_now)
            yield CounterMetricFamily("tokenlake_sessions_ended", "Client sessions the server "
                                      "ended (no heartbeat, or an iteration overdue)", value=ended)


def _tier_metrics(tier) -> Iterable:
    """The tiers' families (``PoolStats.tier``: :class:`tokenlake.core.tier.TierStats`)."""
    held = GaugeMetricFamily("tokenlake_tier_segments", "Segments in each instance's tier (disk or host memory)",
                             labels=["instance"])
    for i, n in sorted(tier.held.items()):
        held.add_metric([str(i)], n)
    yield held
    yield GaugeMetricFamily("tokenlake_tier_capacity_segments",
                            "Segments one instance's tier holds", value=tier.capacity)
    for name, value, text in (
            ("writes", tier.written, "Segments written through to a tier"),
            ("demotions", tier.demotions, "Segments evicted from the slabs kept in a tier"),
            ("promotions", tier.promotions, "Hits in a tier: segments read back into a slot"),
            ("failed_promotions", tier.failed_promotions,
             "Tier copies found missing or corrupt on a hit (their segments computed again)"),
            ("dropped", tier.dropped, "Copies a tier evicted or lost")):
        yield CounterMetricFamily(f"tokenlake_tier_{name}", text, value=value)
    yield from _tier_engine_metrics(tier.engines)


#: The transfer engines' own tier counters (TIER_COUNTERS): metric, counter, help, kind.
_ENGINE_FAMILIES = (
    ("tokenlake_tier_engine_writes", "written", "Copies an instance's transfer engine wrote to its tier", "counter"),
    ("tokenlake_tier_write_errors", "write_errors", "Tier writes that failed (the copy is a miss later)", "counter"),
    ("tokenlake_tier_refused", "refused", "Copies refused for want of staging memory (or of a free row)", "counter"),
    ("tokenlake_tier_engine_reads", "reads", "Copies read back from a tier into a slot", "counter"),
    ("tokenlake_tier_read_failures", "read_failures", "Tier reads refused: the copy missing, corrupt or truncated", "counter"),
    ("tokenlake_tier_staged_bytes", "staged_bytes", "Bytes staged in memory, not yet written to the tier", "gauge"),
    ("tokenlake_tier_write_wait_seconds", "paced_s", "Seconds the tier's writer waited on its bandwidth limit", "counter"),
)


def _tier_engine_metrics(engines: dict[int, dict[str, float]]) -> Iterable:
    """Per instance, its transfer engine's counters as of its last tier answer."""
    for metric, counter, text, kind in _ENGINE_FAMILIES:
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(metric, text, labels=["instance"])
        for i, counters in sorted(engines.items()):
            family.add_metric([str(i)], counters.get(counter, 0.0))
        yield family


class ServiceMetrics:
    """The registry behind ``/metrics`` (see the module docstring).

    Args:
        stats: returns the control plane's ``ControlStats`` (None: no pool).
        instances: the pool's instances at start.
        loop_counts: returns ``(queue length, running requests)``.
        sessions: returns ``(client sessions open, sessions the server ended)`` (None:
            not served: no session metrics).
    """

    def __init__(self, stats: Callable[[], object] | None = None,
                 instances: Iterable[int] = (),
                 loop_counts: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 sessions: Callable[[], tuple[int, int]] | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("tokenlake_requests", "Requests by outcome", ["outcome"],
                                registry=r)
        self.prompt_tokens = Counter("tokenlake_lookup_tokens",
                                     "Prompt tokens looked up in the pool", registry=r)
        self.hit_tokens = Counter("tokenlake_hit_tokens",
                                  "Prompt tokens served from the pool", registry=r)
        self.generated = Counter("tokenlake_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tokenlake_ttft_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tbt = Histogram("tokenlake_tbt_seconds", "Time between tokens", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.iteration = Histogram("tokenlake_iteration_seconds", "One serving iteration",
                                   registry=r, buckets=_LATENCY_BUCKETS)
        self.query = Histogram("tokenlake_query_latency_seconds",
                               "One layer's pool queries, first sent to last answered",
                               registry=r, buckets=_QUERY_BUCKETS)
        self.in_flight = Gauge("tokenlake_http_in_flight", "POST requests being answered "
                               "(a stream: until it ends)", registry=r)
        self.phase_instances = Gauge("tokenlake_phase_instances", "Instances the last iteration's "
                                     "decision gave each phase", ["phase"], registry=r)
        self.phase_iterations = Counter("tokenlake_phase_instance_iterations",
                                        "Instances given each phase, summed over iterations",
                                        ["phase"], registry=r)
        for phase in ("prefill", "decode"):
            self.phase_instances.labels(phase)
            self.phase_iterations.labels(phase)
        for outcome in ("stop", "length", "abort", "error", "rejected"):
            self.requests.labels(outcome)  # every outcome shows, at 0 until it happens
        r.register(_PoolCollector(stats, instances, loop_counts, sessions))

    def finished(self, result: RequestResult) -> None:
        """A request ended (any way): its tokens and outcome."""
        self.requests.labels(result.finish_reason or "error").inc()
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.hit_tokens.inc(result.hit_tokens)
        self.generated.inc(len(result.output_ids))

    def phases(self, instances: dict[str, int]) -> None:
        """An iteration ran: the instances its decision gave each phase."""
        for phase, n in instances.items():
            self.phase_instances.labels(phase).set(n)
            self.phase_iterations.labels(phase).inc(n)

    def rejected(self) -> None:
        """A request refused before it ran (bad input)."""
        self.requests.labels("rejected").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
