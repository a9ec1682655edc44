"""Slab attention as one batched paged-attention call (the CUDA path, issue #21).

A query engine attends groups of query rows (a request's rows in a sub-batch) over
lists of slab slots (its segments on this instance). FlashInfer's batched kernels take
a paged KV cache in CSR form instead: per batch entry a range of q rows (``qo_indptr``),
a list of page ids (``kv_indptr`` / ``kv_indices``) of which every page but the last is
full, and the last page's length. A slot is a page (``page_size = C``) of the slab's
layer view ``slab[:, layer, 0]`` / ``slab[:, layer, 1]`` (``[slots, kv_heads, C, E]``,
FlashInfer's ``HND`` layout with a page stride of the whole segment).

:func:`paged_batch` translates the groups: a group's full slots and its first partial
slot form one entry (the partial one last); each further partial slot (a page hit read
in place beside a request's own open tail) is an entry of its own over the same rows;
empty slots are dropped. :func:`unpack` merges the entries of each group back into one
partial per q row, exactly by log-sum-exp. :func:`paged_reference` is what the kernel
computes, in torch on any device: the tests check the translation against the slab
attention (tests/test_paged_plan.py), without a GPU. :func:`flashinfer_slab_attention`
makes the one call per layer per query (tested on a GPU, ``pytest -m gpu``; CI has none).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenlake.kernels.attention import (
    Partial,
    Tensor,
    empty_partial,
    lse_base2_to_natural,
    merge,
    softmax_scale,
)

#: (first row, stop row, slots, tokens per slot): what a query engine attends.
Group = tuple[int, int, Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class PagedBatch:
    """One batched call in FlashInfer's CSR form (module docstring). Entry ``e`` reads
    q rows ``rows[e]`` (packed one after the other: ``qo_indptr``) over pages
    ``kv_indices[kv_indptr[e]:kv_indptr[e + 1]]``, the last holding ``last_page_len[e]``
    tokens, the others full."""

    qo_indptr: tuple[int, ...]
    kv_indptr: tuple[int, ...]
    kv_indices: tuple[int, ...]
    last_page_len: tuple[int, ...]
    rows: tuple[tuple[int, int], ...]

    @property
    def entries(self) -> int:
        return len(self.rows)

    def q_index(self) -> list[int]:
        """The caller's row of every packed q row."""
        return [r for start, stop in self.rows for r in range(start, stop)]

    def is_decode(self) -> bool:
        """Every entry reads one q row (FlashInfer's decode kernels serve it)."""
        return all(stop - start == 1 for start, stop in self.rows)

    def is_identity(self, rows: int) -> bool:
        """The packed rows are the caller's ``rows`` rows, each once and in order (one
        entry per row range, the ranges back to back from 0): no gather, no merge.
        Read off the ranges, not :meth:`q_index` (asked twice a call, every layer)."""
        ends = [0] + [stop for _, stop in self.rows]
        return ends[-1] == rows and all(start == end for (start, _), end in zip(self.rows, ends))


def paged_batch(groups: Sequence[Group], page_tokens: int) -> PagedBatch:
    """The CSR batch of ``groups`` over pages of ``page_tokens`` (the slab's ``C``).
    Raises ``ValueError`` for a token count outside ``[0, page_tokens]`` or an empty
    row range."""
    qo, kv_ptr, idx, last, rows = [0], [0], [], [], []

    def entry(start: int, stop: int, pages: list[int], tail: int) -> None:
        qo.append(qo[-1] + stop - start)
        idx.extend(pages)
        kv_ptr.append(len(idx))
        last.append(tail)
        rows.append((start, stop))

    for start, stop, slots, tokens in groups:
        if stop <= start:
            raise ValueError(f"empty row range [{start}, {stop})")
        if any(not 0 <= n <= page_tokens for n in tokens):
            raise ValueError(f"token counts must lie in [0, {page_tokens}], got {list(tokens)}")
        full = [s for s, n in zip(slots, tokens) if n == page_tokens]
        partial = [(s, n) for s, n in zip(slots, tokens) if 0 < n < page_tokens]
        if partial:
            s, n = partial[0]
            entry(start, stop, full + [s], n)
        elif full:
            entry(start, stop, full, page_tokens)
        for s, n in partial[1:]:
            entry(start, stop, [s], n)
    return PagedBatch(tuple(qo), tuple(kv_ptr), tuple(idx), tuple(last), tuple(rows))


