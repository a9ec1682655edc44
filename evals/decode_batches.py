"""Kept decode batches against re-formed ones on the real engines (issue #43).

One ShareGPT-like chat load (the packaged ShareGPT conversations behind a shared system
prompt, SmolLM2's tokenizer, Poisson arrivals in wall-clock time) is served by the
serving loop (:class:`~tokenlake.generation.GenerationLoop`, what ``tokenlake serve``
runs) on a :class:`~tokenlake.deploy.local.LocalCluster` with one compute engine per
instance (:class:`~tokenlake.engines.compute.ParallelComputeEngine`, where a decode
batch has an instance to keep), once with the goodput DP keeping running decode batches
together (``decode_batches="keep"``, the default) and once re-forming them at every
decision (``"reform"``, the rule before), alternately, ``rounds`` times each, every run
on a fresh cluster.

The time-between-tokens SLO is ``slo_scale`` times the median gap between the tokens of
one request served alone on the same cluster (measured first, as the paper sets its SLO
from batch-size-1 latency). A run reports every gap between two tokens of a request
against that SLO (``tbt_misses``), the requests whose mean gap meets it, and how often a
decode step ran on another instance than in the iteration before (``decode_moves``).
The token ids are checked to agree between the two rules (greedy decoding: a rule that
changes an answer is a bug, not a trade-off).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from evals.workloads.base import Request
from evals.workloads.sharegpt import load_sharegpt
from scheduler.goodput import GoodputScheduler
from tokenlake.deploy.local import LocalCluster
from tokenlake.engines.compute import ParallelComputeEngine
from tokenlake.generation import GenerationLoop, GenerationRequest
from tokenlake.model.llama.weights import load_weights

RULES = ("keep", "reform")


def chat_trace(requests: int = 32, rate: float = 4.0, system_tokens: int = 192,
               max_input: int = 448, max_output: int = 24, seed: int = 0) -> tuple[Request, ...]:
    """``requests`` ShareGPT turns (whole conversations, their later turns carrying the
    history) behind a ``system_tokens`` system prompt, at ``rate`` req/s."""
    return load_sharegpt(n=requests, seed=seed, system_prompt_tokens=system_tokens,
                         max_input_len=max_input, max_output_len=max_output, rate=rate).items


def _serve(weights, trace: list[Request], rule: str | None, instances: int, chunk_tokens: int,
           segment_tokens: int, tbt_slo_s: float | None) -> dict[str, Any]:
    """``trace`` through a fresh cluster; ``rule`` None: the GenerationLoop's default
    policy. Returns the token times and ids per request and the loop's counters."""
    spec = weights.config.to_model_spec("smollm2-135m")
    stamps: dict[str, list[float]] = {r.request_id: [] for r in trace}
    clock = time.perf_counter
    with LocalCluster(instances, spec, 64 << 20, segment_tokens=segment_tokens,
                      max_rows=max(chunk_tokens, 64)) as cluster:
        engine = ParallelComputeEngine(weights, cluster)
        policy = None if rule is None else GoodputScheduler(chunk_tokens=chunk_tokens, decode_batches=rule)
        try:
            loop = GenerationLoop(cluster, weights, chunk_tokens=chunk_tokens, engine=engine, policy=policy,
                                  tbt_slo_s=tbt_slo_s, on_token=lambda rid, _: stamps[rid].append(clock()))
            pending = sorted(trace, key=lambda r: r.arrival_s)
            t0 = clock()
            while pending or loop.busy:
                now = clock() - t0
                while pending and pending[0].arrival_s <= now:
                    r = pending.pop(0)
                    loop.submit(GenerationRequest(r.request_id, r.tokens(), r.output_length, ()))
                if loop.busy:
                    loop.step()
                else:  # nothing to run before the next arrival: the load's own idle time
                    time.sleep(pending[0].arrival_s - now)
            wall = clock() - t0
        finally:
            engine.close()
    return {"stamps": stamps, "ids": {rid: list(res.output_ids) for rid, res in loop.results.items()},
            "decode_moves": loop.decode_moves, "iterations": loop.iterations, "wall_s": wall}


def _summary(run: dict[str, Any], slo: float) -> dict[str, Any]:
    gaps = {rid: [b - a for a, b in zip(ts, ts[1:])] for rid, ts in run["stamps"].items()}
    every = [g for gs in gaps.values() for g in gs]
    means = [statistics.fmean(gs) for gs in gaps.values() if gs]
    misses = sum(g > slo for g in every)
    return {"tbt_gaps": len(every), "tbt_misses": misses,
            "tbt_miss_share": misses / len(every) if every else 0.0,
            "requests_within_slo": sum(m <= slo for m in means) / len(means) if means else 1.0,
            "mean_tbt_s": statistics.fmean(every) if every else 0.0,
            "p90_tbt_s": statistics.quantiles(every, n=10)[-1] if len(every) > 1 else 0.0,
            "decode_moves": run["decode_moves"], "iterations": run["iterations"], "wall_s": run["wall_s"]}


def _range(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(requests: int = 32, rate: float = 4.0, instances: int = 4, rounds: int = 2,
            slo_scale: float = 5.0, chunk_tokens: int = 256, segment_tokens: int = 64, seed: int = 0,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs the comparison (module docstring) and returns it as a JSON-ready dict."""
    weights = load_weights()
    trace = chat_trace(requests, rate, seed=seed)
    say = progress or (lambda _: None)
    say("calibrating: one request alone")
    alone = _serve(weights, trace[:1], None, instances, chunk_tokens, segment_tokens, None)
    base = statistics.median(b - a for ts in alone["stamps"].values() for a, b in zip(ts, ts[1:]))
    slo = slo_scale * base
    runs: dict[str, list[dict[str, Any]]] = {rule: [] for rule in RULES}
    answers: dict[str, dict[str, list[int]]] = {}
    for k in range(rounds):
        for rule in RULES:  # alternately, so drift on the machine hits both alike
            say(f"round {k + 1}/{rounds}: {rule}")
            run = _serve(weights, trace, rule, instances, chunk_tokens, segment_tokens, slo)
            runs[rule].append(_summary(run, slo))
            answers.setdefault(rule, run["ids"])
    same = answers["keep"] == answers["reform"]
    keys = ("tbt_gaps", "tbt_misses", "tbt_miss_share", "requests_within_slo", "mean_tbt_s", "p90_tbt_s",
            "decode_moves", "wall_s")
    med = {rule: {key: _range([r[key] for r in rs]) for key in keys} for rule, rs in runs.items()}
    miss = {rule: med[rule]["tbt_misses"]["median"] for rule in RULES}
    return {
        "setup": {"instances": instances, "requests": len(trace), "rate_rps": rate, "rounds": rounds,
                  "chunk_tokens": chunk_tokens, "segment_tokens": segment_tokens, "slo_scale": slo_scale,
                  "input_tokens": sum(r.input_length for r in trace),
                  "output_tokens": sum(r.output_length for r in trace), "seed": seed},
        "alone_tbt_s": base, "tbt_slo_s": slo,
        "rules": med, "runs": runs,
        "keep_vs_reform_tbt_misses": miss["keep"] / miss["reform"] if miss["reform"] else None,
        "fewer_tbt_misses_with_keep": miss["keep"] < miss["reform"],
        "answers_equal": same,
    }
