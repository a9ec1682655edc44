"""``tokenlake bench gpu``: the CUDA data path (issue #21) on a GPU, measured in one run.

Three figures, each against a baseline measured in the same process:

* **device read bandwidth**: the best of read-only reductions (``sum``, ``amax``) over a
  few GiB of device memory, the denominator of the next figure;
* **slab attention** (what a GPU query engine runs per layer): one batched FlashInfer
  launch (decode kernel for 1 row, prefill for 8) over a slab's slots (:func:`~tokenlake.kernels.paged.flashinfer_slab_attention`)
  for 1 and 8 query rows of a Llama-3-8B-shaped layer (32 / 8 heads x 128) over 16K-64K
  tokens in 512-token slots, in bfloat16 and float16, as GB/s of K/V read: the whole call
  as a query engine makes it for every layer but a query's first (launch and the merge
  back per row; ``call_planned_ms``: the first layer, which also plans), and the kernel
  alone (``run`` after one ``plan``),
  against torch's own ``scaled_dot_product_attention`` over the same K/V laid out
  contiguously (no slots, no LSE);
* **query vs fetch** on a GPU pool: :mod:`tokenlake.tools.bench.dataplane`'s comparison
  with every buffer on the GPU (``LocalCluster(device="cuda")``, peers by message, the
  fetched K/V staged through host memory as the wire does for CUDA tensors).

The first FlashInfer call of a shape compiles its kernels (FlashInfer's JIT, cached under
``~/.cache/flashinfer``); its time is reported as ``first_call_s`` and kept out of the
medians. Before anything is timed the GPU runs matrix products for 2 s (:func:`warm_up`), so
that its clocks have ramped up. Asserts only that the slab attention agrees with the torch
reference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

SHAPE = {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "slot_tokens": 512}


def _require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("tokenlake bench gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())


def cuda_times_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Milliseconds of ``repeats`` calls of each ``fn``, interleaved, after a warm-up call
    each; each call timed from the host's start to the device's end (CUDA events around
    it, host work included)."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            out[name].append(start.elapsed_time(stop))
    return out


def warm_up(device: torch.device, seconds: float = 2.0) -> int:
    """Keeps the GPU busy with matrix products for ``seconds`` so that its clocks have
    ramped up before anything is timed (the first dtype measured used to run 1.5-2x slower
    than the same kernels later in the run); returns the products run."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)
        done += 10
    return done


def device_read_gbps(device: torch.device, gib: float = 4.0, repeats: int = 10) -> dict[str, float]:
    """GB/s of the best of read-only reductions over ``gib`` GiB of device memory."""
    buf = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=device)
    times = cuda_times_ms({"sum": lambda: buf.sum(), "amax": lambda: buf.amax()}, repeats)
    nbytes = buf.numel() * 4
    return {name: nbytes / (min(ts) / 1e3) / 1e9 for name, ts in times.items()}