def paged_reference(q_packed: Tensor, k_pages: Tensor, v_pages: Tensor, batch: PagedBatch,
                    scale: float) -> tuple[Tensor, Tensor]:
    """What the batched kernel returns for ``batch``, in torch (float32): ``o``
    ``[packed rows, q_heads, E]`` and natural-log ``lse`` ``[packed rows, q_heads]``.
    ``k_pages`` / ``v_pages``: ``[pages, kv_heads, page_tokens, E]`` (HND)."""
    q_heads, head_dim = q_packed.shape[1], q_packed.shape[2]
    kv_heads, page = k_pages.shape[1], k_pages.shape[2]
    o = torch.empty(q_packed.shape, dtype=torch.float32, device=q_packed.device)
    lse = torch.empty(q_packed.shape[:2], dtype=torch.float32, device=q_packed.device)
    for e in range(batch.entries):
        pages = torch.tensor(batch.kv_indices[batch.kv_indptr[e]:batch.kv_indptr[e + 1]], device=k_pages.device)
        tokens = (pages.numel() - 1) * page + batch.last_page_len[e]  # every page full but the last
        k, v = (kv.index_select(0, pages).transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :tokens].float()
                for kv in (k_pages, v_pages))  # [Hk, tokens, E]: the pages one after the other
        a, z = batch.qo_indptr[e], batch.qo_indptr[e + 1]
        qg = q_packed[a:z].float().reshape(z - a, kv_heads, q_heads // kv_heads, head_dim)
        s = torch.einsum("rhge,hse->rhgs", qg, k) * scale
        lse_e = torch.logsumexp(s, dim=-1)
        o[a:z] = torch.einsum("rhgs,hse->rhge", torch.exp(s - lse_e[..., None]), v).reshape(z - a, q_heads, head_dim)
        lse[a:z] = lse_e.reshape(z - a, q_heads)
    return o, lse


def packed_query(q: Tensor, slab: Tensor, groups: Sequence[Group]) -> tuple[PagedBatch, Tensor]:
    """The paged batch of ``groups`` over ``slab``'s slots and ``q``'s rows in its packed
    order, on the slab's device (what every backend of a GPU slab starts from)."""
    batch = paged_batch(groups, slab.shape[4])
    dev = slab.device
    if batch.is_identity(q.shape[0]):
        return batch, q.to(dev)
    return batch, q.to(dev)[torch.tensor(batch.q_index(), dtype=torch.long, device=dev)]


def unpack(batch: PagedBatch, o_packed: Tensor, lse_packed: Tensor, rows: int) -> Partial:
    """One partial per caller row: the entries over the same rows merged by LSE; rows no
    entry covers attend nothing (``lse = -inf``, ``o = 0``)."""
    if batch.is_identity(rows):  # every row in one entry, in order: nothing to merge
        return Partial(o_packed.float(), lse_packed.float())
    out = empty_partial(rows, o_packed.shape[1], o_packed.shape[2], device=o_packed.device)
    o, lse = out
    for e, (start, stop) in enumerate(batch.rows):
        a, z = batch.qo_indptr[e], batch.qo_indptr[e + 1]
        o[start:stop], lse[start:stop] = merge(o[start:stop], lse[start:stop], o_packed[a:z].float(),
                                               lse_packed[a:z].float())
    return out


#: FlashInfer's FA2 kernels: they run on every CUDA GPU FlashInfer supports (FA3 on Hopper
#: only), and a query engine attends a few rows per request, not FA3's long query tiles.
FLASHINFER_BACKEND = "fa2"


@dataclass
class _Wrappers:
    """A device's two FlashInfer wrappers (batched prefill for entries of several rows,
    batched decode when every entry is one row: a decode step's queries), the lock that
    keeps a plan and its runs together, and what each was last planned for: a query
    engine attends the same groups in every layer, so only a query's first layer plans
    (FlashInfer's plan works on the host and copies its schedule to the device); the
    others only launch."""

    prefill: object
    decode: object
    lock: threading.Lock
    keys: dict[str, tuple] = field(default_factory=dict)


_by_device: dict[str, _Wrappers] = {}
_by_device_lock = threading.Lock()


def _wrappers(device: torch.device) -> _Wrappers:
    """The FlashInfer wrappers (and their workspaces) of ``device``, made once."""
    try:
        import flashinfer  # optional GPU dependency: only where this path runs
    except ImportError as exc:
        raise RuntimeError("FlashInfer is not installed (pip install 'tokenlake[gpu]')") from exc
    key = str(device)
    with _by_device_lock:
        if key not in _by_device:
            def workspace() -> Tensor:
                return torch.empty(128 << 20, dtype=torch.uint8, device=device)

            _by_device[key] = _Wrappers(
                flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), kv_layout="HND",
                                                               backend=FLASHINFER_BACKEND),
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout="HND",
                                                              use_tensor_cores=False, backend=FLASHINFER_BACKEND),
                threading.Lock())
        return _by_device[key]


