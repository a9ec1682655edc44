"""``tokenlake bench serve``'s options and its command: a load generator for a served
pool's OpenAI-compatible HTTP API (the benchmark itself is
:mod:`tokenlake.tools.bench.serve`, imported when it runs), optionally against a baseline
server or with both launched by ``--launch``, and with ``--mixed N`` compute engines on
the same pool through ``tokenlake.connect`` (:mod:`tokenlake.tools.bench.serve_mixed`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

from tokenlake.tools.cli.args import UsageError, at_least, positive

WORKLOADS = ("loogle", "sharegpt", "mooncake")  # tokenlake/tools/bench/serve_load.py


def add_serve(p: argparse.ArgumentParser) -> None:
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", default=None,
                        help="the pool's server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", action="store_true",
                        help="start 'tokenlake serve --engine pool' and '--engine reference' "
                             "(the baseline), benchmark both, stop them")
    p.add_argument("--baseline-url", default=None,
                   help="a baseline server to compare with (not with --launch)")
    p.add_argument("--instances", type=positive(int), default=2,
                   help="instances of each launched server (--launch)")
    p.add_argument("--launch-args", default="",
                   help="more arguments for both launched 'tokenlake serve', one string")
    p.add_argument("--launch-timeout", type=positive(float), default=300.0,
                   help="seconds to wait for a launched server to be ready")
    p.add_argument("--model", default=None, help="model name (default: the first one the "
                                                 "server's /v1/models lists)")
    p.add_argument("--workload", choices=WORKLOADS, default="loogle",
                   help="prompts: LooGLE-like shared documents, ShareGPT chats, or a "
                        "Mooncake trace (--trace)")
    p.add_argument("--trace", default=None,
                   help="Mooncake-format JSONL trace for --workload mooncake (default: "
                        "shared/data/mooncake_synthetic_trace.jsonl beside the checkout)")
    p.add_argument("--block-tokens", type=positive(int), default=16,
                   help="mooncake: tokens sent for each 512-token block of the trace")
    p.add_argument("--max-prompt-tokens", type=positive(int), default=2048,
                   help="prompts are cut to this many tokens")
    p.add_argument("--doc-tokens", type=positive(int), default=1500,
                   help="loogle: mean document length, tokens")
    p.add_argument("--questions-per-doc", type=positive(int), default=4,
                   help="loogle: questions sharing each document")
    p.add_argument("--system-prompt-tokens", type=at_least(int, 0), default=500,
                   help="sharegpt: length of the shared system prompt, tokens")
    p.add_argument("--num-requests", type=positive(int), default=32,
                   help="measured requests per server and round")
    p.add_argument("--max-tokens", type=positive(int), default=16,
                   help="output tokens per request at most (the workload's length, capped)")
    p.add_argument("--concurrency", type=positive(int), default=None,
                   help="requests in flight at most (default: 4 without --rate, no cap with it)")
    p.add_argument("--rate", type=positive(float), default=None,
                   help="Poisson arrivals at this many requests/s (default: a closed loop)")
    p.add_argument("--warmup", type=at_least(int, 0), default=1,
                   help="unmeasured warm-up requests per server and round (unrelated prompts)")
    p.add_argument("--rounds", type=positive(int), default=1,
                   help="rounds, each with a fresh workload seed (pool, then baseline)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and arrivals")
    p.add_argument("--timeout", type=positive(float), default=300.0,
                   help="seconds one request may take before it counts as an error")
    p.add_argument("--mixed", type=at_least(int, 0), default=0, metavar="N",
                   help="also run N compute engines on the pool through tokenlake.connect "
                        "while the HTTP load runs (synthetic K/V, every layer checked "
                        "against a float64 reference); 0: none")
    p.add_argument("--mixed-iterations", type=positive(int), default=None, metavar="K",
                   help="--mixed: K iterations per worker and round (default: as long as "
                        "the HTTP load runs)")
    p.add_argument("--control-address", default=None, metavar="tcp://HOST:PORT",
                   help="--mixed with --base-url: the pool's control address (its "
                        "credentials are found as tokenlake.connect finds them)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    p.set_defaults(run=run_serve)


def serve_config(args: argparse.Namespace):
    """The :class:`~tokenlake.tools.bench.serve.BenchConfig` of parsed arguments."""
    from tokenlake.tools.bench.serve import BenchConfig, Load
    from tokenlake.tools.bench.serve_load import WorkloadSpec

    trace = None
    if args.workload == "mooncake":
        from evals.sim.bench import DEFAULT_TRACE

        trace = args.trace or str(DEFAULT_TRACE)
        if not os.path.isfile(trace):
            raise UsageError(f"bench serve: trace file not found: {trace}")
    elif args.trace is not None:
        raise UsageError("bench serve: --trace is for --workload mooncake")
    spec = WorkloadSpec(args.workload, args.num_requests, args.max_tokens,
                        args.max_prompt_tokens, doc_tokens=args.doc_tokens,
                        questions_per_doc=args.questions_per_doc,
                        system_prompt_tokens=args.system_prompt_tokens, trace=trace,
                        block_tokens=args.block_tokens)
    concurrency = args.concurrency if args.concurrency or args.rate else 4
    return BenchConfig(spec, Load(concurrency, args.rate, args.seed, args.timeout),
                       warmup=args.warmup, rounds=args.rounds, model=args.model,
                       progress=not args.json, mixed=mixed_spec(args))


def mixed_spec(args: argparse.Namespace):
    """The :class:`~tokenlake.tools.bench.serve_mixed.MixedSpec` of ``--mixed`` (None
    without it); UsageError for options it cannot run with."""
    if not args.mixed:
        if args.mixed_iterations is not None or args.control_address is not None:
            raise UsageError("bench serve: --mixed-iterations and --control-address are for "
                             "--mixed N")
        return None
    if args.launch:
        if args.control_address is not None:
            raise UsageError("bench serve: --launch starts its own pool; drop --control-address")
        engine = _launch_engine(shlex.split(args.launch_args))
        if engine not in (None, "pool"):
            raise UsageError(f"bench serve: --mixed needs a pool, not --engine {engine} "
                             "(drop it from --launch-args)")
    elif args.control_address is None:
        raise UsageError("bench serve: --mixed with --base-url needs --control-address "
                         "tcp://HOST:PORT (the pool's control port)")
    elif not re.fullmatch(r"tcp://[^:/\s]+:\d+", args.control_address):
        raise UsageError(f"bench serve: --control-address must be tcp://HOST:PORT, got "
                         f"{args.control_address!r}")
    from tokenlake.tools.bench.serve_mixed import MixedSpec

    return MixedSpec(args.mixed, args.mixed_iterations, args.control_address,
                     ready_timeout_s=args.launch_timeout, pause_timeout_s=args.timeout)


def _launch_engine(extra: list[str]) -> str | None:
    """The ``--engine`` that ``--launch-args`` give the launched pool (the last one)."""
    engine = None
    for i, arg in enumerate(extra):
        if arg == "--engine" and i + 1 < len(extra):
            engine = extra[i + 1]
        elif arg.startswith("--engine="):
            engine = arg.split("=", 1)[1]
    return engine


def run_serve(args: argparse.Namespace) -> int:
    # httpx, evals and the tokenizer: only when this benchmark runs
    from tokenlake.tools.bench.serve import run_bench
    from tokenlake.tools.bench.serve_stats import format_mixed, format_report

    if args.launch and args.baseline_url:
        raise UsageError("bench serve: --launch starts its own baseline; drop --baseline-url")
    try:
        extra = shlex.split(args.launch_args)
    except ValueError as exc:
        raise UsageError(f"bench serve: --launch-args: {exc}") from None
    config = serve_config(args)
    launch = (args.instances, extra, args.launch_timeout) if args.launch else None
    try:
        result = run_bench(config, args.base_url, args.baseline_url, launch)
    except (ValueError, FileNotFoundError) as exc:  # options the workload cannot meet
        raise UsageError(f"bench serve: {exc}") from None
    except RuntimeError as exc:  # a server that cannot be reached or started
        print(f"tokenlake: error: bench serve: {exc}", file=sys.stderr)
        return 1
    mixed = result.get("mixed")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_report(result))
        if mixed is not None:
            print(format_mixed(mixed))
    if mixed is not None and (mixed["wrong_answers"] or mixed["http"]["wrong_answers"]
                              or any(w.get("lost") for w in mixed["workers"])):
        return 1  # a wrong answer (or a worker that could not report whether it had one)
    return 0
