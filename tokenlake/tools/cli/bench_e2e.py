"""``tokenlake bench e2e``'s options (the benchmark itself, which loads torch and the model,
is :mod:`tokenlake.tools.bench.e2e`, imported when it runs)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from tokenlake.core.control import KV_DTYPES
from tokenlake.tools.cli.args import UsageError, check_device, device_name, positive


def add_e2e(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=positive(int), default=4, help="pool instances")
    p.add_argument("--decode-batches", type=positive(int), nargs="+", default=[1, 8],
                   metavar="B", help="decode batch sizes to measure; the first is the headline")
    p.add_argument("--dops", type=positive(int), nargs="*", default=[1, 2, 4], metavar="K",
                   help="prefill DoPs whose cold TTFT to compare, one compute engine per instance "
                        "(none: skip); the first is the baseline of the ratios")
    p.add_argument("--dop-tokens", type=positive(int), default=2048, help="prompt tokens of the DoP runs")
    p.add_argument("--rounds", type=positive(int), default=3, help="runs per DoP, interleaved")
    p.add_argument("--decode-rounds", type=positive(int), default=2,
                   help="decode measurements of each batch size, pool and plain engine alternately")
    p.add_argument("--segment-tokens", type=positive(int), default=None,
                   help="tokens per segment (default: the cost model's for the device)")
    p.add_argument("--kv-dtype", default="float32", choices=tuple(KV_DTYPES),
                   help="the pool's K/V dtype (the plain engine's cache: the same)")
    p.add_argument("--bf16-products", type=int, choices=(0, 1, 2), default=0,
                   help="a bfloat16 pool on a CPU with AVX-512 BF16 and no AMX: many grouped rows "
                        "attend with q in 1 or 2 bfloat16 parts and the probabilities rounded, in the "
                        "query engines and this process (0: exact products)")
    p.add_argument("--share-slabs", action=argparse.BooleanOptionalAction, default=True,
                   help="query engines attend the other instances' slabs through shared memory "
                        "(off: by message, as between hosts)")
    p.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                   help="measure vLLM's CPU build on the same prompts and cores afterwards "
                        "(default: when vllm is installed)")
    p.add_argument("--tier", action=argparse.BooleanOptionalAction, default=None,
                   help="also time a question about a document held only in the disk tier "
                        "against recomputing it (the tier row; default: on the CPU)")
    p.add_argument("--tier-only", action="store_true", help="the tier row alone")
    p.add_argument("--tier-rounds", type=positive(int), default=2, help="rounds of the tier row")
    p.add_argument("--tier-medium", choices=("disk", "memory"), default="disk",
                   help="where the tier row's tier is (memory: the transfer engine's host memory)")
    p.add_argument("--tier-serial", action="store_true",
                   help="the tier row also times the question with its whole read before its "
                        "iteration (no overlap), alternating with the overlapped one")
    p.add_argument("--device", default="cpu", type=device_name,
                   help="'cuda' or 'cuda:N': the model, the plain engine and the pool on that GPU "
                        "(needs --kv-dtype bfloat16 or float16; no vLLM or tier rows)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    p.set_defaults(run=run_e2e)


def _e2e_with_products(bf16_products: int = 0, **kw):
    """``bench_e2e`` with ``bf16_products`` in this process too, which attends in place
    (the engines take it from the cluster's config), then as before; the kernels built
    first where they are not current (the engines never build them)."""
    import contextlib

    from tokenlake.kernels import native
    from tokenlake.tools.bench.e2e import bench_e2e

    mod = native.load_prebuilt()
    if mod is None and kw.get("device", "cpu") == "cpu":  # its engines would run torch's path silently
        print("building the csrc kernels for these sources (a minute or more) ...", file=sys.stderr, flush=True)
        mod = native.load()
        if mod is None:
            print("the csrc kernels do not build here: every engine runs torch's path", file=sys.stderr)
    setting = native.bf16_products(bf16_products, module=mod) if bf16_products and mod else contextlib.nullcontext()
    with setting:
        return bench_e2e(bf16_products=bf16_products, **kw)


def run_e2e(args: argparse.Namespace) -> int:
    # torch and the model: only when this benchmark runs
    from tokenlake.tools.bench.e2e import summary
    from tokenlake.tools.bench.e2e_tier import summary as tier_summary
    from tokenlake.tools.bench.e2e_tier import tier_row

    if any(d > args.instances for d in args.dops):
        raise SystemExit(f"tokenlake bench e2e: error: --dops must not exceed --instances ({args.instances})")
    vllm = importlib.util.find_spec("vllm") is not None if args.vllm is None else args.vllm
    if args.device != "cpu":
        if args.tier_only or args.tier or args.vllm:
            raise UsageError(f"bench e2e: --device {args.device} has no tier or vLLM rows (CPU only)")
        check_device(args.device, "bench e2e", args.kv_dtype)
        vllm = False
    tier = args.tier_only or (args.device == "cpu" if args.tier is None else args.tier)
    result = {}
    if not args.tier_only:
        result = _e2e_with_products(instances=args.instances, decode_batches=tuple(args.decode_batches),
                           dops=tuple(args.dops), dop_tokens=args.dop_tokens, rounds=args.rounds,
                           kv_dtype=args.kv_dtype, vllm=vllm, decode_rounds=args.decode_rounds,
                           share_slabs=args.share_slabs, device=args.device,
                           segment_tokens=args.segment_tokens, bf16_products=args.bf16_products)
    if tier:
        result["tier"] = tier_row(rounds=args.tier_rounds, kv_dtype=args.kv_dtype, medium=args.tier_medium,
                                  serial=args.tier_serial)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if "cached_ttft_ms" in result:
        print(summary(result))
    if result.get("tier"):
        print(tier_summary(result["tier"]))
    return 0
