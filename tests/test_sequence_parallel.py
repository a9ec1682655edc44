"""Sequence parallelism for real (issue #20): one compute engine per instance, the
sub-batches of a DoP > 1 prefill computed at once, exchanging the new K/V of a request
that crosses a split; outputs equal the reference engine's.

The small Llama of tests/tiny_model.py serves (reference answers computed once per run
and checked for clear margins; pools of the 68 segments 48 MiB held of SmolLM2), but for
the test that the two sub-batches' runs overlap in time: that needs runs long enough that
starting the second thread cannot outlast the first run, which SmolLM2's 30 layers are."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tiny_model import model_spec, pool_bytes

from scheduler.baselines.fcfs import FCFS
from tokenlake.core.errors import EngineUnavailable, PlanError
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.compute import ParallelComputeEngine
from tokenlake.engines.exchange import LocalExchange
from tokenlake.generation import GenerationLoop, GenerationRequest

C = 16
NEW = 5
SLOTS = 68  # segments per instance (what 48 MiB held of SmolLM2)


def _prompts(tok):
    doc = ("The lighthouse on Gull Point was built in 1871 from granite quarried on the island. "
           "Its first keeper, Ada Morrow, kept a log of every ship for thirty-one years. ") * 3
    qs = ["Who was the first keeper?", "When was the lighthouse built?"]
    return [tuple(tok.apply_chat_template([{"role": "user", "content": f"{doc}\n{q}"}])) for q in qs]


def _check(results, prompts, ref, tok):
    for i, prompt in enumerate(prompts):
        res = results[f"r{i}"]
        expected = ref.generate(list(prompt), NEW, stop_ids=(tok.eos_id,))
        assert res.output_ids == list(expected.output_ids)
        for got, want in zip(res.logits, expected.logits):
            assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("dop", [2, 4])
def test_a_dop_k_prefill_on_k_compute_engines_equals_the_reference(tiny_llama, dop):
    """Every prefill chunk is split over ``dop`` instances (chunks of 64 rows cross
    segment and sub-batch boundaries); the second request reuses the first's prefix.
    Outputs are token-identical and logits within 1e-4 of the reference engine."""
    weights, tok, ref = tiny_llama
    prompts = _prompts(tok)
    with LocalCluster(4, model_spec(weights), pool_bytes(weights, C, SLOTS), segment_tokens=C, max_rows=512) as cluster:
        engine = ParallelComputeEngine(weights, cluster)
        server = GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True, engine=engine,
                        policy=FCFS(64, prefill_dop=dop))
        assert server.compute_slots == 4
        server.run([GenerationRequest("r0", prompts[0], NEW, (tok.eos_id,))])
        server.run([GenerationRequest("r1", prompts[1], NEW, (tok.eos_id,))])
        engine.close()
        results = server.results
    prefills = [b for d in server.decisions for b in d.batches if b.phase == "prefill"]
    assert prefills and all(b.dop == dop for b in prefills)
    assert results["r1"].hit_tokens > 0
    _check(results, prompts, ref, tok)


def test_the_server_s_default_policy_splits_prefill_when_engines_compute_at_once(tiny_llama):
    """With an engine per instance the default goodput DP may use every instance for a
    prefill (here the latency model makes a split pay, so it does); with the one serial
    engine it keeps DoP 1. Output equals the reference either way."""
    from tokenlake.core.cost_model import LatencyModel

    weights, tok, ref = tiny_llama
    latency = LatencyModel(c_const=1e-3, c_new=1e-3, c_new_prefix=0.0, c_new_sq=0.0, c_prefix=1e-6, c_request=1e-4)
    prompts = _prompts(tok)[:1]
    with LocalCluster(2, model_spec(weights), pool_bytes(weights, C, SLOTS), segment_tokens=C, max_rows=512) as cluster:
        serial = GenerationLoop(cluster, weights, chunk_tokens=64, latency=latency)
        assert serial.policy.max_prefill_dop == 1
        engine = ParallelComputeEngine(weights, cluster)
        server = GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True, engine=engine, latency=latency)
        server.run([GenerationRequest("r0", prompts[0], NEW, (tok.eos_id,))])
        engine.close()
    assert server.compute_slots == 2 and server.policy.max_prefill_dop is None
    assert server.decisions[0].batches[0].dop == 2
    _check(server.results, prompts, ref, tok)


def test_the_sub_batches_of_a_dop_2_batch_compute_at_the_same_time(smollm2):
    """The two sub-batches run on two threads whose runs overlap in time (the second
    waits for the first's K/V layer by layer, so it cannot end before the first ends):
    both are inside their run at once (a barrier of two at the entry, which breaks after
    a minute if the engine ran them one after the other)."""
    weights, tok, _ = smollm2
    runs, both = [], threading.Barrier(2, timeout=60)
    with LocalCluster(2, model_spec(weights), pool_bytes(weights, C, SLOTS), segment_tokens=C, max_rows=512) as cluster:
        engine = ParallelComputeEngine(weights, cluster)
        inner = engine.run_part

        def timed(batch, qp, tp, exchange):
            both.wait()
            t0 = time.perf_counter()
            try:
                return inner(batch, qp, tp, exchange)
            finally:
                runs.append((qp.part, threading.get_ident(), t0, time.perf_counter()))

        engine.run_part = timed
        server = GenerationLoop(cluster, weights, chunk_tokens=64, engine=engine, policy=FCFS(64, prefill_dop=2))
        # one chunk: a single DoP 2 iteration, its two sub-batches of 32 rows
        server.run([GenerationRequest("r0", _prompts(tok)[0][:64], 1, ())])
        engine.close()
    assert len(runs) == 2
    first = sorted(r for r in runs)[:2]
    (p0, t0, a0, z0), (p1, t1, a1, z1) = sorted(runs, key=lambda r: r[2])[:2]
    assert {p0, p1} == {0, 1} and t0 != t1
    assert a1 < z0 and a0 < z1, first  # the intervals overlap


def test_a_failed_sub_batch_fails_the_iteration_at_once_and_serving_goes_on(tiny_llama):
    """Sub-batch 0 fails at a middle layer of the first DoP 2 iteration: the iteration
    raises that error (sub-batch 1 stops waiting for its rows), the plans are aborted, and
    the next run still gives the reference's output."""
    weights, tok, ref = tiny_llama
    middle = weights.config.num_layers // 2
    assert 0 < middle < weights.config.num_layers - 1
    prompts = _prompts(tok)
    with LocalCluster(2, model_spec(weights), pool_bytes(weights, C, SLOTS), segment_tokens=C, max_rows=512) as cluster:
        engine = ParallelComputeEngine(weights, cluster, timeout_s=120)
        inner = engine._attention
        armed = [True]

        def failing(layer, q, k, v, buf, lay, exchange, qp, put=True):
            if armed[0] and qp.part == 0 and layer == middle:
                armed[0] = False
                raise RuntimeError("injected")
            return inner(layer, q, k, v, buf, lay, exchange, qp, put)

        engine._attention = failing
        server = GenerationLoop(cluster, weights, chunk_tokens=64, keep_logits=True, engine=engine,
                        policy=FCFS(64, prefill_dop=2))
        server.submit(GenerationRequest("r0", prompts[0], NEW, (tok.eos_id,)))
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="injected"):
            server.step()
        assert time.monotonic() - t0 < 60  # not the exchange's timeout
        server.run()
        server.run([GenerationRequest("r1", prompts[1], NEW, (tok.eos_id,))])
        engine.close()
        results = server.results
    _check(results, prompts, ref, tok)