def _planned(ws: _Wrappers, batch: PagedBatch, q_heads: int, slab: Tensor, sm_scale: float):
    """The wrapper that serves ``batch`` over ``slab``, planned for it (again only if its
    last plan was for something else). The caller holds ``ws.lock``."""
    kv_heads, page, head_dim = slab.shape[3], slab.shape[4], slab.shape[5]
    decode = batch.is_decode()
    kind = "decode" if decode else "prefill"
    key = (batch, q_heads, kv_heads, head_dim, page, sm_scale, slab.dtype)
    wrapper = ws.decode if decode else ws.prefill
    if ws.keys.get(kind) == key:
        return wrapper

    def ints(values) -> Tensor:  # on the host: plan() reads them there (no device sync)
        return torch.tensor(values, dtype=torch.int32)

    ws.keys.pop(kind, None)  # a plan that fails halfway plans again next time
    pages = (ints(batch.kv_indptr), ints(batch.kv_indices), ints(batch.last_page_len))
    if decode:
        wrapper.plan(*pages, q_heads, kv_heads, head_dim, page, sm_scale=sm_scale,
                     q_data_type=slab.dtype, kv_data_type=slab.dtype)
    else:
        wrapper.plan(ints(batch.qo_indptr), *pages, q_heads, kv_heads, head_dim, page, causal=False,
                     sm_scale=sm_scale, q_data_type=slab.dtype, kv_data_type=slab.dtype)
    ws.keys[kind] = key
    return wrapper


def flashinfer_slab_attention(q: Tensor, slab: Tensor, layer: int, groups: Sequence[Group],
                              scale: float | None = None) -> Partial:
    """Partial attention of the ``groups`` of ``q`` ``[rows, q_heads, E]`` over a CUDA
    slab's slots in **one** FlashInfer launch (the slab as a paged cache: batched decode
    when every entry is one row, non-causal batched prefill otherwise; q cast to the
    slab's half dtype), merged back per row. Returns float32 ``o`` and natural-log
    ``lse`` on the slab's device. The translation is tested against
    :func:`paged_reference` on the CPU, the call itself on a GPU (``pytest -m gpu``;
    docs/design.md "GPU path"). Raises ``RuntimeError`` without CUDA or FlashInfer."""
    if not (torch.cuda.is_available() and slab.is_cuda):
        raise RuntimeError("flashinfer_slab_attention needs a CUDA slab on a CUDA build")
    rows, q_heads, head_dim = q.shape
    batch, q_packed = packed_query(q, slab, groups)
    if batch.entries == 0:
        return empty_partial(rows, q_heads, head_dim, device=slab.device)
    dev = slab.device
    ws = _wrappers(dev)
    with torch.cuda.device(dev), ws.lock:  # one plan, then its runs: not another thread's
        wrapper = _planned(ws, batch, q_heads, slab, softmax_scale(scale, head_dim))
        o, lse2 = wrapper.run(q_packed.to(slab.dtype), (slab[:, layer, 0], slab[:, layer, 1]), return_lse=True)
    return unpack(batch, o, lse_base2_to_natural(lse2.float()), rows)
