"""``tokenlake eval EXPERIMENT`` and ``tokenlake sim --trace FILE``: the paper's §7
experiments and single trace replays on the simulator (docs/evaluation.md,
docs/simulator.md).

The simulator and the experiments import numpy, so :mod:`evals` is imported only when a
command runs; the names they accept are listed here for the parser, and
``tests/test_cli.py`` checks them against the registries in :mod:`evals`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from scheduler.admission import ADMISSION_RULES
from tokenlake.core.specs import list_hardware, list_models
from tokenlake.tools.cli.args import UsageError, positive

#: ``evals.sim.systems.SYSTEMS``: the systems the simulator runs.
SYSTEM_NAMES = ("tokenlake", "tokenlake-1p3d", "tokenlake-3p1d", "sglang-router",
                "round-robin", "flowkv", "mooncake-1p3d", "mooncake-3p1d", "banaserve")
#: ``evals.experiments.EXPERIMENTS``: the §7 experiments (``validate`` is added to them).
EXPERIMENT_NAMES = ("e2e", "load-balance", "hit-rate", "elasticity", "multi-node")
#: What runs the real engines instead of the simulator.
REAL_ENGINE_RUNS = ("validate", "decode-batches")
#: ``evals.experiments.DEFAULT_RATES``: the workloads; ``e2e`` takes the first three
#: (``evals.experiments.WORKLOADS``), the one-workload experiments any of them.
WORKLOAD_NAMES = ("loogle", "scbench", "sharegpt", "mixed")
E2E_WORKLOADS = WORKLOAD_NAMES[:3]
#: ``evals.experiments.MAIN_SYSTEMS``: the systems an experiment compares by default.
MAIN_SYSTEMS = ("tokenlake", "sglang-router", "mooncake-1p3d", "mooncake-3p1d", "banaserve")
#: What ``tokenlake sim`` prints without ``--json``.
SUMMARY = ("system", "requests", "hit_rate", "cv", "mean_ttft_s", "p90_ttft_s", "mean_tbt_s",
           "p90_tbt_s", "input_token_latency_s", "output_token_latency_s", "slo_attainment",
           "throughput_rps", "sim_wall_s", "events_per_s")


def register(sub: argparse._SubParsersAction) -> None:
    """Adds ``eval`` and ``sim`` to the command tree."""
    add_eval(sub.add_parser(
        "eval", help="run a paper §7 experiment on the simulator (docs/evaluation.md)",
        description="Runs one of the paper's §7 experiments on the simulator and writes CSV, "
                    "JSON, PNG figures and a markdown report. 'validate' compares the simulator "
                    "with the real engines and exits 1 when they disagree."))
    add_sim(sub.add_parser(
        "sim", help="replay a trace on a simulated cluster (docs/simulator.md)",
        description="Replays a Mooncake-format trace on one simulated system and prints its "
                    "metrics. Exit code 1 when the simulation cannot finish the trace."))


def _progress_bar(total: int | None, desc: str, unit: str, disabled: bool):
    """A tqdm bar on stderr, or None (disabled, or the optional eval extra is missing)."""
    if disabled:
        return None
    try:  # tqdm comes with the optional eval extra
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)


def add_tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tier-gb", type=float, default=0.0, help="TokenLake: a tier of this many GB "
                   "per GPU below the pool (0: none; the baselines have none)")
    p.add_argument("--tier-medium", choices=("disk", "host"), default="disk", help="the tier "
                   "is an NVMe SSD (disk) or host memory read over PCIe (host), at the hardware "
                   "profile's tier_read_bw or host_tier_bw")
    p.add_argument("--tier-read-gbs", type=positive(float), default=None, help="the tier's read "
                   "GB/s per GPU instead of the profile's")


# --------------------------------------------------------------------------- eval


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", choices=(*EXPERIMENT_NAMES, *REAL_ENGINE_RUNS),
                   help="the experiment; validate: the simulator against the real engines; "
                        "decode-batches: the real engines serving chats with kept decode "
                        "batches against re-formed ones (one rate of --rates, default 4)")
    p.add_argument("--workload", nargs="+", default=None, choices=WORKLOAD_NAMES,
                   help=f"e2e: any of {', '.join(E2E_WORKLOADS)} (default: all); the others: "
                        "one (default loogle; multi-node runs mixed)")
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEM_NAMES,
                   help=f"systems to compare (default: {' '.join(MAIN_SYSTEMS)}; elasticity "
                        "runs its own five)")
    p.add_argument("--rates", type=positive(float), nargs="+", default=None,
                   help="request rates (req/s); e2e/multi-node: the sweep (default: calibrated "
                        "per workload), others: one rate (default: near TokenLake's knee)")
    p.add_argument("--cache-gb", type=positive(float), nargs="+", default=None,
                   help="hit-rate/elasticity: KV GB per instance to sweep (default 8 ... 48); "
                        "the others: one size (default: GPU memory minus the weights)")
    p.add_argument("--instances", type=positive(int), default=None,
                   help="GPUs (default: 8; multi-node 16)")
    add_tier_args(p)
    p.add_argument("--page-tokens", type=positive(int), default=None,
                   help="TokenLake: prefix hits exact to this many tokens (default 16)")
    p.add_argument("--admission", choices=ADMISSION_RULES, default="cache-first",
                   help="TokenLake's admission order in a full pool (scheduler/admission.py; "
                        "fcfs: arrival order, to compare)")
    p.add_argument("--eviction-choices", type=positive(int), default=2,
                   help="TokenLake: a full pool evicts the LRU victim of the home and the next "
                        "N-1 instances on the ring (1: the home only)")
    p.add_argument("--reform-decode-batches", action="store_true",
                   help="TokenLake: batch every decode request afresh at each decision (the "
                        "stateless DP; default: running decode batches stay together unless "
                        "the SLO asks; to compare)")
    p.add_argument("--no-decode-first", action="store_true",
                   help="TokenLake: match every batch to instances by bytes alone (default: "
                        "decode batches first, where they need not wait; to compare)")
    p.add_argument("--per-row-reads", action="store_true",
                   help="every decode row reads its whole prefix, also what other rows of its "
                        "batch read (default: shared prefix KV read once per batch, as "
                        "TokenLake's query engines and vLLM's cascade attention do; to compare)")
    p.add_argument("--trace", default=None,
                   help="hit-rate, e2e: a Mooncake-format JSONL trace instead of --workload. "
                        "hit-rate: at its own arrival times (or --rates), the summary adds the "
                        "reuse counted from its block ids; e2e: Poisson at each of --rates, or "
                        "its own times sped up 1, 2, 4, 8, 16x")
    p.add_argument("--zipf", type=float, default=0.0,
                   help="skew of LooGLE's document popularity: question i asks document d "
                        "with probability ~ (d+1)^-S (0: uniform counts, the default)")
    p.add_argument("--scale", type=positive(float), default=1.0,
                   help="shrink requests and contexts (0.1: quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of workloads and arrivals")
    p.add_argument("--jobs", type=positive(int), default=1,
                   help="simulations run in parallel processes (results do not depend on it)")
    p.add_argument("--out", default=None, help="output folder (default: results/EXPERIMENT)")
    p.add_argument("--no-plots", action="store_true", help="no PNG figures")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="validate, decode-batches: print only the comparison as JSON (it is also "
                        "written to --out)")
    p.set_defaults(run=run_eval)


def _experiment_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``EXPERIMENTS[args.experiment]`` (config excluded)."""
    kw: dict = {"scale": args.scale, "seed": args.seed, "workers": args.jobs}
    if args.systems and args.experiment != "elasticity":
        kw["systems"] = tuple(args.systems)
    if args.experiment == "e2e":
        if args.workload:
            bad = [w for w in args.workload if w not in E2E_WORKLOADS]
            if bad:
                raise UsageError(f"eval e2e: unknown workload(s) {', '.join(bad)}; "
                                 f"valid: {', '.join(E2E_WORKLOADS)}")
            kw["workloads"] = tuple(args.workload)
        if args.rates:
            kw["rates"] = {w: tuple(args.rates) for w in kw.get("workloads", E2E_WORKLOADS)}
    elif args.experiment == "multi-node":
        if args.rates:
            kw["rates"] = tuple(args.rates)
    else:
        if args.workload:
            if len(args.workload) != 1:
                raise UsageError(f"eval {args.experiment} takes one workload of "
                                 f"{', '.join(WORKLOAD_NAMES)}")
            kw["workload"] = args.workload[0]
        if args.rates:
            if len(args.rates) != 1:
                raise UsageError(f"eval {args.experiment} runs at one rate")
            kw["rate"] = args.rates[0]
        if args.cache_gb and args.experiment in ("hit-rate", "elasticity"):
            kw["cache_gb"] = tuple(args.cache_gb)
    if args.trace is not None:
        if args.experiment not in ("hit-rate", "e2e"):
            raise UsageError(f"eval {args.experiment}: --trace is for hit-rate and e2e")
        if args.workload:
            raise UsageError(f"eval {args.experiment}: give --trace or --workload, not both")
        if not os.path.isfile(args.trace):
            raise UsageError(f"eval {args.experiment}: trace file not found: {args.trace}")
        kw["trace"] = args.trace
        if args.experiment == "e2e":
            kw.pop("workloads", None)
            kw["rates"] = {"trace": tuple(args.rates)} if args.rates else None
    if args.zipf:
        if not args.zipf > 0 or args.trace is not None:
            raise UsageError("--zipf takes a number > 0 and skews LooGLE's documents (no --trace)")
        named = args.workload or ("loogle",)
        if args.experiment != "e2e" and not set(named) & {"loogle", "mixed"}:
            raise UsageError(f"eval {args.experiment}: --zipf skews LooGLE's documents; "
                             f"workload {named[0]} has none")
        kw["zipf"] = args.zipf
    return kw


