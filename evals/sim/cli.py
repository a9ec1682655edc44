"""``tokenlake sim``: replay a trace on one simulated system and print its metrics.

This module only builds the argument parser at import (``tokenlake.tools.cli`` imports it to
add the subcommand; nothing heavy is imported until :func:`run`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SYSTEM_NAMES = ("tokenlake", "tokenlake-1p3d", "tokenlake-3p1d", "sglang-router",
                "round-robin", "flowkv", "mooncake-1p3d", "mooncake-3p1d")
SUMMARY = ("system", "requests", "hit_rate", "cv", "mean_ttft_s", "p90_ttft_s", "mean_tbt_s",
           "p90_tbt_s", "input_token_latency_s", "output_token_latency_s", "slo_attainment",
           "throughput_rps", "sim_wall_s", "events_per_s")


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``tokenlake sim`` options (see docs/simulator.md)."""
    p.add_argument("--trace", required=True,
                   help="Mooncake-format JSONL trace (timestamp ms, input_length, output_length, hash_ids)")
    p.add_argument("--system", default="tokenlake", choices=SYSTEM_NAMES)
    p.add_argument("--instances", type=_positive(int), default=8, help="GPUs (default 8)")
    p.add_argument("--cache-gb", type=_positive(float), default=None,
                   help="KV-cache memory per GPU, GB (default: GPU memory minus the weights)")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--rate", type=_positive(float), default=None,
                      help="Poisson arrivals at this many requests/s instead of the trace's times")
    when.add_argument("--speedup", type=_positive(float), default=None,
                      help="divide the trace's arrival times by this factor")
    p.add_argument("--limit", type=_positive(int), default=None, help="first N requests only")
    p.add_argument("--repeat", type=_positive(int), default=1,
                   help="replay the trace this many times back to back (speed benchmark)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hardware", default="a100-80gb")
    p.add_argument("--model", default="llama-2-7b")
    p.add_argument("--segment-tokens", type=_positive(int), default=None)
    p.add_argument("--chunk-tokens", type=_positive(int), default=512)
    p.add_argument("--tp", type=_positive(int), default=2, help="baselines' tensor parallelism")
    p.add_argument("--slo-scale", type=_positive(float), default=10.0)
    p.add_argument("--series", action="store_true", help="include the per-window CVs")
    p.add_argument("--json", action="store_true", help="print JSON only (no progress bar)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Runs the simulation the parsed ``args`` describe; returns the exit code."""
    if not os.path.isfile(args.trace):
        print(f"tokenlake sim: error: trace file not found: {args.trace}", file=sys.stderr)
        return 2
    from evals.sim.config import SimConfig
    from evals.sim.engine import SimulationError
    from evals.sim.systems import simulate
    from evals.sim.trace import arrange, load_trace
    from tokenlake.core.errors import ConfigError

    try:
        config = SimConfig(instances=args.instances, hardware=args.hardware, model=args.model,
                           cache_gb=args.cache_gb, segment_tokens=args.segment_tokens,
                           chunk_tokens=args.chunk_tokens, tp=args.tp,
                           slo_scale=args.slo_scale, seed=args.seed)
        config.resolve()
        reqs = arrange(load_trace(args.trace, args.limit), args.rate, args.speedup,
                       args.repeat, args.seed)
    except (ConfigError, ValueError) as exc:
        print(f"tokenlake sim: error: {exc}", file=sys.stderr)
        return 2
    if not reqs:
        print(f"tokenlake sim: error: no requests in {args.trace}", file=sys.stderr)
        return 2
    bar = _progress_bar(len(reqs), disabled=args.json or args.quiet)
    try:
        result = simulate(reqs, args.system, config, bar.update if bar else None)
    except (SimulationError, ValueError) as exc:
        print(f"tokenlake sim: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar:
            bar.close()
    out = result.to_dict(series=args.series)
    out["config"] = {"trace": os.path.basename(args.trace), "rate": args.rate,
                     "speedup": args.speedup, "limit": args.limit, "repeat": args.repeat,
                     "cache_gb": args.cache_gb, "tp": args.tp, "chunk_tokens": args.chunk_tokens,
                     "seed": args.seed}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key in SUMMARY:
            value = out[key]
            print(f"{key:24s} {value:.4g}" if isinstance(value, float) else f"{key:24s} {value}")
    return 0


def _progress_bar(total: int, disabled: bool):
    """A tqdm bar on stderr counting finished requests, or None."""
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the eval extra is optional
        return None
    bar = tqdm(total=total, unit="req", file=sys.stderr, desc="simulating")

    class _Bar:
        def __init__(self) -> None:
            self.done = 0

        def update(self, finished: int) -> None:
            if finished != self.done:
                bar.update(finished - self.done)
                self.done = finished

        def close(self) -> None:
            bar.close()

    return _Bar()
