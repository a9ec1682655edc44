"""``tokenlake eval validate`` and ``tokenlake eval decode-batches``: the runs of ``tokenlake
eval`` on the real engines (the simulator's experiments are :mod:`tokenlake.tools.cli.eval`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenlake.tools.cli.args import UsageError


def write_result(args: argparse.Namespace, result: dict, name: str) -> Path:
    """Writes a real-engine run's ``result`` to ``--out`` (default ``results/NAME``) as
    ``NAME.json`` (dashes as underscores), and prints it with ``--json``."""
    out = Path(args.out or f"results/{name}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name.replace('-', '_')}.json"
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result, indent=2))
    return path


def run_validate(args: argparse.Namespace) -> int:
    # torch and the real engines: only when the validation runs
    from evals.validate import validate

    kw = {"instances": args.instances} if args.instances else {}
    result = validate(seed=args.seed, **kw)
    path = write_result(args, result, "validate")
    if not args.json:
        print(f"{result['instances']} instances, DoP up to {result['max_dop']}: mean iteration "
              f"{result['mean_iteration_s']['sim']:.3f} s simulated vs {result['mean_iteration_s']['real']:.3f} s "
              f"measured ({result['iteration_latency_error']:.0%} off); query-engine busy time per "
              f"instance at most {result['per_instance_busy_error']:.0%} off; hit rates equal: "
              f"{result['hit_rate']['equal']} (by construction); written to {path}")
    lat = result["latency_model"]
    if not lat["same_machine"]:
        print(f"note: the latency model {lat['name']} was measured on {lat['measured_on'] or 'an unrecorded machine'}, "
              f"not on this one ({lat['this_machine']}); re-measure it here (tokenlake profile-latency, "
              "docs/scheduling.md) for the comparison to mean anything", file=sys.stderr)
    ok = result["mean_iteration_s"]["within_20pct"] and result["query_busy_s"]["within_20pct"]
    return 0 if result["hit_rate"]["equal"] and ok else 1


def run_decode_batches(args: argparse.Namespace) -> int:
    if args.rates and len(args.rates) != 1:
        raise UsageError("eval decode-batches runs at one rate")
    # torch and the real engines: only when it runs
    from evals.decode_batches import compare

    kw = {"instances": args.instances} if args.instances else {}
    if args.rates:
        kw["rate"] = args.rates[0]
    say = (lambda _: None) if args.quiet or args.json else (lambda m: print(m, file=sys.stderr))
    result = compare(seed=args.seed, progress=say, **kw)
    path = write_result(args, result, "decode-batches")
    if not args.json:
        rules = result["rules"]
        for rule, m in rules.items():
            print(f"{rule:>6}: {m['tbt_misses']['median']:.0f} of {m['tbt_gaps']['median']:.0f} "
                  f"token gaps over the {result['tbt_slo_s'] * 1e3:.0f} ms SLO (range "
                  f"{m['tbt_misses']['min']:.0f}-{m['tbt_misses']['max']:.0f}), "
                  f"{m['requests_within_slo']['median']:.0%} of requests within it, "
                  f"{m['decode_moves']['median']:.0f} decode moves")
        print(f"answers equal: {result['answers_equal']}; written to {path}")
    return 0
