"""``tokenlake bench kernel``: KV bytes read per second by the csrc slab-attention kernel
(issue #21) against this machine's memory read bandwidth and torch's own CPU attention,
all measured in one run.

Per (dtype, query rows, tokens): a slab of full slots holding ``tokens`` tokens of a
Llama-3-8B-shaped layer (32 query heads, 8 KV heads, head_dim 128), one decode-like query
of ``rows`` rows, and three calls timed alternately (median of ``repeats``): the kernel
(:func:`tokenlake.kernels.native.slab_attention`), torch's CPU attention
(``scaled_dot_product_attention`` on the same K/V, gathered into one contiguous tensor
before timing) and the torch few-row slab path (the pool's path where the kernel is not built). Bandwidth is
``2 x tokens x kv_heads x head_dim x bytes`` over the time. The machine's memory read
bandwidth is the best of several multi-threaded reductions over a 1 GiB buffer; its
float32 compute rate the best BLAS matrix product. With those two each row has a
roofline: at 8 query rows (32 grouped rows per KV head) the attention does 16 FLOPs per
float32 byte of KV, more than this machine can do at its read bandwidth, so its roof is
compute (``roof_gbps``, ``bound``, ``kernel_vs_roof``).

A roofline assumes arithmetic hides behind the loads; on a core running one thread it does
not fully (the loads in flight are bounded by how far the instruction window reaches
past the arithmetic). So each row also times, alternately with the others, the csrc
stream loop (:func:`tokenlake.kernels.native.roof_stream`) over the same slab: every
64-byte line read once with the attention's multiply-adds per line (4 x rows in float32,
8 x rows in bfloat16, rounded up to a power of two; ``stream_fmas_per_line``) and nothing
else: ``stream_gbps`` is the read rate a kernel doing that arithmetic reaches here,
``kernel_vs_stream`` the kernel's share of it.

``path``: the kernel's path for the row (``native.attention_path``): "tile" (the AMX
matrix unit; bfloat16 with 16 or more grouped rows on CPUs that have it), "panel" (many
grouped rows otherwise: from 6 with AVX2; with AVX-512 from 32 in bfloat16, 64 in float32) or "vector". A row on the panel
path also times the same call on the vector path, alternately with the others
(``vector_gbps``, and ``kernel_vs_vector``: how much faster the panel path is); a row on
the vector path, the same call forced onto the panel path (``panel_gbps``, and
``panel_vs_kernel``: how much faster the panel path would be), which is how the
thresholds were chosen.

"dot": bfloat16 with bfloat16 products (``--bf16-products 1`` or ``2``) on CPUs with AVX-512 BF16 and no tiles in use (``bf16_dots``
in the JSON). A row on the dot path also times the same call with exact products
(``exact_path``, ``exact_gbps``, ``kernel_vs_exact``: how much faster the dot path is) and
reports the largest difference of the two outputs over the largest output
(``products_error``) and of their log-sum-exps (``products_lse_error``); its compute roof
counts vdpbf16ps at twice an FMA's multiply-adds. Without bfloat16 products, a bfloat16 row
the dot path would take times it too (``dot_gbps``, ``dot_vs_kernel``).

``linear``: the projections of one decode step of SmolLM2-135M (30 layers of q, k, v, o,
gate, up and down; random float32 weights, 425 MB) on ``linear_rows`` rows, by the csrc kernel
(:func:`tokenlake.kernels.native.linear`) and by ``torch.nn.functional.linear`` (BLAS),
timed alternately: weight bytes read per second and the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 32, 8, 128, 512
#: SmolLM2-135M's projections per layer, (out, in): q, k, v, o, gate, up, down.
LINEAR_SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
LINEAR_LAYERS = 30
DTYPES = ("float32", "bfloat16")  # torch is imported only when the benchmark runs


def memory_read_gbps(gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """GB/s of the best of several multi-threaded read-only passes over ``gib`` GiB."""
    import torch

    from tokenlake.kernels.slab import interleaved_times

    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    half = buf.numel() // 2
    methods = {"sum": lambda: buf.sum(), "amax": lambda: buf.amax(),
               "dot": lambda: torch.dot(buf[:half], buf[half:2 * half])}  # each byte once
    times = interleaved_times(methods, repeats)
    return {name: buf.numel() * 4 / min(ts) / 1e9 for name, ts in times.items()}


def compute_gflops(n: int = 1536, repeats: int = 5) -> float:
    """GFLOP/s of the best of ``repeats`` float32 ``n x n`` matrix products on every
    thread (BLAS): the machine's attainable float32 multiply-add rate."""
    import torch

    from tokenlake.kernels.slab import interleaved_times

    a, b = torch.randn(n, n), torch.randn(n, n)
    times = interleaved_times({"mm": lambda: torch.mm(a, b)}, repeats)
    return 2 * n ** 3 / min(times["mm"]) / 1e9


