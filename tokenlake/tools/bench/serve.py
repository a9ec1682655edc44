"""``tokenlake bench serve``: a load generator for OpenAI-compatible completion servers.

It streams ``POST /v1/completions`` requests (prompts as token ids, ``temperature`` 0,
``ignore_eos`` so every request generates exactly its ``max_tokens``) to a served pool
and, optionally, a baseline server, and measures per request:

* TTFT: from sending the request to the first token chunk (a chunk with a choice: the
  server sends one per generated token, its text possibly empty while held back);
* TBT: the gaps between successive token chunks (pooled over all requests);
* end-to-end latency, output tokens (the final ``usage`` chunk, else the text chunks);
* errors: an HTTP error status, a dropped or unfinished stream, a timeout.

Load is a closed loop (``concurrency`` requests in flight) or seeded Poisson arrivals at
``rate`` req/s (with ``concurrency`` as a cap on requests in flight if given). The hit
rate is the delta of the pool's ``tokenlake_hit_tokens_total`` /
``tokenlake_lookup_tokens_total`` counters on ``/metrics`` over the run, else the
``usage.prompt_tokens_details.cached_tokens`` share of the prompt tokens, else None.

With a baseline, ``rounds`` rounds run the pool then the baseline on the same prompts,
each round a fresh workload seed; the report gives medians over rounds, their ranges
and the ratios (baseline/pool for latencies, pool/baseline for throughputs), and how
many greedy answers differ between the two (``answers_differ`` of
``answers_compared``).

With ``mixed`` (``--mixed N``), N compute engines drive the pool through
``tokenlake.connect`` while the HTTP load runs against it
(:mod:`tokenlake.tools.bench.serve_mixed`); the report gains ``"mixed"``: each worker's
throughput, iteration latency, errors and wrong answers (its partials checked against a
float64 reference), and the HTTP side's errors and answers checked against the
baseline's (``"checked": false`` without one).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import httpx

from tokenlake.tools.bench.serve_load import (
    BenchRequest,
    WorkloadSpec,
    build_workload,
    launch_servers,
    sigterm_as_interrupt,
    warmup_requests,
)
from tokenlake.tools.bench.serve_mixed import MixedSpec, MixedWorkers
from tokenlake.tools.bench.serve_stats import (
    Outcome,
    aggregate,
    http_check,
    median_and_range,
    mixed_report,
    parse_metrics,
    ratios,
    summarise,
)

# --------------------------------------------------------------------------- one request


async def _read_stream(resp: httpx.Response, out: Outcome, t0: float) -> None:
    last = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            out.e2e_s = time.perf_counter() - t0
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error in stream: {chunk['error']}")
        if chunk.get("choices"):  # one generated token (the usage chunk has none)
            out.text += "".join(c.get("text") or "" for c in chunk["choices"])
            now = time.perf_counter()
            if last is None:
                out.ttft_s = now - t0
            else:
                out.gaps_s.append(now - last)
            last = now
            out.output_tokens += 1
        usage = chunk.get("usage")
        if usage:
            out.output_tokens = int(usage.get("completion_tokens", out.output_tokens))
            out.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            out.cached_tokens = details.get("cached_tokens")
    raise ValueError("the stream ended without [DONE]")


def _error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {message}"


async def send_one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                   timeout_s: float) -> Outcome:
    """Streams one completion; never raises for a failed request (it becomes an error)."""
    body = {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    out = Outcome(req.request_id)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", url, json=body) as resp:
                if resp.status_code >= 400:
                    out.error = _error_message(resp.status_code, await resp.aread())
                    return out
                await _read_stream(resp, out, t0)
    except TimeoutError:
        out.error = f"timeout after {timeout_s:g} s"
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except (ValueError, TypeError, AttributeError) as exc:  # a malformed stream
        out.error = f"bad stream: {exc}"
    return out


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Load:
    """How requests are sent: ``concurrency`` in flight at most (None: no cap) and
    Poisson arrivals at ``rate`` req/s (None: all at once, i.e. a closed loop)."""

    concurrency: int | None = 4
    rate: float | None = None
    seed: int = 0
    timeout_s: float = 300.0


def arrival_offsets(n: int, load: Load) -> list[float]:
    """Send times (s from the start) of ``n`` requests: seeded Poisson, or all zero."""
    if load.rate is None:
        return [0.0] * n
    from evals.workloads import poisson_arrivals

    return poisson_arrivals(n, load.rate, load.seed)


async def run_requests(client: httpx.AsyncClient, url: str, model: str,
                       requests: list[BenchRequest], load: Load, progress=None
                       ) -> tuple[list[Outcome], float]:
    """Sends ``requests`` under ``load``; their outcomes (in request order) and the
    seconds from the start to the last completion."""
    gate = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    start = time.perf_counter()

    async def one(req: BenchRequest, at: float) -> Outcome:
        wait = start + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)  # the arrival time of an open-loop request
        if gate is None:
            outcome = await send_one(client, url, model, req, load.timeout_s)
        else:
            async with gate:
                outcome = await send_one(client, url, model, req, load.timeout_s)
        if progress is not None:
            progress.update(1)
        return outcome

    offsets = arrival_offsets(len(requests), load)
    outcomes = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets)))
    return list(outcomes), time.perf_counter() - start


async def fetch_counters(client: httpx.AsyncClient, base_url: str) -> dict | None:
    """The pool counters from ``/metrics``; None if the server has no such endpoint."""
    try:
        resp = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    return parse_metrics(resp.text) if resp.status_code == 200 else None


async def pick_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model ``/v1/models`` lists; RuntimeError if there is none."""
    try:
        resp = await client.get(f"{base_url}/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"no model name from {base_url}/v1/models ({exc}); is the server "
                           "up? (or give --model)") from exc


