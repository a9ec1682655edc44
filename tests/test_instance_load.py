"""The simulator charges TokenLake's prefix attention to the query engines of the
instances that hold the prefix (issue #20): a query waits for the busiest instance it
touches, and a hot instance slows what reads from it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from evals.sim.config import SimConfig
from evals.sim.instance_load import MAX_SHARE, InstanceLoad, compute_s, parts_of
from evals.sim.systems import simulate
from evals.workloads.base import Request
from tokenlake.core.cost_model import LatencyModel, comm_bytes_per_query_layer
from tokenlake.core.specs import load_hardware, load_model

LAT = LatencyModel(c_const=0.01, c_new=1e-4, c_new_prefix=1e-7, c_new_sq=0.0, c_prefix=1e-5, c_request=0.0)


def _load(n=4):
    return InstanceLoad(range(n), LAT, load_model("llama-2-7b"), load_hardware("a100-80gb"))


def test_query_work_lands_on_the_instances_that_hold_the_prefix():
    load = _load()
    work = load.query_work([10, 1], [{0: 1000, 2: 500}, {2: 200}])
    assert set(work) == {0, 2}
    assert work[0] == pytest.approx((1e-7 * 10 + 1e-5) * 1000)
    assert work[2] == pytest.approx((1e-7 * 10 + 1e-5) * 500 + (1e-7 + 1e-5) * 200)
    # DoP 2: a request whose rows are in both sub-batches reads its prefix twice.
    assert parts_of([10, 1], 2) == [2, 1] and parts_of([4, 4], 2) == [1, 1]
    assert load.query_work([8], [{1: 100}], dop=2)[1] == pytest.approx((1e-7 * 8 + 2e-5) * 100)
    assert compute_s(LAT, [(10, 5000), (1, 9)], 2) == pytest.approx(0.01 + 1e-4 * 11 / 2)


def test_a_query_waits_for_the_busiest_instance_it_touches():
    load = _load()
    hot, other = object(), object()
    load.start(hot, 0.2, {0: 0.1, 1: 0.02})  # keeps instance 0's query engine half busy
    assert load.share(0) == pytest.approx(0.5) and load.share(1) == pytest.approx(0.1)
    assert load.share(0, exclude=hot) == 0.0
    f_c, f_q = load.factors(other, (3,), {0: 0.05, 2: 0.05})
    assert f_c == 1.0  # nothing else on instance 3
    assert f_q[0] == pytest.approx(2.0) and f_q[2] == 1.0
    f_c, _ = load.factors(other, (0, 3), {})
    assert f_c == pytest.approx(2.0)  # computing beside a busy query engine
    load.start(object(), 0.1, {0: 1.0})  # overloaded: capped
    assert load.share(0) == MAX_SHARE
    load.stop(hot)
    load.charge({0: 0.5, 2: 0.25}, 4)
    assert load.busy_s == {0: 2.0, 1: 0.0, 2: 1.0, 3: 0.0}


def test_query_messages_are_charged_to_the_home_and_every_remote_holder():
    """Per layer and sub-batch: the home handles the compute engine's query and one reply
    per remote holder; each remote holder handles one query."""
    lat = replace(LAT, query_message_s=1e-3)
    load = InstanceLoad(range(4), lat, load_model("llama-2-7b"), load_hardware("a100-80gb"))
    layers = load.model.num_layers
    got = load.message_work([{0: 64, 2: 64}, {3: 10, 1: 0}], (0,))
    assert got == pytest.approx({0: 1e-3 * layers * 3, 2: 1e-3 * layers, 3: 1e-3 * layers})
    two = load.message_work([{0: 64}], (0, 1))  # DoP 2: each sub-batch queries instance 0
    assert two == pytest.approx({0: 1e-3 * layers * 2, 1: 1e-3 * layers * 2})
    assert _load().message_work([{0: 64}], (0,)) == {}  # not measured: nothing charged
    with pytest.raises(Exception, match="query_message_s"):
        replace(LAT, query_message_s=-1.0)


def test_a_shared_host_adds_the_instances_query_work_up():
    """On the ``cpu`` profile every instance runs on the same cores: a query's time is the
    sum of its work on every instance, and a share is the whole host's."""
    shared = InstanceLoad(range(4), LAT, load_model("smollm2-135m"), load_hardware("cpu"))
    assert shared.hw.shared_host and not _load().hw.shared_host
    work = {0: 0.1, 2: 0.05}
    assert shared.query_s(work, lambda i: 1.0) == pytest.approx(0.15)
    assert _load().query_s(work, lambda i: 1.0) == pytest.approx(0.1)
    shared.start(object(), 1.0, {3: 0.2})
    assert shared.share(0) == pytest.approx(0.2)  # load on instance 3 is the host's


