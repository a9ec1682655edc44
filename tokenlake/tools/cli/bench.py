"""``tokenlake bench {plans,query-vs-fetch,kernel,e2e,scheduler,sim,serve,restart,...}``: benchmarks
that print figures (they assert nothing; README.md quotes them).

Each benchmark's work lives beside what it measures (``tokenlake/tools/bench_*.py``,
``scheduler/bench.py``, ``evals/sim/bench.py``); this module parses the arguments and
prints the result, as JSON with ``--json``. ``serve`` is a load generator for a served
pool's OpenAI-compatible HTTP API (``tokenlake/tools/bench/serve.py``), optionally
against a baseline server or with both launched by ``--launch``, and with ``--mixed N``
compute engines on the same pool through ``tokenlake.connect``
(``tokenlake/tools/bench/serve_mixed.py``); its options are parsed in
``tokenlake/tools/cli/bench_serve.py``. ``restart`` kills ``tokenlake serve`` and
starts it again, adopting its pool or cold (``tokenlake/tools/bench/restart.py``).
"""

from __future__ import annotations

import argparse
import json
import os

from tokenlake.tools.bench.kernel import add_kernel
from tokenlake.tools.bench.plans import bench_plans
from tokenlake.tools.cli.args import UsageError, check_device, device_name, fraction, positive
from tokenlake.tools.cli.bench_e2e import add_e2e
from tokenlake.tools.cli.bench_gpu import add_gpu
from tokenlake.tools.cli.bench_serve import add_serve
from tokenlake.tools.cli.eval import SYSTEM_NAMES
from tokenlake.tools.config import ServeSettings


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (print figures; not tests)",
                           description="Benchmarks: they print figures and assert nothing.")
    what = bench.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    add_plans(what.add_parser("plans", help="gen_plans latency and prefix-match throughput"))
    add_query_vs_fetch(what.add_parser(
        "query-vs-fetch", help="one decode query through the pool vs fetching the prefix KV"))
    add_kernel(what.add_parser("kernel", help="the csrc kernels (slab attention, few-row linear) vs memory bandwidth, torch and BLAS"))
    add_gpu(what.add_parser(
        "gpu", help="the CUDA path on a GPU: FlashInfer slab attention vs bandwidth and torch, query vs fetch",
        description="Needs a CUDA GPU and FlashInfer (pip install 'tokenlake[gpu]'). Measures the "
                    "device read bandwidth, one batched FlashInfer launch over a slab's slots against "
                    "it and torch's SDPA, and a decode query on a GPU pool vs fetching the KV."))
    add_curve(what.add_parser(
        "curve", help="what CURVE costs a query and a put (secure vs insecure pool, JSON)"))
    add_vllm(what.add_parser(
        "vllm", help="vLLM's TTFT with the TokenLake connector vs its own prefix cache (JSON)"))
    add_e2e(what.add_parser(
        "e2e", help="SmolLM2 through the pool: TTFT cached vs recomputed, decode tokens/s"))
    add_scheduler(what.add_parser(
        "scheduler", help="decision time of the goodput DP scheduler (JSON)"))
    add_sim(what.add_parser(
        "sim", help="simulator speed on a repeated Mooncake trace (JSON)"))
    add_http(what.add_parser(
        "http", help="what the HTTP layer adds per request (direct vs HTTP, JSON)",
        description="Alternates the same kind of request straight to the serving loop and "
                    "through POST /v1/completions on one served pool; prints both latencies "
                    "and the difference of their medians (JSON)."))
    add_soak(what.add_parser(
        "soak", help="a long mixed query/put load: memory, files, shared memory, drift (JSON)",
        description="Runs random queries and puts on a local pool for --minutes and samples "
                    "each process's resident memory and open files, the shared memory and "
                    "the iteration latency; prints growth and drift as JSON (Linux)."))
    add_serve(what.add_parser(
        "serve", help="load generator for a served pool's HTTP API (TTFT, TBT, throughput)",
        description="Streams completions to an OpenAI-compatible server (the pool) and "
                    "optionally a baseline; reports TTFT, time between tokens, end-to-end "
                    "latency, throughput and the pool's hit rate."))
    add_restart(what.add_parser(
        "restart", help="'tokenlake serve' killed and restarted: adopting its pool vs a cold start",
        description="Alternates, per round: 'tokenlake serve' caches a document, is killed "
                    "with SIGKILL and started again with the same settings, adopting its "
                    "engines (adopt) or, its first process run with --orphan-grace-s 0, "
                    "empty (cold); times the restart to ready and to the first answer about "
                    "the document, with its cached tokens."))
    add_roundtrip(what.add_parser(
        "roundtrip", help="one layer's pool query on one host: round trip vs the attention alone",
        description="A one-page prefix in a one-instance pool; 1 and 8 decode rows asked of "
                    "the pool layer after layer and, alternately, attended by the query "
                    "engine's kernel in this process: per-layer round trip, attention, "
                    "overhead and a bare PING, medians and ranges in microseconds (JSON)."))


