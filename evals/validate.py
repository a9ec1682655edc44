"""Validate the simulator against the real engines (issues #6 and #20).

The same small trace runs twice:

* **real**: SmolLM2-135M through the pool on a :class:`~tokenlake.deploy.local.LocalCluster`
  with one compute engine per instance (:class:`~tokenlake.engines.compute.ParallelComputeEngine`),
  the real query and transfer engines, every iteration timed by the wall clock and each
  instance's query-engine busy time read from the engine (``engine_stats``);
* **simulated**: the TokenLake backend with the ``cpu`` hardware profile, the
  ``smollm2-135m`` model and the latency model measured on this machine
  (``cpu_smollm2-135m``, with its measured DoP speed-up), the same instances, segment
  size, chunk size, KV capacity and policy.

The policy is first-come-first-served with a fixed prefill DoP (``FCFS(prefill_dop=d)``)
in both, so both run the same batches. Heavy-hitter replication runs in both (every
iteration in the real run, every ``rebalance_s`` simulated seconds). The trace is
LooGLE-like with one **hot document** (most questions ask about it), single-turn,
arrivals well separated so that events happen in the same order in both runs.

What is compared: the mean iteration latency (``iteration_latency_error``) and each
instance's query-engine busy time, the real engines' handling time against the
simulator's query work charged to that instance (``per_instance_busy_error``: the
largest relative error over the instances); both should be within 20%. Hit rates agree
exactly *by construction* -- both sides run the same control plane on the same
requests -- so that equality is a consistency check, not a validation of the model.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from evals.sim.config import SimConfig
from evals.sim.pooled import PooledBackend
from evals.workloads.base import Request
from scheduler.baselines.fcfs import FCFS
from tokenlake.core.cost_model import LatencyModel
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.compute import ParallelComputeEngine
from tokenlake.generation import GenerationLoop, GenerationRequest
from tokenlake.kernels.native import machine_info, same_machine
from tokenlake.model.llama.weights import load_weights

VOCAB = 49152
#: The latency model the simulated side uses (tokenlake/data/latency/).
LATENCY = "cpu_smollm2-135m"


def validation_trace(documents: int = 3, questions: int = 4, doc_tokens: int = 600,
                     question_tokens: int = 24, output_tokens: int = 8, seed: int = 0,
                     gap_s: float = 1000.0, hot: int = 0) -> list[Request]:
    """Documents of random tokens, each asked ``questions`` questions (document 0
    ``hot`` more); arrivals ``gap_s`` apart, the documents interleaved (d0q0, d1q0,
    d2q0, d0q1, ...), the hot document's extra questions last."""
    rng = random.Random(seed)
    docs = [tuple(rng.randrange(100, VOCAB) for _ in range(doc_tokens)) for _ in range(documents)]
    asks = [(d, q) for q in range(questions) for d in range(documents)]
    asks += [(0, questions + q) for q in range(hot)]
    out = []
    for d, q in asks:
        tokens = docs[d] + tuple(rng.randrange(100, VOCAB) for _ in range(question_tokens))
        out.append(Request(f"d{d}q{q}", len(out) * gap_s, len(tokens), output_tokens, tokens))
    return out


@dataclass(frozen=True)
class RealRun:
    hit_rate: float
    hit_tokens: dict[str, int]
    iteration_s: list[float]
    query_busy_s: list[float]
    max_dop: int
    wall_s: float


def run_real(trace: list[Request], instances: int, segment_tokens: int, chunk_tokens: int,
             pool_bytes: int, dop: int = 1) -> RealRun:
    """The trace through the real engines, one request at a time (its arrival order)."""

    weights = load_weights()
    spec = weights.config.to_model_spec("smollm2-135m")
    t0 = time.perf_counter()
    # share_slabs=False: the simulator models instances on separate hosts (each query
    # engine attends its own slab, replication spreads the reads)
    with LocalCluster(instances, spec, pool_bytes, segment_tokens=segment_tokens,
                      max_rows=max(chunk_tokens, 64), share_slabs=False) as cluster:
        engine = ParallelComputeEngine(weights, cluster)
        server = GenerationLoop(cluster, weights, chunk_tokens=chunk_tokens, rebalance_every=1, engine=engine,
                        policy=FCFS(chunk_tokens, prefill_dop=dop))
        before = _query_busy(cluster)
        times: list[float] = []
        try:
            for r in trace:
                server.submit(GenerationRequest(r.request_id, r.tokens(), r.output_length, ()))
                while not server.results[r.request_id].done:
                    s = time.perf_counter()
                    server.step()
                    times.append(time.perf_counter() - s)
        finally:
            engine.close()
        after = _query_busy(cluster)
        res = server.results
    hits = {r.request_id: res[r.request_id].hit_tokens for r in trace}
    total = sum(r.input_length for r in trace)
    busy = [after[i] - before[i] for i in range(instances)]
    top = max(b.dop for d in server.decisions for b in d.batches)
    return RealRun(sum(hits.values()) / total, hits, times, busy, top, time.perf_counter() - t0)


