"""A GPU slab's attention where FlashInfer is not there: the same paged batch
(:func:`~tokenlake.kernels.paged.paged_batch`) computed in torch, float32, on the slab's
device (docs/design.md "GPU path"). :func:`gpu_slab_attention` picks FlashInfer's one
launch where it imports, this path otherwise.

The entries of a query run together, padded: each entry's pages are gathered into one
K/V (tokens past its own masked out), its rows padded to the run's most (a padded row
reads its entry's first row and writes a scratch row), and both products are batched
over the run's entries. Entries are sorted by their pages and rows first and a run is
cut where padding would add half again to its work (and more than a run's launches cost)
or where its float32 K/V would pass half of :data:`TORCH_STEP_ELEMENTS`; a run's rows
are split into steps so that the scores fit. One entry's K/V alone is not split (its own length bounds it). The index tensors of
a paged batch are made once and kept (:func:`_runs`): a query attends the same entries in
every layer, as FlashInfer's plan is made once per query, so a layer is the gathers and a
dozen launches. Any device: the tests check it against the reference on the CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenlake.kernels.attention import Partial, Tensor, empty_partial, softmax_scale
from tokenlake.kernels.paged import (
    Group,
    PagedBatch,
    flashinfer_slab_attention,
    packed_query,
    unpack,
)

log = logging.getLogger(__name__)

#: Most float32 elements one step of the torch path holds: half of it for a run's gathered
#: K and V, half for its scores and their exponentials (64 Mi: 256 MB).
TORCH_STEP_ELEMENTS = 1 << 26
#: A run is cut where padding its entries to its longest would add this much to its work
#: and more than :data:`PADDING_SLACK` elements: a run's dozen launches cost a GPU more
#: than reading that much (on an H200, 16 Mi float32 elements are ~20 µs of its memory
#: bandwidth, a launch from Python ~20 µs), so a decode batch's shared prefix and its
#: requests' short tails stay one run.
PADDING = 1.5
PADDING_SLACK = 1 << 24

@functools.cache
def flashinfer_usable() -> bool:
    """Whether FlashInfer imports here (tried once; a package that is there but fails to
    import is logged and the torch path serves)."""
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # noqa: BLE001 - not installed, or broken: torch serves
        if importlib.util.find_spec("flashinfer") is not None:
            log.warning("FlashInfer is installed but does not import (%s): attending with torch", exc)
        return False
    return True


def gpu_slab_attention(q: Tensor, slab: Tensor, layer: int, groups: Sequence[Group],
                       scale: float | None = None) -> Partial:
    """A CUDA slab's attention: one FlashInfer launch where FlashInfer imports,
    :func:`torch_slab_attention` otherwise."""
    attend = flashinfer_slab_attention if flashinfer_usable() else torch_slab_attention
    return attend(q, slab, layer, groups, scale)


def warm_up(slab: Tensor, q_heads: int) -> None:
    """Loads the batched kernels (decode and prefill) for ``slab``'s dtype and head size
    before the first query needs them: the first use on a machine compiles them
    (FlashInfer's JIT, cached under ``~/.cache/flashinfer``; 20-35 s per kernel on an H100
    machine), longer than a query may wait. Reads one token of slot 0; writes nothing.
    Nothing to do without FlashInfer (the torch path compiles nothing)."""
    if not flashinfer_usable():
        return
    q = torch.zeros(2, q_heads, slab.shape[5], device=slab.device)
    flashinfer_slab_attention(q[:1], slab, 0, [(0, 1, [0], [1])])  # decode
    flashinfer_slab_attention(q, slab, 0, [(0, 2, [0], [1])])  # prefill
    torch.cuda.synchronize(slab.device)


def torch_slab_attention(q: Tensor, slab: Tensor, layer: int, groups: Sequence[Group],
                         scale: float | None = None) -> Partial:
    """What :func:`~tokenlake.kernels.paged.flashinfer_slab_attention` computes, in torch
    (float32, q not rounded to the K/V dtype) on the slab's device (module docstring)."""
    rows, q_heads, head_dim = q.shape
    batch, q_packed = packed_query(q, slab, groups)
    if batch.entries == 0:
        return empty_partial(rows, q_heads, head_dim, device=slab.device)
    o, lse = _padded_attention(q_packed, slab[:, layer, 0], slab[:, layer, 1], batch, softmax_scale(scale, head_dim))
    return unpack(batch, o, lse, rows)


def _entry_runs(pages: Sequence[int], rows: Sequence[int], page: int, q_heads: int, kv_size: int,
                bound: int) -> list[tuple[int, int]]:
    """Runs ``[a, b)`` of entries (``pages[e]``, ``rows[e]``: their pages and rows, in
    the order they run) whose padded float32 K and V (entries x most pages x ``page`` x
    ``kv_size``, twice) fit half of ``bound`` and whose padding adds at most
    :data:`PADDING` to their work or at most :data:`PADDING_SLACK` elements, or one entry
    alone."""
    runs, start, most_p, most_r, work = [], 0, 0, 0, 0  # work: the run's, unpadded
    for e, (p, r) in enumerate(zip(pages, rows)):
        own = p * page * (r * q_heads + kv_size)
        n, p2, r2 = e + 1 - start, max(most_p, p), max(most_r, r)
        padded = n * p2 * page * (r2 * q_heads + kv_size)
        if e > start and (2 * n * p2 * page * kv_size > bound // 2
                          or (padded > PADDING * (work + own) and padded - (work + own) > PADDING_SLACK)):
            runs.append((start, e))
            start, p2, r2, work = e, p, r, 0
        most_p, most_r, work = p2, r2, work + own
    runs.append((start, len(pages)))
    return runs


