"""The paper's §7 experiments on the simulator, one function (and one command) each.

=================  ===========================================================  ==========
experiment         what it measures                                              paper
=================  ===========================================================  ==========
``e2e``            input/output token latency and SLO attainment versus rate,    Fig. 9
                   P90 goodput, per workload and system
``load-balance``   CV of per-instance cache accesses over time                   Fig. 10
``hit-rate``       hit rate versus KV-cache size per instance (LooGLE)           Fig. 11
``elasticity``     latency of TokenLake-1P3D / -3P1D / Elastic and the           Fig. 12
                   MoonCake baselines versus cache size
``multi-node``     16 instances, LooGLE + SCBench + ShareGPT mixed 1:1:1         Fig. 13
=================  ===========================================================  ==========

Every experiment returns an :class:`ExperimentResult`: ``rows`` (one per simulated run,
flat, for CSV), ``summary`` (the figures the report compares with the paper) and
``series`` (for plots). Metrics are the simulator's (paper §7 definitions, see
``docs/simulator.md``): input token latency = TTFT / input length, output token
latency = TBT, SLO = both under 10x their batch-size-1 time, P90 goodput = the highest
request rate at which at least 90% of requests meet the SLO.

Workloads are seeded synthetic LooGLE and SCBench (their published statistics) and the
packaged ShareGPT; sessions start on a seeded Poisson process and their turns follow
each other (closed loop); ``scale`` shrinks request
counts and document lengths together so that a quick run keeps the workload's shape.
"""

from __future__ import annotations

import math
import multiprocessing
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from evals.sim.backend import SimulationError
from evals.sim.config import SimConfig
from evals.sim.metrics import SimResult
from evals.sim.systems import simulate
from evals.sim.trace import trace_grid
from evals.workloads import (
    load_sharegpt,
    synthetic_loogle,
    synthetic_scbench,
    with_session_arrivals,
)
from evals.workloads.base import Request

MAIN_SYSTEMS = ("tokenlake", "sglang-router", "mooncake-1p3d", "mooncake-3p1d", "banaserve")
WORKLOADS = ("loogle", "scbench", "sharegpt")

#: The paper's §7 figures the report puts beside ours (8 x A100, Llama-2-7B).
PAPER = {
    "p90_goodput_ratio": {
        "loogle": {"mooncake-1p3d": 2.08, "mooncake-3p1d": 2.04},
        "scbench": {"sglang-router": 2.55},
        "sharegpt": {"mooncake-1p3d": 3.71, "mooncake-3p1d": 1.56},
    },
    "mean_cv": {"tokenlake": 0.11, "sglang-router": 0.99, "mooncake-1p3d": 0.62,
                "mooncake-3p1d": 1.22},
    "hit_rate_ratio": {"sglang-router": (1.72, 2.04), "mooncake-1p3d": (1.67, 2.14),
                       "mooncake-3p1d": (1.78, 2.70)},
    "elastic_latency_gain": {"tokenlake-1p3d": 5.22, "tokenlake-3p1d": 2.82},
}

#: Requests per workload at ``scale=1``. Sized so that every run lasts long enough to
#: reach a steady state at the top of its rate sweep, and so that LooGLE's documents
#: (~65 of ~24K tokens, 1.5x the pool of the default 8 x A100 cluster) do not all fit in
#: the cache: the paper's LooGLE results come from "limited local cache size".
BASE_REQUESTS = {"loogle": 1000, "scbench": 600, "sharegpt": 3000}

#: Request rates (req/s) per workload at ``scale=1`` on the default 8 x A100 cluster,
#: calibrated on the simulator (see docs/evaluation.md) so that each sweep brackets the
#: SLO-attainment knee of every main system that has one: LooGLE's 1P3D falls below 90%
#: between 1 and 2 req/s, the store between 3 and 4, 3P1D between 6 and 7, TokenLake
#: between 14 and 16 (the router never reaches it); SCBench's 1P3D at 1-2, router and
#: store 3-4, 3P1D 6-8, TokenLake 10-12; ShareGPT's 3P1D 16-24, 1P3D 64-96, router
#: 96-128, the store 192-256, TokenLake above 384; the mix on 16 instances: 1P3D and the
#: store 12-16, router and 3P1D 16-24, TokenLake above 32 (the last `make eval`).
DEFAULT_RATES = {
    "loogle": (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16),
    "scbench": (0.5, 1, 2, 3, 4, 6, 8, 10, 12, 14, 16),
    "sharegpt": (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384),
    "mixed": (1, 2, 4, 6, 8, 12, 16, 24, 32),
}