# ------------------------------------------------------------------- exchange


def _kv(n, fill):
    return torch.full((n, 2, 4), float(fill)), torch.full((n, 2, 4), float(-fill))


def test_exchange_collects_a_request_s_rows_from_the_earlier_parts_in_order():
    ex = LocalExchange(timeout_s=5)
    ex.publish(0, 0, 3, "a", *_kv(2, 1))  # part 0 ends with 2 rows of "a"
    ex.publish(0, 1, 3, "a", *_kv(3, 2))  # part 1 is all "a"
    k, v = ex.collect(0, 2, 3, "a", 5)
    assert k[:, 0, 0].tolist() == [1, 1, 2, 2, 2] and v[:, 0, 0].tolist() == [-1, -1, -2, -2, -2]
    k, _ = ex.collect(0, 1, 3, "a", 2)
    assert k[:, 0, 0].tolist() == [1, 1]
    with pytest.raises(PlanError, match="ends with request"):
        ex.collect(0, 2, 3, "b", 3)
    with pytest.raises(PlanError, match="rows"):
        ex.collect(0, 2, 3, "a", 4)  # 3 then 5 rows: never exactly 4
    with pytest.raises(PlanError, match="needs 9 rows"):
        ex.collect(0, 2, 3, "a", 9)


def test_exchange_waits_for_rows_published_later_and_gives_up_on_failure_or_timeout():
    ex = LocalExchange(timeout_s=30)
    got = []
    t = threading.Thread(target=lambda: got.append(ex.collect(1, 1, 0, "x", 2)))
    t.start()
    ex.publish(1, 0, 0, "x", *_kv(2, 7))
    t.join(10)
    assert got and got[0][0][:, 0, 0].tolist() == [7, 7]

    errors = []

    def waiter():
        try:
            ex.collect(2, 1, 0, "y", 1)
        except EngineUnavailable as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    ex.fail(RuntimeError("boom"))
    t.join(10)
    assert not t.is_alive() and "boom" in str(errors[0])
    assert isinstance(ex.error, RuntimeError)
    with pytest.raises(EngineUnavailable, match="within"):
        LocalExchange(timeout_s=0.05).collect(0, 1, 0, "z", 1)