def _slab_rows(device: torch.device, tokens: int, rows: int, dtype: torch.dtype, repeats: int) -> dict:
    from tokenlake.kernels.paged import (
        _planned,
        _wrappers,
        flashinfer_slab_attention,
        paged_batch,
    )

    qh, kvh, e, c = SHAPE["q_heads"], SHAPE["kv_heads"], SHAPE["head_dim"], SHAPE["slot_tokens"]
    n = tokens // c
    g = torch.Generator(device=device).manual_seed(tokens + rows)
    slab = torch.randn(n, 1, 2, kvh, c, e, device=device, dtype=torch.float32, generator=g).to(dtype)
    q = torch.randn(rows, qh, e, device=device, generator=g)
    groups = [(0, rows, list(range(n)), [c] * n)]
    scale = e ** -0.5

    t0 = time.perf_counter()
    got = flashinfer_slab_attention(q, slab, 0, groups, scale)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0

    # the same K/V contiguous for torch: [1, kv_heads, tokens, E]
    k = slab[:, 0, 0].permute(1, 0, 2, 3).reshape(1, kvh, n * c, e).contiguous()
    v = slab[:, 0, 1].permute(1, 0, 2, 3).reshape(1, kvh, n * c, e).contiguous()
    qt = q.to(dtype).transpose(0, 1).unsqueeze(0)  # [1, q_heads, rows, E]
    want = torch.nn.functional.scaled_dot_product_attention(qt, k, v, scale=scale, enable_gqa=True)
    err = (got.o - want[0].transpose(0, 1).float()).abs().max().item()
    assert err < 3e-2, f"FlashInfer slab attention disagrees with torch: max |o| error {err}"

    batch = paged_batch(groups, c)
    ws = _wrappers(device)
    q_packed = q.to(dtype)
    with ws.lock:
        wrapper = _planned(ws, batch, qh, slab, scale)  # decode for 1 row, prefill for 8
        times = cuda_times_ms({
            "kernel": lambda: wrapper.run(q_packed, (slab[:, 0, 0], slab[:, 0, 1]), return_lse=True),
            "torch": lambda: torch.nn.functional.scaled_dot_product_attention(qt, k, v, scale=scale,
                                                                              enable_gqa=True),
        }, repeats)

    def first_layer():  # a query's first layer plans; the others reuse the plan
        ws.keys.clear()
        flashinfer_slab_attention(q, slab, 0, groups, scale)

    # the whole call takes the wrapper's lock itself: timed outside it
    times.update(cuda_times_ms({"call": lambda: flashinfer_slab_attention(q, slab, 0, groups, scale),
                                "call_planned": first_layer}, repeats))
    kv_bytes = slab.numel() * slab.element_size()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    gbps = {name: kv_bytes / (ms / 1e3) / 1e9 for name, ms in med.items()}
    return {
        "dtype": str(dtype).removeprefix("torch."), "rows": rows, "tokens": n * c, "kv_bytes": kv_bytes,
        "kernel": "decode" if batch.is_decode() else "prefill",
        "first_call_s": first_call_s, "max_abs_error_vs_torch": err,
        "kernel_ms": med["kernel"], "call_ms": med["call"], "call_planned_ms": med["call_planned"],
        "torch_ms": med["torch"],
        "kernel_ms_range": [min(times["kernel"]), max(times["kernel"])],
        "call_ms_range": [min(times["call"]), max(times["call"])],
        "torch_ms_range": [min(times["torch"]), max(times["torch"])],
        "kernel_gbps": gbps["kernel"], "call_gbps": gbps["call"], "torch_gbps": gbps["torch"],
        "kernel_vs_torch": med["torch"] / med["kernel"], "call_vs_torch": med["torch"] / med["call"],
    }


def bench_gpu(tokens=(16384, 65536), rows=(1, 8), dtypes=("bfloat16", "float16"), repeats: int = 20,
              query_vs_fetch: bool = True, prefixes=(16384, 65536)) -> dict:
    """The figures of the module docstring as one dict (JSON-ready). Raises
    ``RuntimeError`` without CUDA (or FlashInfer, at the first slab call)."""
    device = _require_cuda()
    warm_up(device)
    bandwidth = device_read_gbps(device)
    best = max(bandwidth.values())
    results = []
    for dtype in dtypes:
        for s in tokens:
            for r in rows:
                row = _slab_rows(device, s, r, getattr(torch, dtype), repeats)
                row["kernel_vs_bandwidth"] = row["kernel_gbps"] / best
                row["call_vs_bandwidth"] = row["call_gbps"] / best
                results.append(row)
    out = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "memory_read_gbps": best, "memory_read_methods_gbps": bandwidth, "shape": SHAPE,
        "results": results,
    }
    try:
        import flashinfer

        out["flashinfer"] = flashinfer.__version__
    except ImportError:  # pragma: no cover - the slab rows above needed it
        pass
    if query_vs_fetch:
        from tokenlake.tools.bench.dataplane import bench_query_vs_fetch

        qvf = bench_query_vs_fetch(tuple(prefixes), dtypes=("bfloat16",), device="cuda")
        out["query_vs_fetch"] = qvf["results"]
    return out