#: Rate of the load-balance and hit-rate experiments: near TokenLake's P90 knee (paper
#: §7.2: "at a request rate approaching TokenLake's P90 SLO threshold").
NEAR_KNEE_RATE = {"loogle": 6.0, "scbench": 3.0, "sharegpt": 16.0, "mixed": 16.0}


#: KV-cache GB per GPU of the hit-rate and elasticity sweeps. A TP=2 baseline worker
#: needs a whole request's KV (~31K tokens, 16 GB, for the longest LooGLE prompt plus its
#: answer) in its two GPUs, so the sweep starts at 8 GB; 66.5 GB is the default (an
#: A100-80GB less Llama-2-7B's weights).
CACHE_GB = (8, 12, 16, 24, 32, 48)

#: The paper's cluster (8 x A100) and its 16-instance multi-node variant.
PAPER_CLUSTER = SimConfig()
MULTI_NODE_CLUSTER = SimConfig(instances=16)


@dataclass(frozen=True)
class ExperimentResult:
    name: str
    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    series: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- workloads


def build_workload(name: str, scale: float = 1.0, seed: int = 0,
                   zipf: float = 0.0) -> list[Request]:
    """The workload's requests (arrival times are set later by :func:`at_rate`).

    ``scale`` multiplies request counts (:data:`BASE_REQUESTS`) and context lengths
    (1.0: 1,000 LooGLE questions on ~24K-token documents, 600 SCBench turns on
    ~32K-token contexts, 3,000 ShareGPT turns behind a 3,000-token system prompt).
    ``mixed`` is a third of the requests of each, at their own context lengths.
    ``zipf`` > 0 skews the popularity of LooGLE's documents (``loogle`` and the LooGLE
    third of ``mixed``; see :func:`~evals.workloads.loogle.synthetic_loogle`).
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if zipf and name not in ("loogle", "mixed"):
        raise ValueError(f"zipf skews LooGLE's documents; workload {name!r} has none")
    if name == "mixed":  # 1:1:1, ids prefixed so that they stay unique
        out = []
        for part in WORKLOADS:
            for r in _build(part, scale / 3, scale, seed, zipf):
                out.append(replace(r, request_id=f"{part}:{r.request_id}",
                                   session_id=None if r.session_id is None else f"{part}:{r.session_id}"))
        return out
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS + ('mixed',))}")
    return _build(name, scale, scale, seed, zipf)


def _build(name: str, count_scale: float, length_scale: float, seed: int,
           zipf: float = 0.0) -> list[Request]:
    n = max(4, round(BASE_REQUESTS[name] * count_scale))
    if name == "loogle":
        return list(synthetic_loogle(n, seed=seed, doc_tokens=max(512, round(24000 * length_scale)),
                                     zipf=zipf).requests())
    if name == "scbench":
        return list(synthetic_scbench(n, seed=seed, mode="multi-turn",
                                      context_tokens=max(512, round(32768 * length_scale))).requests())
    return list(load_sharegpt(n=n, seed=seed, tokenizer="whitespace",
                              system_prompt_tokens=max(64, round(3000 * length_scale)),
                              max_conversations=max(200, 2 * n)).requests())


def at_rate(requests: Sequence[Request], rate: float, seed: int = 0) -> list[Request]:
    """``requests`` re-timed at ``rate`` req/s: sessions (a request without one is its
    own) start on a seeded Poisson process and a session's turns follow each other
    (:func:`~evals.workloads.with_session_arrivals`; the simulator's closed-loop
    sessions send a turn once the previous one finished)."""
    return with_session_arrivals(requests, rate, seed=seed)


# --------------------------------------------------------------------------- helpers


def _row(result, **labels) -> dict[str, Any]:
    d = result.to_dict()
    d.pop("extra", None)
    return {**labels, **d}


def _p90_goodput(rows: list[dict], target: float = 0.9) -> float:
    ok = [r["rate"] for r in rows if r["slo_attainment"] >= target]
    return max(ok) if ok else 0.0


#: What the knee summary keeps of a run.
KNEE_KEYS = ("hit_rate", "mean_ttft_s", "p90_tbt_s", "slo_attainment", "ttft_slo_attainment",
             "tbt_slo_attainment", "tbt_miss_waited")


def _at_knee(rows: list[dict], knee: float) -> dict[str, Any]:
    """A system at its own knee (its P90 goodput rate: ``None`` without one) and at the
    next rate of the grid, where it missed: on input latency (TTFT), time between tokens
    (TBT), and for TBT whether waiting between batches."""
    by_rate = {r["rate"]: r for r in rows}
    above = min((rate for rate in by_rate if rate > knee), default=None)
    return {"rate": knee or None,
            "knee": {k: by_rate[knee][k] for k in KNEE_KEYS} if knee in by_rate else None,
            "next": None if above is None else {"rate": above, **{k: by_rate[above][k] for k in KNEE_KEYS}}}


def _ratio(a: float, b: float) -> float | None:
    if b > 0:
        return a / b
    return math.inf if a > 0 else None


#: ``progress(label, total)``: one simulation of a grid of ``total`` ended.
Progress = Callable[[str, int], None]

#: (label, requests, system, config): one simulation of an experiment's grid.
Job = tuple[str, Sequence[Request], str, SimConfig]

_FORKED_JOBS: list[Job] = []  # what forked workers read (set only while a pool runs)


def _simulate_job(i: int) -> SimResult:
    return _simulate(*_FORKED_JOBS[i])


def _simulate(label: str, reqs: Sequence[Request], system: str, config: SimConfig) -> SimResult:
    """One job; a run that cannot finish raises :class:`SimulationError` naming it."""
    try:
        return simulate(reqs, system, config)
    except SimulationError as exc:
        raise SimulationError(f"{label}: {exc}") from None


def run_jobs(jobs: Sequence[Job], progress: Progress | None = None,
             workers: int = 1) -> list[SimResult]:
    """Simulates every job, in ``workers`` processes (forked, so the requests are not
    copied to them); results in job order. Each simulation is seeded by its config, so
    the results do not depend on ``workers``. ``progress(label, len(jobs))`` as each one
    ends. The first run that cannot finish raises :class:`SimulationError` naming its
    label (the runs not started yet are cancelled)."""
    global _FORKED_JOBS
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive int, got {workers!r}")
    if workers == 1 or len(jobs) < 2:
        out = []
        for label, reqs, system, config in jobs:
            out.append(_simulate(label, reqs, system, config))
            if progress:
                progress(label, len(jobs))
        return out
    _FORKED_JOBS = list(jobs)
    results: list[SimResult | None] = [None] * len(jobs)
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=ctx) as pool:
            futures = {pool.submit(_simulate_job, i): i for i in range(len(jobs))}
            try:
                for fut in as_completed(futures):
                    i = futures[fut]
                    results[i] = fut.result()
                    if progress:
                        progress(jobs[i][0], len(jobs))
            except SimulationError:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        _FORKED_JOBS = []
    return results  # type: ignore[return-value]


# --------------------------------------------------------------------------- experiments


def e2e(workloads: Sequence[str] = WORKLOADS, systems: Sequence[str] = MAIN_SYSTEMS,
        rates: dict[str, Sequence[float]] | None = None, scale: float = 1.0,
        config: SimConfig = PAPER_CLUSTER, seed: int = 0,
        progress: Progress | None = None, workers: int = 1, zipf: float = 0.0,
        trace: str | None = None) -> ExperimentResult:
    """Fig. 9: latency and SLO attainment versus rate; P90 goodput and its ratios
    (``zipf``: LooGLE's document skew, for ``loogle`` and ``mixed``). With ``trace`` (a
    Mooncake-format file) its requests are the one workload: Poisson at each of
    ``rates["trace"]`` if given, else the trace's own times sped up by
    :data:`evals.sim.trace.TRACE_SPEEDUPS`, each point labelled with its mean rate."""
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"p90_goodput": {}, "p90_goodput_ratio": {}}
    jobs, labels = [], []
    if trace is not None:
        label, grid = trace_grid(trace, (rates or {}).get("trace"), seed)
        workloads, points = (label,), {label: grid}
    else:
        points = {}
        for w in workloads:
            base = build_workload(w, scale, seed, zipf if w in ("loogle", "mixed") else 0.0)
            points[w] = [(rate, at_rate(base, rate, seed)) for rate in (rates or DEFAULT_RATES)[w]]
    for w in workloads:
        for rate, reqs in points[w]:
            for s in systems:
                jobs.append((f"e2e {w} {s} {rate}/s", reqs, s, config))
                labels.append({"workload": w, "rate": rate})
    for res, lab in zip(run_jobs(jobs, progress, workers), labels, strict=True):
        rows.append(_row(res, **lab))
    for w in workloads:
        good = {s: _p90_goodput([r for r in rows if r["workload"] == w and r["system"] == s])
                for s in systems}
        summary["p90_goodput"][w] = good
        summary.setdefault("at_knee", {})[w] = {
            s: _at_knee([r for r in rows if r["workload"] == w and r["system"] == s], good[s])
            for s in systems}
        if "tokenlake" in good:
            summary["p90_goodput_ratio"][w] = {s: _ratio(good["tokenlake"], g)
                                               for s, g in good.items() if s != "tokenlake"}
    return ExperimentResult("e2e", rows, summary, config=_config(config, scale, seed, zipf))


def load_balance(workload: str = "loogle", rate: float | None = None,
                 systems: Sequence[str] = MAIN_SYSTEMS, scale: float = 1.0,
                 config: SimConfig = PAPER_CLUSTER, seed: int = 0,
                 progress: Progress | None = None, workers: int = 1,
                 zipf: float = 0.0) -> ExperimentResult:
    """Fig. 10: CV of per-instance cache accesses over time, at one rate (default:
    :data:`NEAR_KNEE_RATE`)."""
    rate = NEAR_KNEE_RATE[workload] if rate is None else rate
    reqs = at_rate(build_workload(workload, scale, seed, zipf), rate, seed)
    rows, series = [], {}
    jobs = [(f"load-balance {s}", reqs, s, config) for s in systems]
    for s, res in zip(systems, run_jobs(jobs, progress, workers), strict=True):
        rows.append(_row(res, workload=workload, rate=rate))
        series[s] = {"window_s": config.cv_window_s, "cv": list(res.cv_over_time)}
    summary = {"mean_cv": {r["system"]: r["cv"] for r in rows}}
    if "tokenlake" in summary["mean_cv"]:
        tl = summary["mean_cv"]["tokenlake"]
        summary["cv_ratio_to_tokenlake"] = {s: _ratio(cv, tl) for s, cv in summary["mean_cv"].items()
                                            if s != "tokenlake"}
    return ExperimentResult("load-balance", rows, summary, series, _config(config, scale, seed, zipf))


def hit_rate(cache_gb: Sequence[float] = CACHE_GB, systems: Sequence[str] = MAIN_SYSTEMS,
             workload: str = "loogle", rate: float | None = None, scale: float = 1.0,
             config: SimConfig = PAPER_CLUSTER, seed: int = 0,
             progress: Progress | None = None, workers: int = 1,
             trace: str | None = None, zipf: float = 0.0) -> ExperimentResult:
    """Fig. 11: hit rate versus KV-cache GB per instance (at :data:`NEAR_KNEE_RATE`).

    With ``trace`` (a Mooncake-format file) its requests replace the workload, at the
    trace's arrival times (or Poisson at ``rate``), and the summary adds the reuse
    counted directly from the trace's block ids (``counted_reuse``: an unbounded cache
    that hits whole blocks; ``counted_reuse_pages``: the same in whole pages of the
    pool's default, with the last prompt token computed, what the pool can serve)."""
    counted: dict[str, float] = {}
    if trace is not None:
        from evals.sim.trace import arrange, load_trace
        from evals.workloads.mooncake import prefix_reuse
        from tokenlake.core.config import DEFAULT_PAGE_TOKENS

        reqs = arrange(load_trace(trace), rate, None, 1, seed)
        workload = f"trace:{trace.rsplit('/', 1)[-1]}"
        hit, total = prefix_reuse(reqs)
        hit_p, _ = prefix_reuse(reqs, page=DEFAULT_PAGE_TOKENS)
        counted = {"counted_reuse": hit / total, "counted_reuse_pages": hit_p / total}
    else:
        rate = NEAR_KNEE_RATE[workload] if rate is None else rate
        reqs = at_rate(build_workload(workload, scale, seed, zipf), rate, seed)
    cells = [(gb, s) for gb in cache_gb for s in systems]
    jobs = [(f"hit-rate {gb} GB {s}", reqs, s, replace(config, cache_gb=gb)) for gb, s in cells]
    rows = [_row(res, workload=workload, rate=rate, cache_gb=gb)
            for (gb, _), res in zip(cells, run_jobs(jobs, progress, workers), strict=True)]
    summary: dict[str, Any] = {"hit_rate": {}, **counted}
    for gb in cache_gb:
        at = {r["system"]: r["hit_rate"] for r in rows if r["cache_gb"] == gb}
        summary["hit_rate"][str(gb)] = at
    if "tokenlake" in systems:
        ratios: dict[str, list[float]] = {}
        for at in summary["hit_rate"].values():
            for s, h in at.items():
                if s != "tokenlake" and h > 0:
                    ratios.setdefault(s, []).append(at["tokenlake"] / h)
        summary["hit_rate_ratio_range"] = {s: (min(v), max(v)) for s, v in ratios.items()}
    return ExperimentResult("hit-rate", rows, summary, config=_config(config, scale, seed, zipf))