def run_eval(args: argparse.Namespace) -> int:
    """0 when written; 1 (one line on stderr) when a simulation cannot finish;
    ``validate``: 1 when the simulator and the engines disagree."""
    if args.experiment in REAL_ENGINE_RUNS:  # the real engines, not the simulator
        from tokenlake.tools.cli import eval_real

        return (eval_real.run_validate if args.experiment == "validate" else eval_real.run_decode_batches)(args)
    kw = _experiment_kwargs(args)
    # numpy, the simulator and matplotlib: only when an experiment runs
    from evals.experiments import EXPERIMENTS
    from evals.report import write
    from evals.sim.config import SimConfig

    config = SimConfig(instances=16 if args.experiment == "multi-node" else 8,
                       page_tokens=args.page_tokens, admission=args.admission,
                       eviction_choices=args.eviction_choices,
                       decode_first=not args.no_decode_first,
                       decode_batches="reform" if args.reform_decode_batches else "keep",
                       grouped_reads=not args.per_row_reads, tier_gb=args.tier_gb,
                       tier_medium=args.tier_medium, tier_read_gbs=args.tier_read_gbs)
    if args.instances:
        config = replace(config, instances=args.instances)
    if args.cache_gb and args.experiment not in ("hit-rate", "elasticity"):
        if len(args.cache_gb) != 1:
            raise UsageError(f"eval {args.experiment} runs at one --cache-gb")
        config = replace(config, cache_gb=args.cache_gb[0])
    bar = _progress_bar(None, args.experiment, "run", args.quiet)

    def progress(label: str, total: int) -> None:
        if bar is not None:
            bar.total = total  # known once the experiment has built its grid
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

    from evals.sim.backend import SimulationError

    try:
        res = EXPERIMENTS[args.experiment](progress=progress, config=config, **kw)
    except ValueError as exc:  # an input the experiment refuses (ConfigError included)
        raise UsageError(f"eval {args.experiment}: {exc}") from None
    except SimulationError as exc:  # a run could not finish: not a usage mistake
        print(f"tokenlake: eval {args.experiment} failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    files = write(res, Path(args.out or f"results/{args.experiment}"), plots=not args.no_plots)
    print(json.dumps({"summary": res.summary, "files": files}, indent=2, default=str))
    return 0


# --------------------------------------------------------------------------- sim


def add_sim(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True,
                   help="Mooncake-format JSONL trace (timestamp ms, input_length, "
                        "output_length, hash_ids)")
    p.add_argument("--system", default="tokenlake", choices=SYSTEM_NAMES, help="simulated system")
    p.add_argument("--instances", type=positive(int), default=8, help="GPUs")
    p.add_argument("--cache-gb", type=positive(float), default=None,
                   help="KV-cache memory per GPU, GB (default: GPU memory minus the weights)")
    add_tier_args(p)
    when = p.add_mutually_exclusive_group()
    when.add_argument("--rate", type=positive(float), default=None,
                      help="Poisson arrivals at this many requests/s instead of the trace's times")
    when.add_argument("--speedup", type=positive(float), default=None,
                      help="divide the trace's arrival times by this factor")
    p.add_argument("--limit", type=positive(int), default=None, help="first N requests only")
    p.add_argument("--repeat", type=positive(int), default=1,
                   help="replay the trace this many times back to back (speed benchmark)")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and placement")
    p.add_argument("--hardware", default="a100-80gb", choices=list_hardware(),
                   help="hardware profile of every GPU")
    p.add_argument("--model", default="llama-2-7b", choices=list_models(), help="served model")
    p.add_argument("--segment-tokens", type=positive(int), default=None,
                   help="tokens per segment (default: the §4.2 threshold rule)")
    p.add_argument("--chunk-tokens", type=positive(int), default=512,
                   help="prefill chunk, tokens")
    p.add_argument("--page-tokens", type=positive(int), default=None,
                   help="TokenLake: prefix hits exact to this many tokens (default 16; the "
                        "segment size: whole segments only)")
    p.add_argument("--global-lru", action="store_true",
                   help="TokenLake: a full pool evicts the global LRU victim instead of the "
                        "new segment's home's (to compare the placement rules)")
    p.add_argument("--eviction-choices", type=positive(int), default=2,
                   help="TokenLake: a full pool evicts the LRU victim of the home and the next "
                        "N-1 instances on the ring (1: the home only)")
    p.add_argument("--admission", choices=ADMISSION_RULES, default="cache-first",
                   help="TokenLake's admission order in a full pool (scheduler/admission.py; "
                        "fcfs: arrival order, to compare)")
    p.add_argument("--reform-decode-batches", action="store_true",
                   help="TokenLake: batch every decode request afresh at each decision (the "
                        "stateless DP; default: running decode batches stay together unless "
                        "the SLO asks; to compare)")
    p.add_argument("--no-decode-first", action="store_true",
                   help="TokenLake: match every batch to instances by bytes alone (default: "
                        "decode batches first, where they need not wait; to compare)")
    p.add_argument("--per-row-reads", action="store_true",
                   help="every decode row reads its whole prefix, also what other rows of its "
                        "batch read (default: shared prefix KV read once per batch, as "
                        "TokenLake's query engines and vLLM's cascade attention do; to compare)")
    p.add_argument("--tp", type=positive(int), default=2, help="baselines' tensor parallelism")
    p.add_argument("--slo-scale", type=positive(float), default=10.0,
                   help="SLO as a multiple of the unloaded latency")
    p.add_argument("--series", action="store_true",
                   help="include the per-window CVs and, pooled, the timeline of instances per "
                        "phase ([time, prefill, decode] at each change)")
    p.add_argument("--json", action="store_true", help="print JSON only (no progress bar)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run_sim)


def _load_requests(args: argparse.Namespace):
    """``(config, requests)`` for ``tokenlake sim``; bad input raises :class:`UsageError`."""
    if not os.path.isfile(args.trace):
        raise UsageError(f"sim: trace file not found: {args.trace}")
    # numpy and the simulator: only when a simulation runs
    from evals.sim.config import SimConfig
    from evals.sim.trace import arrange, load_trace

    try:  # ConfigError is a ValueError
        config = SimConfig(instances=args.instances, hardware=args.hardware, model=args.model,
                           cache_gb=args.cache_gb, tier_gb=args.tier_gb,
                           tier_medium=args.tier_medium, tier_read_gbs=args.tier_read_gbs,
                           segment_tokens=args.segment_tokens,
                           chunk_tokens=args.chunk_tokens, tp=args.tp,
                           slo_scale=args.slo_scale, seed=args.seed,
                           page_tokens=args.page_tokens, home_eviction=not args.global_lru,
                           admission=args.admission, eviction_choices=args.eviction_choices,
                           decode_first=not args.no_decode_first,
                       decode_batches="reform" if args.reform_decode_batches else "keep",
                       grouped_reads=not args.per_row_reads)
        config.resolve()
        reqs = arrange(load_trace(args.trace, args.limit), args.rate, args.speedup,
                       args.repeat, args.seed)
    except ValueError as exc:
        raise UsageError(f"sim: {exc}") from None
    if not reqs:
        raise UsageError(f"sim: no requests in {args.trace}")
    return config, reqs


def run_sim(args: argparse.Namespace) -> int:
    """0 when the trace was replayed; 1 (one line on stderr) when the simulation failed."""
    config, reqs = _load_requests(args)
    # numpy and the simulator: only when a simulation runs
    from evals.sim.backend import SimulationError
    from evals.sim.systems import simulate

    bar = _progress_bar(len(reqs), "simulating", "req", args.json or args.quiet)
    done = [0]

    def advance(finished: int) -> None:  # the simulator reports a running count
        if finished != done[0]:
            bar.update(finished - done[0])
            done[0] = finished

    try:
        result = simulate(reqs, args.system, config, None if bar is None else advance)
    except SimulationError as exc:  # the run could not finish: not a usage mistake
        print(f"tokenlake: sim failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    out = result.to_dict(series=args.series)
    out["config"] = {"trace": os.path.basename(args.trace), "rate": args.rate,
                     "speedup": args.speedup, "limit": args.limit, "repeat": args.repeat,
                     "cache_gb": args.cache_gb, "tier_gb": args.tier_gb,
                     "tier_medium": args.tier_medium, "tp": args.tp,
                     "chunk_tokens": args.chunk_tokens,
                     "seed": args.seed}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for key in SUMMARY:
        value = out[key]
        print(f"{key:24s} {value:.4g}" if isinstance(value, float) else f"{key:24s} {value}")
    split = out["extra"].get("instances_per_phase")
    if split is not None:  # pooled systems: what the scheduler gave each phase
        print(f"{'instances_per_phase':24s} prefill {split['prefill']:.2f}, decode "
              f"{split['decode']:.2f}, idle {split['idle']:.2f} (mean over time; "
              f"{split['changes']} changes of the split)")
    return 0