def test_communication_counts_only_instances_outside_the_run():
    load = _load()
    model, hw = load.model, load.hw
    assert load.comm_s([5], [{0: 100, 1: 100}], [0.0], (0, 1), 1) == 0.0  # all local
    got = load.comm_s([5], [{0: 100, 1: 100, 2: 50}], [0.5], (0,), 1)
    q = comm_bytes_per_query_layer(model)
    want = model.num_layers * (2 * hw.net_latency_s
                               + 5 * (2 * q + 0.5 * model.kv_bytes_per_token_layer) / hw.net_bw)
    assert got == pytest.approx(want)


def _hot_document(n=24, doc_tokens=8192, out=48, every_s=0.05):
    """``n`` questions on one document, one every ``every_s``: the document's few
    segments sit on few instances, which serve every query."""
    doc = tuple(range(7, 7 + doc_tokens))
    return [Request(f"h{i}", i * every_s, doc_tokens + 16, out,
                    token_ids=doc + tuple(range(90_000 + 16 * i, 90_016 + 16 * i))) for i in range(n)]


def test_a_hot_instance_slows_the_requests_and_replication_relieves_it():
    """One document of 2 segments read by 24 overlapping requests: without replication
    its two holders do all the query work and every decode step waits for them; with
    heavy-hitter replication the reads of the requests planned after it spread (the
    simulator picks a decode's replicas when it plans it) and decoding is faster. (Under the old
    model, where a batch paid its own prefix attention wherever it lived, replication
    could not change a simulated latency.)"""
    cfg = SimConfig(instances=4, cache_gb=20.0, segment_tokens=4096, chunk_tokens=512, tp=1,
                    latency=None, rebalance_s=1e9)
    reqs = _hot_document()
    alone = simulate(reqs, "tokenlake", cfg)
    spread = simulate(reqs, "tokenlake", replace(cfg, rebalance_s=0.05))
    busy = alone.extra["query_busy_s"]
    assert sum(1 for b in busy if b > 0.01 * sum(busy)) <= 3  # a few holders do the work
    assert spread.extra["replications"] > 0
    spread_busy = spread.extra["query_busy_s"]
    assert max(spread_busy) / sum(spread_busy) < max(busy) / sum(busy)
    assert spread.mean_tbt_s < alone.mean_tbt_s


def test_the_runs_of_one_decision_are_timed_to_their_fixed_point():
    """Two decode runs on instances 0 and 1, each reading half its prefix from the other's
    instance: each loads the other's query engine by ``q`` per iteration of ``T``, so
    ``T (1 - q/T) = C + q`` settles at ``T = C + 2q`` (plus communication). Timing each
    run once against the other's time alone would give ``(C + q)^2 / C``."""
    from types import SimpleNamespace

    from evals.sim.backend import Run
    from evals.sim.run_timing import RunTiming

    model, hw = load_model("llama-2-7b"), load_hardware("a100-80gb")
    lat = LatencyModel(c_const=0.01, c_new=0.0, c_new_prefix=0.0, c_new_sq=0.0, c_prefix=1e-6, c_request=0.0)
    prefix = 8000  # tokens on each instance: q = 8 ms of query work there per iteration
    reads = {"a": {0: prefix, 1: prefix}, "b": {0: prefix, 1: prefix}}
    backend = SimpleNamespace(
        setup=SimpleNamespace(latency=lat, model=model, hardware=hw, segment_tokens=64),
        instance_ids=[0, 1], planner=SimpleNamespace(reads=reads, grown={}),
        cp=SimpleNamespace(requests={}, home=lambda key: 0), chunk=512, config=SimConfig(grouped_reads=False))
    timing = RunTiming(backend)
    runs = [Run([SimpleNamespace(request_id=rid)], "decode", (g,), 1, None, 4) for rid, g in (("a", 0), ("b", 1))]
    timing.time(runs, [0.0, 0.0])
    c, q = 0.01, 1e-6 * prefix
    comm = timing.load.comm_s([1], [reads["a"]], [1.0], (0,), 1)
    for run in runs:
        assert run.sched.duration(1) == pytest.approx(c + 2 * q + comm, rel=0.02)
        assert run.sched.duration(1) < (c + q) ** 2 / c