# --------------------------------------------------------------------------- targets, rounds


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: the prompts, the load, warm-up requests per run (not measured),
    rounds, the model name (None: ask ``/v1/models``), whether to show progress, and
    the compute engines beside the HTTP load (None: none)."""

    spec: WorkloadSpec = field(default_factory=WorkloadSpec)
    load: Load = field(default_factory=Load)
    warmup: int = 1
    rounds: int = 1
    model: str | None = None
    progress: bool = False
    mixed: MixedSpec | None = None


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _bar(config: BenchConfig, name: str, total: int):
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="req", file=sys.stderr, leave=False)


async def bench_target(base_url: str, name: str, requests: list[BenchRequest],
                       warmups: list[BenchRequest], config: BenchConfig, load: Load,
                       workers: MixedWorkers | None = None) -> dict:
    """One measured run of ``requests`` against one server, after its warm-up; the
    ``workers`` (if any) run on its pool during the measured run."""
    limits = httpx.Limits(max_connections=load.concurrency,
                          max_keepalive_connections=load.concurrency)
    timeout = httpx.Timeout(load.timeout_s, connect=min(30.0, load.timeout_s))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = config.model or await pick_model(client, base_url)
        url = f"{base_url}/v1/completions"
        if warmups:
            done, _ = await run_requests(client, url, model, warmups, load)
            if all(o.error for o in done):
                raise RuntimeError(f"{name}: every warm-up request failed: {done[0].error}")
        before = await fetch_counters(client, base_url)
        bar = _bar(config, name, len(requests))
        if workers is not None:
            await asyncio.to_thread(workers.run)
        try:
            outcomes, duration = await run_requests(client, url, model, requests, load, bar)
        finally:
            if bar is not None:
                bar.close()
            if workers is not None:
                await asyncio.to_thread(workers.pause)
        after = await fetch_counters(client, base_url)
    result = summarise(outcomes, duration, (before, after), sum(len(r.prompt) for r in requests))
    result.update(model=model, url=base_url)
    return result, {o.request_id: o.text for o in outcomes if o.error is None}


async def _run_rounds(config: BenchConfig, targets: dict[str, str], workloads: list,
                      workers: MixedWorkers | None = None) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    compared = differ = 0  # greedy answers of both servers to the same prompts
    for r, (requests, warmups) in enumerate(workloads):
        load = Load(config.load.concurrency, config.load.rate, config.load.seed + r,
                    config.load.timeout_s)
        texts = {}
        for name, url in targets.items():
            label = name if config.rounds == 1 else f"{name} {r + 1}/{config.rounds}"
            report, texts[name] = await bench_target(url, label, requests, warmups, config, load,
                                                     workers if name == "pool" else None)
            runs[name].append(report)
        if "baseline" in texts:
            both = texts["pool"].keys() & texts["baseline"].keys()
            compared += len(both)
            differ += sum(texts["pool"][k] != texts["baseline"][k] for k in both)
    if "baseline" not in runs:
        return aggregate(runs["pool"])
    result = {"pool": aggregate(runs["pool"]), "baseline": aggregate(runs["baseline"]),
              "answers_compared": compared, "answers_differ": differ}
    result["ratios"] = ratios(result["pool"], result["baseline"])
    if config.rounds > 1:
        each = [ratios(p, b) for p, b in zip(runs["pool"], runs["baseline"])]
        result["ratio_ranges"] = {k: median_and_range([e[k] for e in each])[1]
                                  for k in result["ratios"]}
    return result


def run_bench(config: BenchConfig, base_url: str | None = None, baseline_url: str | None = None,
              launch: tuple[int, list[str], float] | None = None) -> dict:
    """The whole benchmark: against ``base_url`` (and ``baseline_url``), or with
    ``launch = (instances, extra serve args, ready timeout s)`` against two launched
    ``tokenlake serve`` processes, stopped at the end whatever happens (and so are the
    ``config.mixed`` workers, before them)."""
    workloads = [(build_workload(config.spec, config.load.seed + r),
                  warmup_requests(config.warmup, config.spec, config.load.seed + r))
                 for r in range(config.rounds)]  # bad options fail before any server starts
    with ExitStack() as stack:
        mixed = config.mixed
        if launch is not None:
            sigterm_as_interrupt(stack)
            t0 = time.monotonic()
            _log(f"bench serve: starting 'tokenlake serve' (pool and baseline, {launch[0]} "
                 "instances each; loading the model) ...")
            servers = launch_servers(stack, *launch)
            targets = {name: server.url for name, server in servers.items()}
            _log(f"bench serve: ready after {time.monotonic() - t0:.0f} s: "
                 + ", ".join(f"{name} at {url}" for name, url in targets.items()))
            if mixed is not None:
                event = servers["pool"].ready_event
                if not event.get("address"):
                    raise RuntimeError("the launched pool announces no control address")
                mixed = MixedSpec(mixed.workers, mixed.iterations, event["address"],
                                  event.get("credentials"), mixed.ready_timeout_s,
                                  mixed.pause_timeout_s)
        else:
            targets = {"pool": base_url.rstrip("/")}
            if baseline_url:
                targets["baseline"] = baseline_url.rstrip("/")
        workers = None
        if mixed is not None:
            if not mixed.address:
                raise ValueError("--mixed needs the pool's control address")
            workers = MixedWorkers(mixed, mixed.address, mixed.credentials, config.load.seed, _log)
            stack.callback(workers.stop)  # before the servers stop
            workers.start()
        result = asyncio.run(_run_rounds(config, targets, workloads, workers))
        if workers is not None:
            result["mixed"] = mixed_report(workers.finish(), http_check(result))
    result["config"] = {"workload": config.spec.name, "num_requests": config.spec.num_requests,
                        "max_tokens": config.spec.max_tokens, "concurrency": config.load.concurrency,
                        "rate": config.load.rate, "seed": config.load.seed,
                        "warmup": config.warmup, "rounds": config.rounds,
                        "launched": launch is not None,
                        "mixed": None if mixed is None else mixed.workers,
                        "mixed_iterations": None if mixed is None else mixed.iterations}
    return result
