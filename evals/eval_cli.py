"""``tokenlake eval <experiment>``: run one of the paper's §7 experiments on the simulator
and write CSV, JSON, PNG figures and a markdown report (see :mod:`evals.experiments`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    from evals.experiments import DEFAULT_RATES, EXPERIMENTS, MAIN_SYSTEMS, WORKLOADS

    p = argparse.ArgumentParser(prog="tokenlake eval", description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", choices=sorted(EXPERIMENTS) + ["validate"],
                   help="validate: the simulator against the real engines (evals/validate.py)")
    p.add_argument("--workload", nargs="+", default=None,
                   help=f"e2e: any of {', '.join(WORKLOADS)}; others: one (default loogle)")
    p.add_argument("--systems", nargs="+", default=None, help=f"default: {' '.join(MAIN_SYSTEMS)}")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="request rates (req/s); e2e/multi-node: the sweep, others: one rate")
    p.add_argument("--cache-gb", type=float, nargs="+", default=None,
                   help="hit-rate/elasticity: KV GB per instance to sweep")
    p.add_argument("--instances", type=int, default=None)
    p.add_argument("--scale", type=float, default=1.0, help="shrink requests and contexts (0.1: quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1,
                   help="simulations run in parallel processes (results do not depend on it)")
    p.add_argument("--out", default=None, help="output folder (default results/<experiment>)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from dataclasses import replace

    if args.experiment == "validate":
        from evals.validate import validate

        result = validate(seed=args.seed)
        out = Path(args.out or "results/validate")
        out.mkdir(parents=True, exist_ok=True)
        (out / "validate.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(result, indent=2))
        return 0 if result["hit_rate"]["equal"] and result["mean_iteration_s"]["within_20pct"] else 1

    from evals.report import write
    from evals.sim.config import SimConfig

    config = SimConfig(instances=16 if args.experiment == "multi-node" else 8)
    if args.instances:
        config = replace(config, instances=args.instances)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    kw: dict = {"scale": args.scale, "seed": args.seed, "config": config, "workers": args.jobs}
    if args.systems and args.experiment != "elasticity":
        kw["systems"] = tuple(args.systems)
    if args.experiment == "e2e":
        if args.workload:
            bad = [w for w in args.workload if w not in WORKLOADS]
            if bad:
                p.error(f"unknown workload(s) {bad}; valid: {', '.join(WORKLOADS)}")
            kw["workloads"] = tuple(args.workload)
        if args.rates:
            kw["rates"] = {w: tuple(args.rates) for w in kw.get("workloads", WORKLOADS)}
    elif args.experiment == "multi-node":
        if args.rates:
            kw["rates"] = tuple(args.rates)
    else:
        if args.workload:
            if len(args.workload) != 1 or args.workload[0] not in DEFAULT_RATES:
                p.error(f"{args.experiment} takes one workload of {', '.join(DEFAULT_RATES)}")
            kw["workload"] = args.workload[0]
        if args.rates:
            if len(args.rates) != 1:
                p.error(f"{args.experiment} runs at one rate")
            kw["rate"] = args.rates[0]
        if args.cache_gb and args.experiment in ("hit-rate", "elasticity"):
            kw["cache_gb"] = tuple(args.cache_gb)
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(desc=args.experiment, unit="run", file=sys.stderr)

    def progress(label: str, total: int) -> None:
        if bar is not None:
            bar.total = total  # known once the experiment has built its grid
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

    try:
        res = EXPERIMENTS[args.experiment](progress=progress, **kw)
    except ValueError as exc:
        print(f"tokenlake eval: {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    files = write(res, Path(args.out or f"results/{args.experiment}"), plots=not args.no_plots)
    print(json.dumps({"summary": res.summary, "files": files}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