def elasticity(cache_gb: Sequence[float] = CACHE_GB, workload: str = "loogle",
               rate: float | None = None, scale: float = 1.0, config: SimConfig = PAPER_CLUSTER,
               seed: int = 0, progress: Progress | None = None,
               workers: int = 1, zipf: float = 0.0) -> ExperimentResult:
    """Fig. 12: pooling (TokenLake-xPyD vs MoonCake-xPyD) and elasticity (TokenLake vs
    TokenLake-xPyD) as mean input-token latency versus cache size."""
    systems = ("tokenlake", "tokenlake-1p3d", "tokenlake-3p1d", "mooncake-1p3d", "mooncake-3p1d")
    res = hit_rate(cache_gb, systems, workload, rate, scale, config, seed, progress, workers,
                   zipf=zipf)
    summary: dict[str, Any] = {"input_token_latency_s": {}, "gain": {}}
    for gb in cache_gb:
        at = {r["system"]: r["input_token_latency_s"] for r in res.rows if r["cache_gb"] == gb}
        summary["input_token_latency_s"][str(gb)] = at
        summary["gain"][str(gb)] = {
            "pooling_1p3d": _ratio(at["mooncake-1p3d"], at["tokenlake-1p3d"]),
            "pooling_3p1d": _ratio(at["mooncake-3p1d"], at["tokenlake-3p1d"]),
            "elastic_vs_1p3d": _ratio(at["tokenlake-1p3d"], at["tokenlake"]),
            "elastic_vs_3p1d": _ratio(at["tokenlake-3p1d"], at["tokenlake"]),
        }
    return ExperimentResult("elasticity", res.rows, summary, config=res.config)