def _json_flag(p: argparse.ArgumentParser, always: bool = False) -> None:
    p.add_argument("--json", action="store_true",
                   help="accepted for uniformity: this benchmark always prints JSON" if always
                   else "print JSON instead of a summary")


# --------------------------------------------------------------------------- plans


def add_plans(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=positive(int), nargs="+", default=[8, 64, 256],
                   metavar="N", help="pool sizes to time gen_plans on")
    p.add_argument("--inserts", type=positive(int), default=10_000,
                   help="prompts of 4K tokens inserted in the radix comparison")
    p.add_argument("--no-radix", action="store_true",
                   help="skip the comparison with a page-size-1 radix tree")
    _json_flag(p)
    p.set_defaults(run=run_plans)


def run_plans(args: argparse.Namespace) -> int:
    result = bench_plans(tuple(args.instances), radix=not args.no_radix, inserts=args.inserts)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for n, ms in result["gen_plans_ms"].items():
        print(f"gen_plans  N={n:>4}: {ms:8.3f} ms")
    print(f"prefix match: {result['match_tokens_per_s'] / 1e6:.1f} M tokens/s")
    versus = result["match_vs_radix"]
    if versus:
        print("radix tree (page size 1) / TokenLake, time ratios (> 1: TokenLake faster) "
              "and memory per cached token (TokenLake / radix):")
        for name, ratio in versus["ratio"].items():
            print(f"  {name:28s} {ratio:7.2f}x")
    return 0


# --------------------------------------------------------------------------- query-vs-fetch


def add_query_vs_fetch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefixes", type=positive(int), nargs="+", default=[4096, 16384, 65536],
                   metavar="TOKENS", help="prefix lengths to measure, tokens")
    _json_flag(p)
    p.set_defaults(run=run_query_vs_fetch)


def run_query_vs_fetch(args: argparse.Namespace) -> int:
    # torch and the engine processes: only when this benchmark runs
    from tokenlake.tools.bench.dataplane import bench_query_vs_fetch

    result = bench_query_vs_fetch(tuple(args.prefixes))
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for r in result["results"]:
        print(f"{r['dtype']:8s} S={r['prefix_tokens']:>6}: query {r['query_ms']:8.2f} ms {r['query_bytes']:>10} B"
              f" | fetch {r['fetch_ms']:8.2f} ms {r['fetch_bytes']:>12} B")
    return 0


# --------------------------------------------------------------------------- curve


def add_curve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", type=positive(int), default=16384, metavar="TOKENS",
                   help="prefix tokens the decode query attends over")
    p.add_argument("--rounds", type=positive(int), default=7, help="alternating rounds")
    _json_flag(p)
    p.set_defaults(run=run_curve)


def run_curve(args: argparse.Namespace) -> int:
    from tokenlake.tools.bench.curve import bench_curve  # torch and engines: only when run

    result = bench_curve(prefix_tokens=args.prefix, rounds=args.rounds)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for op in ("query", "put"):
        r = result[op]
        print(f"{op:>5}: CURVE {r['curve']['median_ms']:8.2f} ms, insecure "
              f"{r['insecure']['median_ms']:8.2f} ms, ratio {r['ratio_curve_over_insecure']:.2f}")
    return 0


# --------------------------------------------------------------------------- vllm