def _add_roof(row: dict, element_size: int, bandwidth_gbps: float, peak_gflops: float) -> None:
    """The roofline of one result row: the attention does 4 x head_dim FLOPs per query
    head, row and token (q.k and p.v) over 2 x head_dim x kv_heads elements of K/V per
    token, so ``flops_per_byte`` = 2 x (q_heads / kv_heads) x rows / element size; the
    best KV read rate it can reach is the lesser of the bandwidth and peak / that. The peak
    is the vector units' (a float32 BLAS product); a row on the tile path (``path`` "tile")
    multiplies on the AMX unit, not bound by it, so its roof is the bandwidth."""
    flops_per_byte = 2 * (Q_HEADS // KV_HEADS) * row["rows"] / element_size
    # the dot path's vdpbf16ps does twice an FMA's multiply-adds per instruction
    peak = 2 * peak_gflops if row.get("path") == "dot" else peak_gflops
    roof = bandwidth_gbps if row.get("path") == "tile" else min(bandwidth_gbps, peak / flops_per_byte)
    row.update(flops_per_byte=flops_per_byte, kernel_gflops=row["kernel_gbps"] * flops_per_byte,
               roof_gbps=roof, bound="memory" if roof == bandwidth_gbps else "compute",
               kernel_vs_roof=row["kernel_gbps"] / roof)


def bench_kernel(tokens=(16384, 32768, 65536), rows=(1, 8), dtypes=("float32", "bfloat16"),
                 repeats: int = 7, buffer_gib: float = 1.0, linear_rows=(1, 8, 32),
                 linear_layers: int = LINEAR_LAYERS, isa: str | None = None,
                 bf16_products: int | None = None) -> dict:
    """The JSON of ``tokenlake bench kernel`` (module docstring). ``bf16_products``: the
    dot path's setting for the run (``native.use_bf16_products``; None: the process's)."""

    from tokenlake.kernels import native

    mod = native.load()
    if mod is None:
        raise RuntimeError("the native kernel is not built (g++ and ninja are needed)")
    best, products = mod.isa(), mod.bf16_products()
    try:
        if isa is not None:
            mod.set_isa(isa)  # a lower instruction set than the CPU's: what CPUs without it run
        if bf16_products is not None:
            native.use_bf16_products(bf16_products, module=mod)
        out = _bench_kernel(mod, tokens, rows, dtypes, repeats, buffer_gib, linear_rows, linear_layers)
        return {**out, "bf16_dots": mod.has_bf16_dots(), "bf16_products": mod.bf16_products()}
    finally:
        mod.set_isa(best)
        mod.set_bf16_products(products)


def _bench_kernel(mod, tokens, rows, dtypes, repeats, buffer_gib, linear_rows, linear_layers) -> dict:
    import torch

    from tokenlake.kernels import native
    from tokenlake.kernels.slab import slab_partial_attention

    bw = memory_read_gbps(buffer_gib)
    peak = compute_gflops()
    results = []
    for dname in dtypes:
        for n in tokens:
            slots = -(-n // CAPACITY)
            slab = torch.randn(slots, 1, 2, KV_HEADS, CAPACITY, HEAD_DIM).to(getattr(torch, dname))
            for r in rows:
                row = _measure(native, slab_partial_attention, slab, r, repeats)
                row["kernel_vs_bandwidth"] = row["kernel_gbps"] / max(bw.values())
                _add_roof(row, slab.element_size(), max(bw.values()), peak)
                results.append({"dtype": dname, **row})
    return {"memory_read_gbps": max(bw.values()), "memory_read_methods_gbps": bw,
            "compute_gflops": peak, "linear": [_measure_linear(native, r, repeats, linear_layers) for r in linear_rows],
            "isa": mod.isa(), "threads": torch.get_num_threads(),
            "shape": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                      "slot_tokens": CAPACITY},
            "results": results}


def _measure(native, slab_partial_attention, slab, rows: int, repeats: int) -> dict:
    """One row of the results: the three calls on ``slab`` with ``rows`` query rows."""
    import torch

    from tokenlake.kernels.slab import interleaved_times

    slots = slab.shape[0]
    ids, counts = list(range(slots)), [CAPACITY] * slots
    k = slab[:, 0, 0].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM).unsqueeze(0).contiguous()
    v = slab[:, 0, 1].transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM).unsqueeze(0).contiguous()
    kv_bytes = 2 * slots * CAPACITY * KV_HEADS * HEAD_DIM * slab.element_size()
    q = torch.randn(rows, Q_HEADS, HEAD_DIM)
    qs = q.transpose(0, 1).unsqueeze(0).to(slab.dtype)  # [1, Hq, rows, E]
    scale = HEAD_DIM ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fmas = _stream_fmas(rows, slab.element_size())
    path = native.attention_path(slab.dtype, rows * (Q_HEADS // KV_HEADS), HEAD_DIM)
    calls = {
        "kernel": lambda: native.slab_attention(q, slab, 0, ids, counts, scale),
        "stream": lambda: native.roof_stream(slab, fmas),
        "torch": lambda: sdpa(qs, k, v, scale=scale, enable_gqa=True),
        "torch_slab": lambda: _torch_slab(slab_partial_attention, q, slab, ids, counts, scale),
    }
    mod = native.load()
    if path == "panel":
        calls["vector"] = lambda: _forced(native, mod, 1 << 30, q, slab, ids, counts, scale)
    elif path == "vector":
        calls["panel"] = lambda: _forced(native, mod, 1, q, slab, ids, counts, scale)
    other = _products_other(native, mod, slab, rows, path)
    if other is not None:
        calls[other] = lambda: _with_products(native, mod, int(other == "dot"), q, slab, ids, counts, scale)
    times = interleaved_times(calls, repeats)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    extra = {}
    if path == "panel":
        extra = {"vector_gbps": kv_bytes / med["vector"] / 1e9, "kernel_vs_vector": med["vector"] / med["kernel"]}
    elif path == "vector":
        extra = {"panel_gbps": kv_bytes / med["panel"] / 1e9, "panel_vs_kernel": med["kernel"] / med["panel"]}
    if other == "dot":
        extra.update(dot_gbps=kv_bytes / med["dot"] / 1e9, dot_vs_kernel=med["kernel"] / med["dot"])
    elif other == "exact":
        extra.update(_exact_fields(native, mod, q, slab, ids, counts, scale, kv_bytes / med["exact"] / 1e9,
                                   med["exact"] / med["kernel"]))
    return {"rows": rows, "tokens": slots * CAPACITY, "path": path, **extra,
            "kernel_gbps": kv_bytes / med["kernel"] / 1e9,
            "torch_gbps": kv_bytes / med["torch"] / 1e9,
            "torch_slab_gbps": kv_bytes / med["torch_slab"] / 1e9,
            "stream_fmas_per_line": fmas, "stream_gbps": kv_bytes / med["stream"] / 1e9,
            "kernel_vs_stream": med["stream"] / med["kernel"],
            "kernel_ms": med["kernel"] * 1e3,
            "kernel_ms_range": [min(times["kernel"]) * 1e3, max(times["kernel"]) * 1e3],
            "kernel_vs_torch": med["torch"] / med["kernel"]}


def _products_other(native, mod, slab, rows: int, path: str) -> str | None:
    """What a bfloat16 row times beside the kernel on a CPU with the dot path: on the dot
    path, the same call with exact products ("exact"); on another path, where the dot
    path would take the call with bfloat16 products allowed, that path ("dot"); else
    None."""
    import torch

    if slab.dtype != torch.bfloat16 or not mod.has_bf16_dots():
        return None
    if path == "dot":
        return "exact"
    with _products(mod, 1):
        would = native.attention_path(slab.dtype, rows * (Q_HEADS // KV_HEADS), HEAD_DIM)
    return "dot" if would == "dot" else None


@contextlib.contextmanager
def _products(mod, parts: int):
    """The built module ``mod`` with bfloat16 products at ``parts`` (0: exact) for the
    block, then as before (quietly: a forced lower isa may leave them nothing to do)."""
    before = mod.bf16_products()
    mod.set_bf16_products(parts)
    try:
        yield
    finally:
        mod.set_bf16_products(before)


def _with_products(native, mod, parts: int, q, slab, ids, counts, scale):
    """The kernel's call with bfloat16 products at ``parts`` (0: exact), then as before."""
    with _products(mod, parts):
        return native.slab_attention(q, slab, 0, ids, counts, scale)


def _exact_fields(native, mod, q, slab, ids, counts, scale, exact_gbps: float, speedup: float) -> dict:
    """A dot-path row's comparison with exact products: their path, GB/s, how much faster
    the dot path is, and the largest difference of the outputs over the largest output
    (``products_error``) and of the log-sum-exps (``products_lse_error``)."""
    dot = native.slab_attention(q, slab, 0, ids, counts, scale)
    with _products(mod, 0):
        exact = native.slab_attention(q, slab, 0, ids, counts, scale)
        exact_path = native.attention_path(slab.dtype, q.shape[0] * (Q_HEADS // KV_HEADS), HEAD_DIM)
    return {"exact_path": exact_path, "exact_gbps": exact_gbps, "kernel_vs_exact": speedup,
            "products_parts": mod.bf16_products(),
            "products_error": float((dot.o - exact.o).abs().max() / exact.o.abs().max()),
            "products_lse_error": float((dot.lse - exact.lse).abs().max())}


def _stream_fmas(rows: int, element_size: int) -> int:
    """The attention's 16-lane multiply-adds per 64-byte line of K/V (2 x ``flops_per_byte``
    of :func:`_add_roof`), rounded up to the power of two the stream loop takes."""
    fmas = 2 * 2 * (Q_HEADS // KV_HEADS) * rows // element_size
    return min(64, 1 << max(0, (fmas - 1).bit_length()))


def _measure_linear(native, rows: int, repeats: int, layers: int = LINEAR_LAYERS) -> dict:
    """One decode step's projections (module docstring) on ``rows`` rows: kernel vs BLAS."""
    import torch

    from tokenlake.kernels.slab import interleaved_times

    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.02 for _ in range(layers) for n, k in LINEAR_SHAPES]
    xs = {k: torch.randn(rows, k, generator=g) for k in {k for _, k in LINEAR_SHAPES}}
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    def step(fn):
        for w in weights:
            fn(xs[w.shape[1]], w)

    times = interleaved_times({"kernel": lambda: step(native.linear),
                               "blas": lambda: step(torch.nn.functional.linear)}, repeats)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"rows": rows, "weight_mb": nbytes / 1e6,
            "kernel_gbps": nbytes / med["kernel"] / 1e9, "blas_gbps": nbytes / med["blas"] / 1e9,
            "kernel_ms": med["kernel"] * 1e3, "blas_ms": med["blas"] * 1e3,
            "kernel_ms_range": [min(times["kernel"]) * 1e3, max(times["kernel"]) * 1e3],
            "blas_ms_range": [min(times["blas"]) * 1e3, max(times["blas"]) * 1e3],
            "kernel_vs_blas": med["blas"] / med["kernel"]}


def _forced(native, mod, panel_rows, q, slab, ids, counts, scale):
    """The kernel's call with the panel path's threshold (in the built module ``mod``)
    at ``panel_rows`` (1: every row count on the panel path; out of reach: on the vector
    path) and exact products (the forced threshold moves the dot path's too), then back
    to the instruction set's own."""
    mod.set_panel_rows(panel_rows)
    try:
        return _with_products(native, mod, 0, q, slab, ids, counts, scale)
    finally:
        mod.set_panel_rows(0)


def _torch_slab(slab_partial_attention, q, slab, ids, counts, scale):
    """The pool's slab path with the csrc kernel switched off: torch's few-row path."""
    from tokenlake.kernels.slab import _native, use_native

    before = _native["on"]
    use_native(False)
    try:
        return slab_partial_attention(q, slab, 0, ids, counts, scale)
    finally:
        use_native(before)


def add_kernel(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536],
                   help="prefix tokens per measurement (rounded up to whole 512-token slots)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="query rows")
    p.add_argument("--linear-rows", type=int, nargs="+", default=[1, 8, 32],
                   help="rows of the projections measured against BLAS")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES,
                   help="K/V dtypes of the slab")
    p.add_argument("--repeats", type=int, default=7, help="timed calls of each, interleaved")
    p.add_argument("--isa", choices=("amx", "avx512", "avx2", "base"), default=None,
                   help="run the kernels as on a CPU with at most this instruction set (avx512: "
                        "an AVX-512 CPU without AMX tiles); default: what this CPU offers")
    p.add_argument("--bf16-products", type=int, choices=(0, 1, 2), default=None,
                   help="bfloat16 calls of many grouped rows on the dot path (CPUs with AVX-512 BF16 "
                        "and no AMX): q in 1 or 2 bfloat16 parts, the probabilities rounded; 0: exact "
                        "products (the default)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.set_defaults(run=run_kernel)


def run_kernel(args: argparse.Namespace) -> int:
    from tokenlake.tools.cli.args import UsageError

    if min(args.tokens) < 1 or min(args.rows) < 1 or min(args.linear_rows) < 1 or args.repeats < 1:
        raise UsageError("bench kernel: --tokens, --rows, --linear-rows and --repeats must be positive")
    try:
        result = bench_kernel(tuple(args.tokens), tuple(args.rows), tuple(args.dtypes), args.repeats,
                              linear_rows=tuple(args.linear_rows), isa=args.isa,
                              bf16_products=args.bf16_products)
    except RuntimeError as exc:
        raise UsageError(f"bench kernel: {exc}") from None
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"memory read bandwidth {result['memory_read_gbps']:.1f} GB/s, float32 BLAS "
          f"{result['compute_gflops']:.0f} GFLOP/s ({result['threads']} threads, kernel isa {result['isa']})")
    for row in result["results"]:
        other = {"panel": "vector", "vector": "panel"}.get(row["path"])
        if other is not None:  # the path taken against the other, timed alternately
            faster = row.get("kernel_vs_vector") or row["panel_vs_kernel"]  # the panel path's gain
            print(f"{row['dtype']:8s} rows {row['rows']} tokens {row['tokens']:6d}: {row['path']} path "
                  f"{row['kernel_gbps']:5.1f} GB/s, {other} path {row[f'{other}_gbps']:5.1f} GB/s: "
                  f"panel {faster:.2f}x")
        if "dot_gbps" in row or "exact_gbps" in row:  # bfloat16 products against exact ones
            dot, exact = (row["dot_gbps"], row["kernel_gbps"]) if "dot_gbps" in row else \
                (row["kernel_gbps"], row["exact_gbps"])
            print(f"{row['dtype']:8s} rows {row['rows']} tokens {row['tokens']:6d}: dot path (bfloat16 "
                  f"products) {dot:5.1f} GB/s, exact products {exact:5.1f} GB/s: {dot / exact:.2f}x")
        print(f"{row['dtype']:8s} rows {row['rows']} tokens {row['tokens']:6d}: kernel ({row['path']}) "
              f"{row['kernel_gbps']:5.1f} GB/s ({row['kernel_vs_bandwidth']:.0%} of bandwidth, "
              f"{row['kernel_vs_roof']:.0%} of the {row['bound']} roof {row['roof_gbps']:.1f}, "
              f"{row['kernel_vs_stream']:.0%} of the stream loop's {row['stream_gbps']:.1f}), "
              f"torch {row['torch_gbps']:5.1f} GB/s, torch slab path {row['torch_slab_gbps']:5.1f} "
              f"GB/s: kernel / torch {row['kernel_vs_torch']:.2f}x")
    for row in result["linear"]:
        print(f"decode-step projections, rows {row['rows']}: kernel {row['kernel_gbps']:5.1f} GB/s "
              f"({row['kernel_ms']:.1f} ms), BLAS {row['blas_gbps']:5.1f} GB/s ({row['blas_ms']:.1f} ms): "
              f"kernel / BLAS {row['kernel_vs_blas']:.2f}x")
    return 0