def latency_machine(name: str = LATENCY) -> dict[str, Any]:
    """The machine the latency model ``name`` was measured on, this one, and whether they
    are the same: on another CPU the simulated side describes that machine, not the
    engines measured here (re-measure with ``tokenlake profile-latency``)."""
    doc = LatencyModel.document(name)
    here = machine_info()
    return {"name": name, "measured_on": doc.get("machine"), "this_machine": here,
            "same_machine": same_machine(doc.get("machine"), here)}


def _query_busy(cluster) -> dict[int, float]:
    return {i: pong.busy_s for (role, i), pong in cluster.engine_stats().items() if role == "query"}


def validate(documents: int = 3, questions: int = 3, doc_tokens: int = 600, instances: int = 4,
             segment_tokens: int = 64, chunk_tokens: int = 256, seed: int = 0, dop: int = 2,
             hot: int = 6) -> dict[str, Any]:
    """Runs both and returns the comparison (see the module docstring)."""

    trace = validation_trace(documents, questions, doc_tokens, seed=seed, hot=hot)
    pool_bytes = 64 << 20  # per instance: room for every segment of the trace
    real = run_real(trace, instances, segment_tokens, chunk_tokens, pool_bytes, dop)
    config = SimConfig(instances=instances, hardware="cpu", model="smollm2-135m",
                       latency=LATENCY, cache_gb=pool_bytes / 1e9,
                       segment_tokens=segment_tokens, chunk_tokens=chunk_tokens, tp=1,
                       max_prefill_dop=dop, rebalance_s=statistics.fmean(real.iteration_s), seed=seed)
    backend = PooledBackend(config.resolve(), "tokenlake", FCFS(chunk_tokens, prefill_dop=dop))
    sim = backend.simulate(trace)
    # Requests never overlap (arrivals gap_s apart), so the simulated busy time is every
    # request's TTFT plus its inter-token gaps, spread over the simulated iterations.
    busy = sim.mean_ttft_s * sim.requests + sim.mean_tbt_s * (sim.generated_tokens - sim.requests)
    sim_iter = busy / sim.iterations if sim.iterations else None
    real_iter = statistics.fmean(real.iteration_s)
    rel = abs(sim_iter - real_iter) / real_iter if sim_iter is not None else None
    sim_busy = sim.extra["query_busy_s"]
    busy_err = [abs(s - r) / r if r > 0 else None for s, r in zip(sim_busy, real.query_busy_s)]
    worst = max((e for e in busy_err if e is not None), default=None)
    return {
        "instances": instances,
        "max_dop": real.max_dop,
        "iteration_latency_error": rel,
        "per_instance_busy_error": worst,
        "requests": len(trace),
        "input_tokens": sum(r.input_length for r in trace),
        "hit_rate": {"real": real.hit_rate, "sim": sim.hit_rate,
                     "equal": abs(real.hit_rate - sim.hit_rate) < 1e-12,
                     "note": "equal by construction: both run the same control plane"},
        "mean_iteration_s": {"real": real_iter, "sim": sim_iter, "rel_err": rel,
                             "within_20pct": rel is not None and rel <= 0.2},
        "query_busy_s": {"real": real.query_busy_s, "sim": sim_busy, "rel_err": busy_err,
                         "within_20pct": worst is not None and worst <= 0.2},
        "replications": sim.extra["replications"],
        "iterations": {"real": len(real.iteration_s), "sim": sim.iterations},
        "real_wall_s": real.wall_s,
        "latency_model": latency_machine(),
        "setup": {"instances": instances, "segment_tokens": segment_tokens, "dop": dop,
                  "chunk_tokens": chunk_tokens, "documents": documents, "questions": questions,
                  "hot_questions": hot, "doc_tokens": doc_tokens},
    }