def add_vllm(p: argparse.ArgumentParser) -> None:
    p.add_argument("--docs", type=positive(int), default=4, help="documents (one TTFT pair each)")
    p.add_argument("--doc-tokens", type=positive(int), default=4096, metavar="TOKENS",
                   help="tokens per document (at most 8,000: the model's context)")
    p.add_argument("--mode", choices=("load", "query"), default="load",
                   help="the connector's mode: copy the prefix into vLLM (load) or attend "
                        "over it in the pool (query)")
    p.add_argument("--vllm-setup", choices=("shared", "defaults"), default="shared",
                   help="how every vLLM server runs: as docs/vllm.md recommends beside the "
                        "pool's engines (shared; vLLM alone at its own settings is measured "
                        "too), or with vLLM's own settings (defaults)")
    _json_flag(p, always=True)
    p.set_defaults(run=run_vllm)


def run_vllm(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise UsageError("bench vllm needs vLLM: pip install -e '.[vllm]' (see docs/vllm.md)")
    if args.doc_tokens > 8000:
        raise UsageError("bench vllm: --doc-tokens must be at most 8000 (the model's context)")
    from tokenlake.tools.bench.vllm import bench_vllm  # torch, engines, vLLM servers

    print(json.dumps(bench_vllm(args.docs, args.doc_tokens, mode=args.mode, setup=args.vllm_setup),
                     indent=2))
    return 0


# --------------------------------------------------------------------------- scheduler


def add_scheduler(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=positive(int), nargs="+", default=[8, 16, 64],
                   metavar="N", help="free instances of each timed decision")
    p.add_argument("--requests", type=positive(int), default=256, help="requests in the snapshot")
    p.add_argument("--prefill-share", type=fraction, default=0.25,
                   help="share of the requests in prefill (the rest decode)")
    p.add_argument("--repeats", type=positive(int), default=5, help="timed decisions per N")
    p.add_argument("--prefill-dops", choices=("all", "pow2"), default="all",
                   help="prefill degrees of parallelism the DP considers")
    _json_flag(p, always=True)
    p.set_defaults(run=run_scheduler)


def run_scheduler(args: argparse.Namespace) -> int:
    # numpy (the goodput DP): only when this benchmark runs
    from scheduler.bench import bench_scheduler

    result = bench_scheduler(tuple(args.instances), args.requests, args.prefill_share,
                             args.repeats, prefill_dops=args.prefill_dops)
    result["config"] = {"requests": args.requests, "prefill_share": args.prefill_share,
                        "prefill_dops": args.prefill_dops}
    print(json.dumps(result, indent=2))
    return 0


# --------------------------------------------------------------------------- http


def add_http(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pairs", type=positive(int), default=30,
                   help="measured request pairs (direct, HTTP)")
    p.add_argument("--prompt-tokens", type=positive(int), default=64, help="prompt length")
    p.add_argument("--max-tokens", type=positive(int), default=4, help="tokens generated")
    p.add_argument("--instances", type=positive(int), default=2,
                   help="pool instances (--backend pool)")
    p.add_argument("--backend", choices=("instant", "pool"), default="instant",
                   help="'instant': no model, the HTTP layer's cost alone; 'pool': SmolLM2 "
                        "through a local pool")
    _json_flag(p, always=True)
    p.set_defaults(run=run_http)


def run_http(args: argparse.Namespace) -> int:
    # torch, the model and the HTTP stack: only when this benchmark runs
    from tokenlake.tools.bench.http import bench_http

    print(json.dumps(bench_http(args.pairs, args.prompt_tokens, args.max_tokens,
                                args.instances, backend=args.backend), indent=2))
    return 0


# --------------------------------------------------------------------------- soak


def add_soak(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=positive(float), default=30.0, help="how long to run")
    p.add_argument("--instances", type=positive(int), default=2, help="pool instances")
    p.add_argument("--interval", type=positive(float), default=10.0,
                   help="seconds between samples")
    p.add_argument("--warmup", type=positive(float), default=10.0,
                   help="seconds before the first sample")
    _json_flag(p, always=True)
    p.set_defaults(run=run_soak)


def run_soak(args: argparse.Namespace) -> int:
    import sys

    from tokenlake.tools.bench.soak import bench_soak

    result = bench_soak(args.minutes, args.instances, args.interval, args.warmup,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result, indent=2))
    return 0


# --------------------------------------------------------------------------- sim