@dataclass(frozen=True)
class _Run:
    """One run's index tensors, on the device: ``pages`` [n, most pages] (padded with the
    entry's first), ``read`` and ``write`` [n, most rows] (padded with the entry's first
    row, and with the scratch row past the packed rows), ``past`` [n, 1, 1, tokens] (True
    past an entry's tokens); ``step``: rows a step (its scores within the bound)."""

    pages: Tensor
    read: Tensor
    write: Tensor
    past: Tensor
    step: int


@functools.lru_cache(maxsize=1024)
def _runs(batch: PagedBatch, page: int, q_heads: int, kv_size: int, device: str,
          bound: int) -> tuple[_Run, ...]:
    """The runs of ``batch`` (``bound``: :data:`TORCH_STEP_ELEMENTS`), made once per paged
    batch (the same in every layer of a query)."""
    order = sorted(range(batch.entries), key=lambda e: (batch.kv_indptr[e + 1] - batch.kv_indptr[e],
                                                        batch.qo_indptr[e + 1] - batch.qo_indptr[e]))
    pages = [list(batch.kv_indices[batch.kv_indptr[e]:batch.kv_indptr[e + 1]]) for e in order]
    rows = [list(range(batch.qo_indptr[e], batch.qo_indptr[e + 1])) for e in order]
    scratch = batch.qo_indptr[-1]  # a row past the packed ones: where padded rows write
    out = []
    for a, b in _entry_runs([len(p) for p in pages], [len(r) for r in rows], page, q_heads, kv_size, bound):
        n = b - a
        most_pages, most_rows = max(map(len, pages[a:b])), max(map(len, rows[a:b]))
        width = max(most_pages, most_rows, n)
        tokens = [(len(p) - 1) * page + batch.last_page_len[e] for e, p in zip(order[a:b], pages[a:b])]
        host = ([ids + ids[:1] * (width - len(ids)) for ids in pages[a:b] + rows[a:b]]
                + [ids + [scratch] * (width - len(ids)) for ids in rows[a:b]] + [tokens + [0] * (width - n)])
        idx = torch.tensor(host, dtype=torch.long).to(device)  # one copy to the device
        past = torch.arange(most_pages * page, device=device) >= idx[3 * n, :n][:, None]
        out.append(_Run(idx[:n, :most_pages], idx[n:2 * n, :most_rows], idx[2 * n:3 * n, :most_rows],
                        past[:, None, None, :], max(1, bound // 4 // (n * q_heads * most_pages * page))))
    return tuple(out)


def _padded_attention(q_packed: Tensor, k_pages: Tensor, v_pages: Tensor, batch: PagedBatch,
                      scale: float) -> tuple[Tensor, Tensor]:
    """What :func:`~tokenlake.kernels.paged.paged_reference` returns for ``batch``
    (``o`` [packed rows, q heads, E], natural-log ``lse``), a run of entries at a time."""
    dev = q_packed.device
    packed, q_heads, head_dim = q_packed.shape
    kv_heads, page = k_pages.shape[1], k_pages.shape[2]
    group = q_heads // kv_heads
    o = torch.empty(packed + 1, q_heads, head_dim, dtype=torch.float32, device=dev)  # + the scratch row
    lse = torch.empty(packed + 1, q_heads, dtype=torch.float32, device=dev)
    for run in _runs(batch, page, q_heads, kv_heads * head_dim, str(dev), TORCH_STEP_ELEMENTS):
        n, most_pages = run.pages.shape
        k, v = (torch.empty(n, kv_heads, most_pages * page, head_dim, dtype=torch.float32, device=dev)
                for _ in range(2))  # [n, Hk, S, E], contiguous: the products read it as it is
        for dst, pages_kv in ((k, k_pages), (v, v_pages)):
            dst.view(n, kv_heads, most_pages, page, head_dim).copy_(pages_kv[run.pages].transpose(1, 2))
        for r0 in range(0, run.read.shape[1], run.step):
            read, write = run.read[:, r0:r0 + run.step], run.write[:, r0:r0 + run.step]
            rows = read.shape[1]
            qh = q_packed[read].float().view(n, rows, kv_heads, group, head_dim).permute(0, 2, 1, 3, 4) \
                .reshape(n, kv_heads, rows * group, head_dim)
            scores = torch.matmul(qh, k.transpose(2, 3)).mul_(scale).masked_fill_(run.past, float("-inf"))
            lse_r = torch.logsumexp(scores, dim=-1)  # [n, Hk, rows * group]
            o_r = torch.matmul(scores.sub_(lse_r[..., None]).exp_(), v)  # [n, Hk, rows * group, E]
            o[write] = o_r.view(n, kv_heads, rows, group, head_dim).permute(0, 2, 1, 3, 4) \
                .reshape(n, rows, q_heads, head_dim)
            lse[write] = lse_r.view(n, kv_heads, rows, group).permute(0, 2, 1, 3).reshape(n, rows, q_heads)
    return o[:packed], lse[:packed]
