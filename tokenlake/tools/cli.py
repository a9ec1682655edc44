"""The ``tokenlake`` command.

``tokenlake demo``            SmolLM2-135M through a 4-instance pool, checked against a plain engine
``tokenlake walkthrough``     control-plane walk-through (LooGLE-like workload, 8 instances)
``tokenlake bench plans``     gen_plans latency and prefix-match throughput (JSON)
``tokenlake threshold``       the paper's segment-size threshold for a model and hardware
``tokenlake profile-cpu``     measure this machine's hardware profile
``tokenlake eval EXPERIMENT`` the paper's §7 experiments on the simulator (evals/)
``tokenlake profile-latency`` measure the CPU compute engine and fit its latency model
``tokenlake serve --ray ADDR`` the pool on a Ray cluster, up until Ctrl-C (docs/deploy-ray.md)
``tokenlake sim --trace FILE``  replay a trace on one simulated system (docs/simulator.md)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace


def _demo(args: argparse.Namespace) -> int:
    from tokenlake.tools.demo import DemoConfig, print_report, run_demo

    config = DemoConfig(instances=args.instances)
    report = run_demo(config, progress=(lambda *_: None) if args.json else print)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["reference_match"] else 1


def _walkthrough(args: argparse.Namespace) -> int:
    from tokenlake.tools.walkthrough import WorkloadConfig, run

    workload = replace(WorkloadConfig(), num_requests=args.requests, seed=args.seed)
    results = [run(args.instances, replication=rep, workload=workload) for rep in (False, True)]
    if args.json:
        print(json.dumps([_result_dict(r) for r in results], indent=2))
        return 0
    print(f"Control-plane walk-through: {args.requests} LooGLE-like requests "
          f"({workload.num_documents} shared documents of {workload.document_tokens} tokens, "
          f"Zipf {workload.zipf_s}) on {args.instances} instances, C = 576 tokens\n")
    for r in results:
        title = "with heavy-hitter replication" if r.replication else "hash placement only"
        print(f"[{title}]")
        print(f"  hit rate            {r.hit_rate:6.1%}   (reused prefix tokens / input tokens)")
        print(f"  segments in pool    {r.segments:6d}   replicas made: {r.replications}")
        print(f"  deduplicated        {r.dedup_bytes / 2**30:6.2f} GiB")
        print(f"  cache-access CV     {r.mean_cv:6.1%}   (mean over time of per-instance reads)")
        total = sum(r.reads.values()) or 1
        print("  reads per instance  " + " ".join(f"{100 * v / total:4.1f}%" for v in r.reads.values()))
        print()
    return 0


def _result_dict(r) -> dict:
    return {
        "replication": r.replication,
        "requests": r.requests,
        "hit_rate": r.hit_rate,
        "cv": r.mean_cv,
        "segments": r.segments,
        "replications": r.replications,
        "dedup_bytes": r.dedup_bytes,
        "reads_per_instance": {str(k): v for k, v in r.reads.items()},
    }


def _bench(args: argparse.Namespace) -> int:
    if args.what == "e2e":
        from tokenlake.tools.bench_e2e import bench_e2e

        result = bench_e2e(instances=args.instances[0] if args.instances else 4,
                           decode_batches=tuple(args.decode_batches))
        print(json.dumps(result, indent=2) if args.json else
              f"TTFT cached {result['cached_ttft_ms']:.0f} ms vs recompute {result['recompute_ttft_ms']:.0f} ms; "
              f"decode {result['pool_decode_tok_s']:.1f} tok/s (pool) vs {result['reference_decode_tok_s']:.1f} (reference)")
        return 0
    if args.what == "scheduler":
        from scheduler.bench import bench_scheduler

        print(json.dumps(bench_scheduler(), indent=2))
        return 0
    if args.what == "query-vs-fetch":
        from tokenlake.tools.bench_dataplane import bench_query_vs_fetch

        result = bench_query_vs_fetch(tuple(args.prefixes))
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            for r in result["results"]:
                print(f"S={r['prefix_tokens']:>6}: query {r['query_ms']:8.2f} ms {r['query_bytes']:>10} B"
                      f" | fetch {r['fetch_ms']:8.2f} ms {r['fetch_bytes']:>12} B")
        return 0
    from tokenlake.tools.bench_plans import bench_plans

    result = bench_plans(tuple(args.instances or (8, 64, 256)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for n, ms in result["gen_plans_ms"].items():
            print(f"gen_plans  N={n:>4}: {ms:8.3f} ms")
        print(f"prefix match: {result['match_tokens_per_s'] / 1e6:.1f} M tokens/s")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal

    from tokenlake.core.errors import TokenLakeError
    from tokenlake.deploy.ray.cluster import RayOptions, serve

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # a service manager's stop: shut down cleanly too
    try:
        ports = None
        if args.ports:
            first, _, last = args.ports.partition("-")
            ports = (int(first), int(last or first))
        options = RayOptions(
            strategy=args.strategy, cpus_per_instance=args.cpus_per_instance,
            gpus_per_instance=args.gpus_per_instance, engine_share=args.engine_share,
            host=args.bind, port_range=ports, address=None if args.ray == "local" else args.ray,
        )
        return serve(args.instances, args.model, args.pool_mb << 20, options, args.segment_tokens,
                     args.max_rows, restart=not args.no_restart, json_lines=args.json,
                     out=lambda line: print(line, flush=True))
    except (TokenLakeError, ValueError, ConnectionError) as exc:
        print(f"tokenlake serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # during start-up: the cluster has cleaned up already
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    # Idle OpenMP workers of torch spin by default and take the CPU from the engine
    # processes on small machines (measured: zmq sends 7x slower in the compute engine).
    # Must be set before torch is imported; an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    parser = argparse.ArgumentParser(prog="tokenlake", description="TokenLake KV-cache pool")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="SmolLM2-135M served through a local 4-instance pool")
    demo.add_argument("--instances", type=int, default=4)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(fn=_demo)
    walk = sub.add_parser("walkthrough", help="control-plane walk-through (LooGLE-like, no model)")
    walk.add_argument("--instances", type=int, default=8)
    walk.add_argument("--requests", type=int, default=400)
    walk.add_argument("--seed", type=int, default=0)
    walk.add_argument("--json", action="store_true")
    walk.set_defaults(fn=_walkthrough)
    bench = sub.add_parser("bench", help="benchmarks (print figures; not tests)")
    bench.add_argument("what", choices=["plans", "query-vs-fetch", "e2e", "scheduler"])
    bench.add_argument("--prefixes", type=int, nargs="+", default=[4096, 16384, 65536])
    bench.add_argument("--instances", type=int, nargs="+", default=None,
                       help="plans: N values (default 8 64 256); e2e: instances (default 4)")
    bench.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8],
                       help="e2e: decode batch sizes to measure; the first is the headline figure")
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(fn=_bench)
    th = sub.add_parser("threshold", help="segment-size threshold (paper §4.2)")
    th.add_argument("--model", default="llama-2-7b")
    th.add_argument("--hardware", default="a100-80gb")
    th.set_defaults(fn=lambda a: _cost_model(["threshold", "--model", a.model, "--hardware", a.hardware]))
    prof = sub.add_parser("profile-cpu", help="measure this machine (writes a hardware entry)")
    prof.add_argument("--out", required=True)
    prof.add_argument("--merge", action="store_true")
    prof.set_defaults(fn=lambda a: _profile(["--out", a.out] + (["--merge"] if a.merge else [])))
    sub.add_parser("eval", add_help=False, help="run a paper §7 experiment on the simulator")
    lat = sub.add_parser("profile-latency", add_help=False,
                         help="measure the compute engine, fit the scheduler's latency model")
    lat.set_defaults(fn=None)
    srv = sub.add_parser("serve", help="run the pool on a Ray cluster until Ctrl-C")
    srv.add_argument("--ray", required=True, metavar="ADDRESS",
                     help="Ray cluster to join: 'auto', the head's HOST:PORT, or 'local' "
                          "(ray.init() without an address: this machine's Ray, or a new one)")
    srv.add_argument("--instances", type=int, default=4)
    srv.add_argument("--pool-mb", type=int, default=256, help="slab MiB per instance")
    srv.add_argument("--model", default="smollm2-135m")
    srv.add_argument("--segment-tokens", type=int, default=64)
    srv.add_argument("--max-rows", type=int, default=1024, help="rows of each q/out/kv buffer")
    srv.add_argument("--bind", default=os.environ.get("TOKENLAKE_BIND", "127.0.0.1"),
                     help="engine address: IP, interface name or 'node' (env TOKENLAKE_BIND)")
    srv.add_argument("--ports", default=os.environ.get("TOKENLAKE_PORTS"), metavar="FIRST-LAST",
                     help="engine port range (env TOKENLAKE_PORTS; default any free port)")
    srv.add_argument("--strategy", default="PACK",
                     choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"])
    srv.add_argument("--cpus-per-instance", type=float, default=1.0)
    srv.add_argument("--gpus-per-instance", type=int, default=0)
    srv.add_argument("--engine-share", type=float, default=1.0,
                     help="share of each bundle for the pool's actors (rest: compute engine)")
    srv.add_argument("--no-restart", action="store_true", help="remove failed instances only")
    srv.add_argument("--json", action="store_true", help="one JSON object per event")
    srv.set_defaults(fn=_serve)
    from evals.sim.cli import add_arguments as add_sim_arguments  # argparse only, no numpy

    sim = sub.add_parser("sim", help="replay a trace on a simulated cluster (docs/simulator.md)")
    add_sim_arguments(sim)
    sim.set_defaults(fn=_sim)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # its own parser (evals/eval_cli.py)
        from evals.eval_cli import main as eval_main

        return eval_main(argv[1:])
    if argv[:1] == ["profile-latency"]:  # its own parser (python -m tokenlake.tools.latency_profile)
        from tokenlake.tools.latency_profile import main as latency_main

        return latency_main(argv[1:])
    args = parser.parse_args(argv)
    return args.fn(args)


def _sim(args: argparse.Namespace) -> int:
    from evals.sim.cli import run

    return run(args)


def _cost_model(argv: list[str]) -> int:
    from tokenlake.core.cost_model import main as cost_main

    return cost_main(argv)


def _profile(argv: list[str]) -> int:
    from tokenlake.tools.profiler import main as profiler_main

    return profiler_main(argv)


if __name__ == "__main__":
    sys.exit(main())
