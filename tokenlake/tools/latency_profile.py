"""Profile the real CPU compute engine and fit its latency model (paper §6.1).

The scheduler predicts iteration times with :class:`~tokenlake.core.cost_model.LatencyModel`
(quadratic in new and prefix tokens). For the A100 the coefficients come from a
roofline; for this machine they are *measured* here: a :class:`LocalCluster` of
SmolLM2-135M instances is seeded with a cached document, then batches of
``(new tokens, prefix tokens)`` pairs -- chunked prefills, decode batches, two
prefills batched -- are planned by the real control plane and run by the
real stateless :class:`~tokenlake.engines.compute.ComputeEngine` through the pool, each timed
end to end (plans, compute, queries, puts). Each sample is aborted afterwards, so the
pool holds only the seed document throughout.

    tokenlake profile-latency --out tokenlake/data/latency/cpu_smollm2-135m.json

writes the coefficients, the fit report and the sampled grid as data; the scheduler of
the serving loop loads them with ``LatencyModel.load("cpu_smollm2-135m")``.

    tokenlake profile-latency --out tokenlake/data/latency/cpu_smollm2-135m.json --dop-speedup

adds the measured speed-up of a prefill chunk at DoP 1..N on one compute engine per
instance (:func:`measure_dop_speedup`) to that file (``dop_speedup``, which
:class:`~tokenlake.core.cost_model.LatencyModel` divides by instead of the DoP).
"""

from __future__ import annotations

import random
import time
from typing import Any

from tokenlake.core.cost_model import (
    LatencyModel,
    LatencySample,
    default_segment_tokens,
    fit_report,
)
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.core.specs import load_hardware

NAME = "cpu_smollm2-135m"
#: Every profile runs with each query engine attending its own slab only, as the simulator
#: models an instance (its query engine serves the segments it holds; a query reaches
#: every holder) and as ``tokenlake eval validate`` runs the real engines. With shared
#: slabs (``tokenlake serve``'s default on one host) the home's engine reads its peers'
#: slots itself, no remote holder is asked, and a decode step costs less.
SHARE_SLABS = False


