"""Validate the simulator against the real engines (issue #6, part 3).

The same small trace runs twice:

* **real**: SmolLM2-135M through the pool on a :class:`~tokenlake.deploy.local.LocalCluster`
  (the serving loop of ``make demo``: the real compute, query and transfer engines), every
  iteration timed by the wall clock;
* **simulated**: :func:`evals.sim.systems.simulate` with the ``cpu`` hardware profile, the
  ``smollm2-135m`` model and the latency model measured on this machine
  (``cpu_smollm2-135m``), the same instances, segment size, chunk size and KV capacity.

Both run the real control plane, so the hit rates must agree *exactly*; the mean
iteration latency is the latency model's prediction against the measurement and must
agree within 20%. The trace is LooGLE-like (a few documents, several questions each) and
single-turn, with well-separated arrivals so that the order of events is the same in
both runs (a question arrives after the previous one finished).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from evals.sim.config import SimConfig
from evals.sim.systems import simulate
from evals.workloads.base import Request
from scheduler.goodput import GoodputScheduler
from tokenlake.deploy.local import LocalCluster
from tokenlake.model.llama.weights import load_weights
from tokenlake.serving import GenerationRequest, Server

VOCAB = 49152


def validation_trace(documents: int = 3, questions: int = 4, doc_tokens: int = 600,
                     question_tokens: int = 24, output_tokens: int = 8, seed: int = 0,
                     gap_s: float = 1000.0) -> list[Request]:
    """Documents of random tokens, each asked ``questions`` questions; arrivals ``gap_s``
    apart, the documents interleaved (d0q0, d1q0, d2q0, d0q1, ...)."""
    rng = random.Random(seed)
    docs = [tuple(rng.randrange(100, VOCAB) for _ in range(doc_tokens)) for _ in range(documents)]
    out = []
    for q in range(questions):
        for d, doc in enumerate(docs):
            tokens = doc + tuple(rng.randrange(100, VOCAB) for _ in range(question_tokens))
            out.append(Request(f"d{d}q{q}", len(out) * gap_s, len(tokens), output_tokens, tokens))
    return out


@dataclass(frozen=True)
class RealRun:
    hit_rate: float
    hit_tokens: dict[str, int]
    iteration_s: list[float]
    wall_s: float


def run_real(trace: list[Request], instances: int, segment_tokens: int, chunk_tokens: int,
             pool_bytes: int) -> RealRun:
    """The trace through the real engines, one request at a time (its arrival order)."""

    weights = load_weights()
    spec = weights.config.to_model_spec("smollm2-135m")
    t0 = time.perf_counter()
    with LocalCluster(instances, spec, pool_bytes, segment_tokens=segment_tokens,
                      max_rows=max(chunk_tokens, 64)) as cluster:
        server = Server(cluster, weights, chunk_tokens=chunk_tokens, rebalance_every=0,
                        policy=GoodputScheduler(chunk_tokens=chunk_tokens, max_prefill_dop=1))
        times: list[float] = []
        for r in trace:
            server.submit(GenerationRequest(r.request_id, r.tokens(), r.output_length, ()))
            while not server.results[r.request_id].done:
                s = time.perf_counter()
                server.step()
                times.append(time.perf_counter() - s)
        res = server.results
    hits = {r.request_id: res[r.request_id].hit_tokens for r in trace}
    total = sum(r.input_length for r in trace)
    return RealRun(sum(hits.values()) / total, hits, times, time.perf_counter() - t0)


def validate(documents: int = 3, questions: int = 4, doc_tokens: int = 600, instances: int = 2,
             segment_tokens: int = 64, chunk_tokens: int = 256, seed: int = 0) -> dict[str, Any]:
    """Runs both and returns the comparison (see the module docstring)."""

    trace = validation_trace(documents, questions, doc_tokens, seed=seed)
    pool_bytes = 64 << 20  # per instance: room for every segment of the trace
    real = run_real(trace, instances, segment_tokens, chunk_tokens, pool_bytes)
    config = SimConfig(instances=instances, hardware="cpu", model="smollm2-135m",
                       latency="cpu_smollm2-135m", cache_gb=pool_bytes / 1e9,
                       segment_tokens=segment_tokens, chunk_tokens=chunk_tokens, tp=1,
                       max_prefill_dop=1, seed=seed)
    sim = simulate(trace, "tokenlake", config)
    # Requests never overlap (arrivals gap_s apart), so the simulated busy time is every
    # request's TTFT plus its inter-token gaps, spread over the simulated iterations.
    busy = sim.mean_ttft_s * sim.requests + sim.mean_tbt_s * (sim.generated_tokens - sim.requests)
    sim_iter = busy / sim.iterations if sim.iterations else None
    real_iter = statistics.fmean(real.iteration_s)
    rel = abs(sim_iter - real_iter) / real_iter if sim_iter is not None else None
    return {
        "requests": len(trace),
        "input_tokens": sum(r.input_length for r in trace),
        "hit_rate": {"real": real.hit_rate, "sim": sim.hit_rate,
                     "equal": abs(real.hit_rate - sim.hit_rate) < 1e-12},
        "mean_iteration_s": {"real": real_iter, "sim": sim_iter, "rel_err": rel,
                             "within_20pct": rel is not None and rel <= 0.2},
        "iterations": {"real": len(real.iteration_s), "sim": sim.iterations},
        "real_wall_s": real.wall_s,
        "setup": {"instances": instances, "segment_tokens": segment_tokens,
                  "chunk_tokens": chunk_tokens, "documents": documents, "questions": questions,
                  "doc_tokens": doc_tokens},
    }
