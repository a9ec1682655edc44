"""``tokenlake bench gpu``: its arguments and printing (the work: ``tokenlake/tools/bench/gpu.py``)."""

from __future__ import annotations

import argparse
import json

from tokenlake.tools.cli.args import UsageError, positive


def add_gpu(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive(int), nargs="+", default=[16384, 65536], metavar="TOKENS",
                   help="prefix lengths of the slab attention rows")
    p.add_argument("--rows", type=positive(int), nargs="+", default=[1, 8], help="query rows")
    p.add_argument("--dtypes", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16", "float16"],
                   help="K/V dtypes")
    p.add_argument("--repeats", type=positive(int), default=20, help="timed calls per figure")
    p.add_argument("--prefixes", type=positive(int), nargs="+", default=[16384, 65536], metavar="TOKENS",
                   help="prefix lengths of the query-vs-fetch rows")
    p.add_argument("--no-query-vs-fetch", action="store_true", help="skip the pool rows")
    p.add_argument("--json", action="store_true",
                   help="accepted for uniformity: this benchmark always prints JSON")
    p.set_defaults(run=run_gpu)


def run_gpu(args: argparse.Namespace) -> int:
    import torch  # only when this benchmark runs

    if not torch.cuda.is_available():
        raise UsageError("bench gpu needs a CUDA GPU; this torch sees none")
    from tokenlake.tools.bench.gpu import bench_gpu

    result = bench_gpu(tuple(args.tokens), tuple(args.rows), tuple(args.dtypes), args.repeats,
                       not args.no_query_vs_fetch, tuple(args.prefixes))
    print(json.dumps(result, indent=2))
    return 0