def _grid(rng: random.Random, n_samples: int, max_prefix: int, segment: int, instances: int,
          max_rows: int) -> list[tuple[tuple[tuple[int, int], ...], int]]:
    """Sample batches: ``((new, prefix) per request, k)``; prefixes are whole segments.

    All on one instance (``k = 1``): a :class:`LocalCluster` has one compute engine, so
    a batch spread over k instances is computed by the same process and only adds
    messages (measured: a 1,024-token chunk took 4.9 s at k = 3 and 8.0 s at k = 4
    against ~2.5 s at k = 1). The model's ``1/k`` terms describe clusters whose
    instances compute in parallel; the serving loop on this machine caps DoP at 1.
    """
    prefixes = [p * segment for p in range(max_prefix // segment + 1)]
    out = []
    for i in range(n_samples):
        kind = i % 3
        if kind == 0:  # decode batch
            b = rng.choice((1, 2, 4, 8, 16))
            reqs = tuple((1, rng.choice(prefixes)) for _ in range(b))
            out.append((reqs, 1))
        elif kind == 1:  # one chunked prefill on one instance
            n = rng.choice((16, 64, 128, 256, 512, max_rows))
            out.append((((min(n, max_rows), rng.choice(prefixes)),), 1))
        else:  # two prefills batched
            n = rng.choice((128, 256, 512))
            out.append((((n, rng.choice(prefixes)), (n // 2, rng.choice(prefixes))), 1))
    return out


class _Setup:
    """What every measurement here starts from: SmolLM2's weights and spec, the segment
    size, a random document of ``prefix`` tokens (a whole number of segments) and the
    seeded random stream the samples draw from."""

    def __init__(self, segment_tokens: int | None, prefix: int, seed: int) -> None:
        from tokenlake.model.llama.weights import load_weights  # torch: only when measuring

        self.weights = load_weights()
        self.spec = spec = self.weights.config.to_model_spec("smollm2-135m")
        self.C = segment_tokens or default_segment_tokens(spec, load_hardware("cpu"))
        self.prefix = prefix - prefix % self.C
        self.rng = random.Random(seed)
        self.doc = tuple(self.rng.randrange(100, self.weights.config.vocab_size) for _ in range(self.prefix))
        self.seg_bytes = spec.num_layers * 2 * spec.num_kv_heads * self.C * spec.head_dim * 4

    def seed_document(self, cluster, engine, rows: int) -> None:
        """Puts the document into the pool (``rows`` tokens an iteration): every sample's
        cached prefix comes from it."""
        cp = cluster.control
        for i in range(0, self.prefix, rows):
            batch = Batch((BatchRequest("seed", self.doc[i : i + rows]),))
            plans = cp.gen_plans([batch], [1])
            engine.run(plans, [batch])
            cp.complete(plans)
        cp.finish_request("seed")


def profile(n_samples: int = 60, instances: int = 2, max_prefix: int = 4096,
            segment_tokens: int | None = None, seed: int = 0, repeats: int = 2,
            progress=None) -> dict[str, Any]:
    """Measures ``n_samples`` batches (best of ``repeats`` runs each) and fits the model.

    Returns the JSON document to commit (coefficients, fit report, setup, samples).
    """
    # Imported here: the command line reads this module's defaults, and must not load
    # torch to print its help.
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.engines.compute import ComputeEngine
    from tokenlake.kernels.native import machine_info

    st = _Setup(segment_tokens, max_prefix, seed)
    weights, spec, C, max_prefix, rng, doc = st.weights, st.spec, st.C, st.prefix, st.rng, st.doc
    max_rows = 1024
    grid = _grid(rng, n_samples, max_prefix, C, instances, max_rows)
    slots = max_prefix // C + 2 * 16 + 8  # the document plus every sample's open tails
    samples: list[LatencySample] = []
    with LocalCluster(instances, spec, (slots // instances + 8) * st.seg_bytes, segment_tokens=C,
                      max_rows=max_rows, share_slabs=SHARE_SLABS) as cluster:
        cp, engine = cluster.control, ComputeEngine(weights, cluster)
        st.seed_document(cluster, engine, max_rows)
        for idx, (reqs, k) in enumerate(grid):
            best = float("inf")
            for rep in range(repeats):
                batch = Batch(tuple(
                    BatchRequest(f"s{idx}-{rep}-{j}", tuple(rng.randrange(100, 30000) for _ in range(n)),
                                 doc[:p]) for j, (n, p) in enumerate(reqs)))
                t0 = time.perf_counter()
                plans = cp.gen_plans([batch], [k])
                engine.run(plans, [batch])
                best = min(best, time.perf_counter() - t0)
                cp.abort(plans)  # un-admits the requests: the pool keeps only the document
            samples.append(LatencySample(reqs, k, best))
            if progress:
                progress(idx + 1, len(grid))
    model = LatencyModel.fit(samples)
    return {
        "hardware": "cpu",
        "model": "smollm2-135m",
        "source": "measured: tokenlake.tools.latency_profile (real compute engine through the pool)",
        "machine": machine_info(),  # what the figures hold for (tokenlake eval validate compares)
        "setup": {"instances": instances, "segment_tokens": C, "max_prefix": max_prefix,
                  "repeats": repeats, "seed": seed, "share_slabs": SHARE_SLABS},
        "coefficients": model.to_dict(),
        "fit": fit_report(model, samples),
        "samples": [{"requests": [list(r) for r in s.requests], "k": s.k, "seconds": s.seconds}
                    for s in samples],
    }


def measure_dop_speedup(instances: int = 4, rows: tuple[int, ...] = (512, 1024), prefix: int = 2048,
                        segment_tokens: int | None = None, repeats: int = 3, seed: int = 0,
                        progress=None) -> dict[str, Any]:
    """How much faster a prefill chunk of ``rows`` new tokens over a cached ``prefix``
    computes at DoP ``k`` than at DoP 1, for ``k = 1 .. instances``, on one compute engine
    per instance (:class:`~tokenlake.engines.compute.ParallelComputeEngine`): best of
    ``repeats`` runs each, the DoPs interleaved within every repeat, the median ratio
    over ``rows``. Returns ``{"dop_speedup": [1.0, s_2, ...], "dop_setup": {...}}``."""
    import statistics

    from tokenlake.deploy.local import LocalCluster
    from tokenlake.engines.compute import ParallelComputeEngine

    st = _Setup(segment_tokens, prefix, seed)
    spec, C, prefix, rng, doc = st.spec, st.C, st.prefix, st.rng, st.doc
    max_rows = max(rows)
    best: dict[tuple[int, int], float] = {}
    with LocalCluster(instances, spec, (prefix // C // instances + 2 * instances + 8) * st.seg_bytes,
                      segment_tokens=C, max_rows=max_rows, share_slabs=SHARE_SLABS) as cluster:
        cp, engine = cluster.control, ParallelComputeEngine(st.weights, cluster)
        try:
            st.seed_document(cluster, engine, max_rows)
            for rep in range(repeats):
                for n in rows:
                    for k in range(1, instances + 1):
                        batch = Batch((BatchRequest(f"d{rep}-{n}-{k}", tuple(rng.randrange(100, 30000)
                                                                           for _ in range(n)), doc),))
                        t0 = time.perf_counter()
                        plans = cp.gen_plans([batch], [k])
                        engine.run(plans, [batch])
                        took = time.perf_counter() - t0
                        cp.abort(plans)
                        best[(n, k)] = min(best.get((n, k), float("inf")), took)
                if progress:
                    progress(rep + 1, repeats)
        finally:
            engine.close()
    speedup = [1.0] + [statistics.median(best[(n, 1)] / best[(n, k)] for n in rows)
                       for k in range(2, instances + 1)]
    return {"dop_speedup": speedup,
            "dop_setup": {"instances": instances, "rows": list(rows), "prefix": prefix,
                          "segment_tokens": C, "repeats": repeats,
                          "seconds": {f"{n}x{k}": best[(n, k)] for n, k in sorted(best)}}}


def measure_query_engine(coefficients: dict[str, float], instances: int = 4, prefix: int = 2048,
                         segment_tokens: int | None = None, repeats: int = 3, seed: int = 0,
                         progress=None) -> dict[str, Any]:
    """What one query message costs a query engine: decode batches and prefill chunks over
    a cached ``prefix`` run through the pool (one compute engine), and each instance's
    query-engine busy time (``engine_stats``) is set against the attention work the
    latency model's prefix terms (``coefficients``) give it, times ``work_scale``, plus
    ``message_s`` per message it handled (per layer and sub-batch: the home takes the
    compute engine's query and each remote holder's reply, a remote holder the home's
    query); both fitted by non-negative least squares on relative error. (``work_scale``
    is not 1: the prefix terms are fitted on whole iterations, in which the instances'
    query engines work at once on two cores.) Returns ``{"query_engine": {"message_s",
    "work_scale", "residual", "setup"}}``; ``residual`` is the mean relative error of that
    model over the (sample, instance) pairs."""
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.engines.compute import ComputeEngine

    st = _Setup(segment_tokens, prefix, seed)
    spec, C, prefix, rng, doc = st.spec, st.C, st.prefix, st.rng, st.doc
    c_np, c_p = coefficients["c_new_prefix"], coefficients["c_prefix"]
    shapes = [(1, 1), (4, 1), (8, 1), (1, 128), (1, 256)]  # (requests, new tokens each)
    rows: list[tuple[float, float, int]] = []  # (busy, attention work, messages)
    with LocalCluster(instances, spec, (prefix // C // instances + 4 * instances + 8) * st.seg_bytes,
                      segment_tokens=C, max_rows=512, share_slabs=SHARE_SLABS) as cluster:
        cp, engine = cluster.control, ComputeEngine(st.weights, cluster)
        st.seed_document(cluster, engine, 512)
        for rep in range(repeats):
            for n_req, new in shapes:
                batch = Batch(tuple(BatchRequest(f"q{rep}-{n_req}-{new}-{j}",
                                                 tuple(rng.randrange(100, 30000) for _ in range(new)), doc)
                                    for j in range(n_req)))
                plans = cp.gen_plans([batch], [1])
                before = {i: p.busy_s for (role, i), p in cluster.engine_stats().items() if role == "query"}
                engine.run(plans, [batch])
                after = {i: p.busy_s for (role, i), p in cluster.engine_stats().items() if role == "query"}
                cp.abort(plans)
                work, msgs = _plan_query_load(plans, spec.num_layers, c_np, c_p)
                rows.extend((after[i] - before[i], work.get(i, 0.0), msgs.get(i, 0)) for i in after)
            if progress:
                progress(rep + 1, repeats)
    import numpy as np
    from scipy.optimize import nnls

    busy = np.array([b for b, _, _ in rows])
    x = np.array([[m, w] for _, w, m in rows]) / busy[:, None]  # relative error, as the model fit
    (alpha, scale), _ = nnls(x, np.ones(len(rows)))
    resid = [abs(scale * w + alpha * m - b) / b for b, w, m in rows if b > 0]
    return {"query_engine": {"message_s": float(alpha), "work_scale": float(scale),
                             "residual": sum(resid) / len(resid),
                             "setup": {"instances": instances, "prefix": prefix, "segment_tokens": C,
                                       "shapes": shapes, "repeats": repeats}}}


def _plan_query_load(plans, layers: int, c_np: float, c_p: float) -> tuple[dict[int, float], dict[int, int]]:
    """Attention work (s) and query messages per instance of one iteration's plans."""
    work: dict[int, float] = {}
    msgs: dict[int, int] = {}
    for qp in plans.query_plans:
        remote = set()
        for inst, items in qp.tasks_by_instance().items():
            for it in items:
                work[inst] = work.get(inst, 0.0) + (c_np * (it.stop - it.start) + c_p) * sum(it.tokens)
            if inst != qp.home:
                remote.add(inst)
                msgs[inst] = msgs.get(inst, 0) + layers
        msgs[qp.home] = msgs.get(qp.home, 0) + layers * (1 + len(remote))
    return work, msgs
