"""Partial attention over the slots of a segment slab: what a query engine computes for
the segments its instance holds (docs/design.md §4, slab layout in "Shared buffers").

A slab is ``[num_slots, layers, 2, kv_heads, C, head_dim]`` (index 0 = K, 1 = V, ``C``
tokens per slot); a slot holds ``tokens <= C`` valid tokens at its front.
:func:`slab_partial_attention` returns the
:class:`~tokenlake.kernels.attention.Partial` over the valid tokens of some slots, on
CPU (the csrc kernel, :mod:`tokenlake.kernels.native`, for few query rows where it is
built; torch's kernel, :mod:`tokenlake.kernels.cpu`, otherwise) or CUDA
(one batched FlashInfer launch, :mod:`tokenlake.kernels.paged`). :func:`bench_slab_attention` measures
the per-slot strategy used here against gathering the slots first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from tokenlake.kernels import native
from tokenlake.kernels.attention import (
    Partial,
    Tensor,
    empty_partial,
    merge_many,
    merge_seq,
    softmax_scale,
    write_into,
)
from tokenlake.kernels.cpu import attend_grouped, from_grouped, to_grouped
from tokenlake.kernels.paged_torch import gpu_slab_attention

#: Grouped query rows (rows x query heads per kv head) up to which the slab attention
#: uses plain matmuls with one softmax over all slots instead of one flash-kernel call
#: per slot: the kernel's fixed cost (~0.2 ms per call on this CPU) dominates decode.
#: Measured for SmolLM2 shapes (9/3 heads x 64, C=256, 1 thread, 1 row): 4 slots
#: 0.87 -> 0.09 ms, 16 slots 3.1 -> 0.25 ms.
SMALL_ROWS = 64
#: Grouped rows up to which a call that the kernel would run on its tile path (bfloat16
#: on CPUs with AMX; ``native.attention_path``) goes to the kernel, past SMALL_ROWS: a
#: prefill chunk's query over cached segments. Against the torch path, alternately in one
#: process (2 threads, 4K cached tokens): SmolLM2's 9/3 heads x 64, 64-512 rows (192-1536
#: grouped) 1.69x-1.40x; 32/8 x 128, 64-512 rows (256-2048 grouped) 1.74x-1.05x, falling
#: with the rows (the per-task scratch outgrows L2), hence the bound.
TILE_ROWS = 2048
#: Grouped rows x head dim up to which a call on the kernel's panel path (many rows
#: without tiles; ``native.attention_path``) goes to the kernel, past SMALL_ROWS. Against
#: the torch path, alternately in one process (2 threads, AVX2, 4K cached tokens):
#: SmolLM2's 9/3 heads x 64, 192-768 grouped rows 1.9x-1.25x, 1536 0.91-1.07x; 32/8 x 128,
#: 256 grouped rows 1.2-1.3x, 1024 0.64-0.88x (q and the output, kept transposed per
#: task, outgrow L2).
PANEL_ELEMENTS = 768 * 64
#: Whether few-row CPU calls go to the csrc kernel when it is built (:func:`use_native`).
_native = {"on": True}


def _kernel_for(slab: Tensor, grouped_rows: int, contiguous: bool):
    """The csrc module if it takes this CPU call: few grouped rows in any pool dtype, up
    to TILE_ROWS where it runs them on the tile path, or up to PANEL_ELEMENTS (grouped
    rows x head dim) on its panel or dot path (the dot path's scratch grows as the
    panel path's; its bound is the panel path's, not measured apart); else None (the
    torch path)."""
    kernel = _native_kernel()
    if kernel is None or not contiguous or slab.dtype not in native.DTYPES:
        return None
    if grouped_rows <= SMALL_ROWS:
        return kernel
    if grouped_rows > TILE_ROWS:
        return None
    path = native.attention_path(slab.dtype, grouped_rows, slab.shape[5], module=kernel)
    if path == "tile" or (path in ("panel", "dot") and grouped_rows * slab.shape[5] <= PANEL_ELEMENTS):
        return kernel
    return None


def use_native(on: bool) -> None:
    """Turns the csrc kernel on the CPU path (few rows, and bfloat16 calls of up to
    TILE_ROWS on CPUs where it has its tile path) on (the default, where it is built) or
    off (the torch path; benchmarks compare the two)."""
    _native["on"] = bool(on)


def _native_kernel():
    """The built csrc module, or None (off, or no current build: it is never compiled
    here, on a query's path; ``make`` builds it)."""
    return native.load_prebuilt() if _native["on"] else None


def _slot_kv(slab: Tensor, layer: int, slot: int, n: int) -> tuple[Tensor, Tensor]:
    """Views ``[kv_heads, n, E]`` of slot ``slot``'s first ``n`` K and V tokens of ``layer``."""
    return slab[slot, layer, 0, :, :n], slab[slot, layer, 1, :, :n]


def _check_slab(q: Tensor, slab: Tensor, layer: int, slots: Sequence[int], tokens: Sequence[int]) -> None:
    """Validates the slab call (layout docs/design.md §4, ``0 <= tokens[i] <= C``)."""
    if slab.dim() != 6 or slab.shape[2] != 2:
        raise ValueError(f"slab must be [slots, layers, 2, kv_heads, C, E], got {tuple(slab.shape)}")
    if len(slots) != len(tokens):
        raise ValueError(f"{len(slots)} slots but {len(tokens)} token counts")
    if not 0 <= layer < slab.shape[1]:
        raise ValueError(f"layer {layer} out of range [0, {slab.shape[1]})")
    capacity = slab.shape[4]
    if any(not 0 <= n <= capacity for n in tokens):
        raise ValueError(f"token counts must lie in [0, {capacity}], got {list(tokens)}")
    kv_heads, head_dim = slab.shape[3], slab.shape[5]
    if q.dim() != 3 or q.shape[2] != head_dim or kv_heads == 0 or q.shape[1] % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit slab {tuple(slab.shape)}")


def slab_partial_attention(q: Tensor, slab: Tensor, layer: int, slots: Sequence[int],
                           tokens: Sequence[int], scale: float | None = None) -> Partial:
    """Prefix partial attention of q over the valid tokens of some slots of one slab.

    q: ``[rows, q_heads, head_dim]``; slab: ``[num_slots, layers, 2, kv_heads, C,
    head_dim]`` (index 0 = K, 1 = V); ``slots[i]`` holds ``tokens[i] <= C`` valid tokens
    at its front. Equals :func:`~tokenlake.kernels.cpu.partial_attention`
    over the concatenation of those tokens (order is irrelevant, it is not causal).
    Returns float32 ``o`` ``[rows, q_heads, head_dim]`` and natural-log ``lse`` ``[rows,
    q_heads]``; no slots -> empty partial. Raises ``ValueError`` for a call that does not
    fit the slab.

    Computed per slot on in-place K/V views (one kernel call each, q in the grouped
    layout), then merged exactly in one pass. Gathering the slots' K/V into one tensor
    is a copy (the slab is slot-major with layers in between) and was measured slower or
    equal, so it is not used (``_slab_gather`` stays only for :func:`bench_slab_attention`).
    Figures, min ms over 7 interleaved runs, float32, 8 full slots of C=512, 32 q heads x
    128, 2-core Xeon VM shared with other jobs, torch 2.13 (per-slot / gather)::

        threads  kv_heads  rows=1 (decode)    rows=512 (prefill chunk)
        1        32        19.8 / 102.8       391 / 466
        1         8         6.6 /  11.6       348 / 351
        2        32         9.2 /  51.2       214 / 248
        2         8         3.4 /   6.1       206 / 206
    """
    _check_slab(q, slab, layer, slots, tokens)
    rows, q_heads, head_dim = q.shape
    work = [(s, n) for s, n in zip(slots, tokens) if n > 0]
    if rows == 0 or not work:
        return empty_partial(rows, q_heads, head_dim, device=q.device)
    if slab.is_cuda:  # one batched FlashInfer launch over the slots as pages
        return gpu_slab_attention(q, slab, layer, [(0, rows, [s for s, _ in work], [n for _, n in work])],
                                         scale)
    scale = softmax_scale(scale, head_dim)
    grouped_rows = rows * (q_heads // slab.shape[3])
    kernel = _kernel_for(slab, grouped_rows, slab.is_contiguous())
    if kernel is not None:
        return native.slab_attention(q, slab, layer, [s for s, _ in work], [n for _, n in work], scale, kernel)
    qg = to_grouped(q, slab.shape[3])
    if qg.shape[1] <= SMALL_ROWS:
        return from_grouped(*_slab_small_rows(qg, slab, layer, work, scale), rows)
    # float32 math over half K/V (widened per slot): q is never rounded to the KV dtype
    # (docs/design.md "KV dtype"); this is the many-row (prefill) path, compute-bound.
    qg = qg.float()
    parts = [attend_grouped(qg, *(t.float() for t in _slot_kv(slab, layer, s, n)), scale) for s, n in work]
    if len(parts) == 1:
        return from_grouped(*parts[0], rows)
    o_g, lse_g = merge_seq([p[0].float() for p in parts], torch.stack([p[1] for p in parts]))
    return from_grouped(o_g, lse_g, rows)


def slabs_partial_attention(q: Tensor, slabs: Sequence[Tensor], layer: int, sources: Sequence[int],
                            slots: Sequence[int], tokens: Sequence[int], scale: float | None = None) -> Partial:
    """:func:`slab_partial_attention` over slots of several slabs of one shape and dtype,
    slot ``i`` being in ``slabs[sources[i]]`` (a query engine's own slab and the
    co-located peers' it maps). Few rows on CPU with the csrc kernel built: one kernel
    call, one softmax over all of them; otherwise one call per slab, merged exactly."""
    if len(sources) != len(slots):
        raise ValueError(f"{len(sources)} slab indices for {len(slots)} slots")
    if any(not 0 <= k < len(slabs) for k in sources):
        raise ValueError(f"slab indices must lie in [0, {len(slabs)})")
    used = sorted(set(sources))
    if len(used) <= 1:
        return slab_partial_attention(q, slabs[used[0] if used else 0], layer, slots, tokens, scale)
    first = slabs[used[0]]
    if any(slabs[k].shape != first.shape or slabs[k].dtype != first.dtype or slabs[k].device != first.device
           for k in used):
        raise ValueError("the slabs of one call must have one shape, dtype and device")
    _check_slab(q, first, layer, slots, tokens)
    rows, q_heads, head_dim = q.shape
    kernel = None if first.is_cuda else \
        _kernel_for(first, rows * (q_heads // first.shape[3]), all(slabs[k].is_contiguous() for k in used))
    if kernel is not None and rows:
        work = [(k, s, n) for k, s, n in zip(sources, slots, tokens) if n > 0]
        if not work:
            return empty_partial(rows, q_heads, head_dim)
        renumber = {k: j for j, k in enumerate(used)}  # only the slabs used go to the kernel
        return native.slab_attention(q, [slabs[k] for k in used], layer, [w[1] for w in work], [w[2] for w in work],
                                     softmax_scale(scale, head_dim), kernel, [renumber[w[0]] for w in work])
    parts = [slab_partial_attention(q, slabs[k], layer, [s for j, s in zip(sources, slots) if j == k],
                                    [n for j, n in zip(sources, tokens) if j == k], scale) for k in used]
    return merge_many(torch.stack([p.o for p in parts]), torch.stack([p.lse for p in parts]))


def prepare_slabs_attention(rows: int, q_heads: int, slabs: Sequence[Tensor], sources: Sequence[int],
                            slots: Sequence[int], tokens: Sequence[int]) -> Callable[..., Partial]:
    """:func:`slabs_partial_attention` of ``rows`` q rows over these slots, checked and
    set up once for every layer (a query engine's plan: plan once, run many): the call
    returned takes ``(q, layer)``, and ``out``, an ``(o, lse)`` pair of contiguous float32
    tensors to write the result into (returned then). On the csrc kernel's path the slot
    tables are built here, so a layer costs one kernel call, which writes into ``out``
    itself; otherwise each call is the function's."""
    if slabs and not slabs[0].is_cuda and rows and len(slots) == len(tokens) == len(sources):
        first = slabs[0]
        used = sorted(set(sources))
        same = all(slabs[k].shape == first.shape and slabs[k].dtype == first.dtype for k in used)
        head_dim, kv_heads = first.shape[5], first.shape[3]
        kernel = _kernel_for(first, rows * (q_heads // kv_heads), all(slabs[k].is_contiguous() for k in used)) \
            if same and kv_heads and q_heads % kv_heads == 0 else None
        work = [(k, s, n) for k, s, n in zip(sources, slots, tokens) if n > 0]
        if kernel is not None and work and all(0 <= n <= first.shape[4] for n in tokens):
            renumber = {k: j for j, k in enumerate(used)}
            table = [slabs[k] for k in used]
            idx = torch.as_tensor([w[1] for w in work], dtype=torch.int64)
            cnt = torch.as_tensor([w[2] for w in work], dtype=torch.int64)
            src = torch.as_tensor([renumber[w[0]] for w in work], dtype=torch.int64)
            scale = softmax_scale(None, head_dim)

            def call(q: Tensor, layer: int, out: Partial | None = None) -> Partial:
                try:
                    if out is None:
                        return Partial(*kernel.slab_attention(q.float(), table, int(layer), idx, cnt, scale, src))
                    return Partial(*kernel.slab_attention(q.float(), table, int(layer), idx, cnt, scale, src, *out))
                except RuntimeError as exc:  # TORCH_CHECK failures: the call does not fit
                    raise ValueError(str(exc).splitlines()[0]) from None
            return call

    return lambda q, layer, out=None: write_into(slabs_partial_attention(q, slabs, layer, sources, slots, tokens), out)


def _slab_small_rows(qg: Tensor, slab: Tensor, layer: int, work: list[tuple[int, int]],
                     scale: float) -> tuple[Tensor, Tensor]:
    """Few-row slab attention: scores of every slot, one exact softmax, then P @ V per
    slot. K/V are read in place (float32 math; half K/V are upcast per slot). Grouped
    layout in and out: qg ``[Hk, R, E]`` -> ``o`` ``[Hk, R, E]``, ``lse`` ``[Hk, R]``."""
    kvs = [_slot_kv(slab, layer, s, n) for s, n in work]
    qf = qg.float()
    scores = torch.cat([torch.matmul(qf, k.float().transpose(1, 2)) for k, _ in kvs], dim=2)
    scores.mul_(scale)
    lse = torch.logsumexp(scores, dim=2)  # [Hk, R]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    o, off = None, 0
    for (_, v), (_, n) in zip(kvs, work):
        part = torch.matmul(probs[:, :, off : off + n], v.float())
        o = part if o is None else o.add_(part)
        off += n
    return o, lse


def _slab_gather(q: Tensor, slab: Tensor, layer: int, slots: Sequence[int],
                 tokens: Sequence[int], scale: float | None = None) -> Partial:
    """The alternative measured against :func:`slab_partial_attention`: gather the slots'
    valid K/V into one ``[kv_heads, total, E]`` copy and make one kernel call."""
    rows, q_heads, head_dim = q.shape
    work = [(s, n) for s, n in zip(slots, tokens) if n > 0]
    if rows == 0 or not work:
        return empty_partial(rows, q_heads, head_dim, device=q.device)
    kvs = [_slot_kv(slab, layer, s, n) for s, n in work]
    kh, vh = torch.cat([kv[0] for kv in kvs], dim=1), torch.cat([kv[1] for kv in kvs], dim=1)
    o_g, lse_g = attend_grouped(to_grouped(q, slab.shape[3]), kh, vh, softmax_scale(scale, head_dim))
    return from_grouped(o_g, lse_g, rows)


# ---------------------------------------------------------------------------- benchmark


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall seconds of ``repeats`` calls of each ``fn()``, the calls interleaved (so load
    from other processes hits all alike), after one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _time_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """``{name: (min, median)}`` wall times in ms of :func:`interleaved_times`."""
    return {name: (min(ts) * 1e3, sorted(ts)[len(ts) // 2] * 1e3)
            for name, ts in interleaved_times(fns, repeats).items()}


def bench_slab_attention(q_heads: int = 32, kv_heads: int = 32, head_dim: int = 128,
                         num_slots: int = 8, capacity: int = 512, repeats: int = 7) -> dict:
    """Per-slot (:func:`slab_partial_attention`) vs gather (:func:`_slab_gather`) timings
    for 1 row (decode) and 512 rows (prefill chunk), float32, full slots. Prints and
    returns ``{rows: {"per_slot": (min_ms, median_ms), "gather": (min_ms, median_ms)}}``.
    Not a test."""
    torch.manual_seed(0)
    slab = torch.randn(num_slots, 2, 2, kv_heads, capacity, head_dim)
    slots, tokens = list(range(num_slots)), [capacity] * num_slots
    result = {}
    for rows in (1, 512):
        q = torch.randn(rows, q_heads, head_dim)
        result[rows] = _time_ms({
            "per_slot": lambda q=q: slab_partial_attention(q, slab, 1, slots, tokens),
            "gather": lambda q=q: _slab_gather(q, slab, 1, slots, tokens),
        }, repeats)
        cells = "  ".join(f"{k} min {a:7.2f} med {b:7.2f} ms" for k, (a, b) in result[rows].items())
        print(f"Hq={q_heads} Hk={kv_heads} rows={rows:4d}  {cells}  threads={torch.get_num_threads()}")
    return result