def multi_node(rates: Sequence[float] | None = None, scale: float = 1.0,
               systems: Sequence[str] = MAIN_SYSTEMS, config: SimConfig = MULTI_NODE_CLUSTER,
               seed: int = 0, progress: Progress | None = None,
               workers: int = 1, zipf: float = 0.0) -> ExperimentResult:
    """Fig. 13: 16 instances, the three workloads mixed 1:1:1 (the MoonCake baselines keep
    their 1:3 and 3:1 prefill:decode ratios, i.e. 2P6D and 6P2D workers at TP=2)."""
    res = e2e(("mixed",), systems, {"mixed": rates or DEFAULT_RATES["mixed"]}, scale, config,
              seed, progress, workers, zipf)
    return replace(res, name="multi-node")


EXPERIMENTS: dict[str, Callable[..., ExperimentResult]] = {
    "e2e": e2e,
    "load-balance": load_balance,
    "hit-rate": hit_rate,
    "elasticity": elasticity,
    "multi-node": multi_node,
}


def _config(config: SimConfig, scale: float, seed: int, zipf: float = 0.0) -> dict[str, Any]:
    out = {"sim": asdict(config), "scale": scale, "seed": seed}
    if zipf:
        out["zipf"] = zipf
    return out


def mean_or_none(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None