def add_sim(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None,
                   help="Mooncake-format JSONL trace (default: the shipped synthetic Mooncake "
                        "trace, shared/data/mooncake_synthetic_trace.jsonl beside the checkout)")
    p.add_argument("--system", default="tokenlake", choices=SYSTEM_NAMES, help="simulated system")
    p.add_argument("--repeat", type=positive(int), default=3,
                   help="copies of the trace replayed back to back")
    p.add_argument("--instances", type=positive(int), default=8, help="GPUs")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--speedup", type=positive(float), default=None,
                      help="divide the trace's arrival times by this factor")
    when.add_argument("--rate", type=positive(float), default=None,
                      help="Poisson arrivals at this many requests/s instead of the trace's times")
    p.add_argument("--limit", type=positive(int), default=None, help="first N requests only")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals")
    _json_flag(p, always=True)
    p.set_defaults(run=run_sim)


def run_sim(args: argparse.Namespace) -> int:
    # numpy and the simulator: only when this benchmark runs
    from evals.sim.bench import DEFAULT_TRACE, bench

    trace = args.trace or str(DEFAULT_TRACE)
    if not os.path.isfile(trace):
        raise UsageError(f"bench sim: trace file not found: {trace}")
    print(json.dumps(bench(trace, args.system, args.repeat, args.instances, args.speedup,
                           args.rate, args.limit, args.seed), indent=2))
    return 0


# --------------------------------------------------------------------------- restart


def add_restart(p: argparse.ArgumentParser) -> None:
    defaults = ServeSettings()  # serve's, for the help
    p.add_argument("--rounds", type=positive(int), default=3,
                   help="rounds (each: adopt and cold, alternately first)")
    p.add_argument("--instances", type=positive(int), default=None,
                   help=f"pool instances (unset: serve's default, {defaults.instances})")
    p.add_argument("--pool-mb", type=positive(int), default=None, metavar="MIB",
                   help=f"slab MiB per instance (unset: serve's default, {defaults.pool_mb})")
    p.add_argument("--orphan-grace-s", type=positive(float), default=60.0, metavar="S",
                   help="the adopt mode's --orphan-grace-s (the cold mode's: 0)")
    p.add_argument("--max-tokens", type=positive(int), default=8, help="tokens of each answer")
    p.add_argument("--document-copies", type=positive(int), default=1, metavar="N",
                   help="the demo document (about 440 tokens) N times over: a longer cached prefix")
    p.add_argument("--start-timeout", type=positive(float), default=300.0, metavar="S",
                   help="seconds one 'tokenlake serve' may take to be ready")
    _json_flag(p)
    p.set_defaults(run=run_restart)


def run_restart(args: argparse.Namespace) -> int:
    import sys

    # torch (the kernels' instruction set) and the serve processes: only when it runs
    from tokenlake.tools.bench.restart import RestartConfig, bench_restart, print_report

    config = RestartConfig(rounds=args.rounds, instances=args.instances, pool_mb=args.pool_mb,
                           orphan_grace_s=args.orphan_grace_s, max_tokens=args.max_tokens,
                           start_timeout_s=args.start_timeout, document_copies=args.document_copies)
    try:
        result = bench_restart(config, progress=lambda line: print(
            f"bench restart: {line}", file=sys.stderr, flush=True))
    except RuntimeError as exc:  # a serve that does not start, a pool too small to answer
        raise UsageError(f"bench restart: {exc}") from None
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0


# --------------------------------------------------------------------------- roundtrip


def add_roundtrip(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=positive(int), default=20,
                   help="passes over every layer per row count (after one warm-up pass)")
    p.add_argument("--device", default="cpu", type=device_name,
                   help="'cuda' or 'cuda:N': the pool's buffers on that GPU (bfloat16 K/V)")
    _json_flag(p)
    p.set_defaults(run=run_roundtrip)


def run_roundtrip(args: argparse.Namespace) -> int:
    import sys

    # torch and a local pool: only when it runs
    from tokenlake.tools.bench.roundtrip import bench_roundtrip, print_report

    check_device(args.device, "bench roundtrip")
    result = bench_roundtrip(args.repeats, progress=lambda line: print(
        f"bench roundtrip: {line}", file=sys.stderr, flush=True), device=args.device)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0
