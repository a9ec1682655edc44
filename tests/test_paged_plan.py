"""The CUDA path's translation of a query engine's slot lists into FlashInfer's batched
paged-KV form (issue #21), checked on the CPU: the CSR arrays keep FlashInfer's rules
(every page but an entry's last is full), and attention computed as the kernel would
over them, merged back per row, equals the slab attention of each group. The one
FlashInfer call itself needs a GPU (marked; skipped here)."""

from __future__ import annotations

import random

import pytest
import torch

from tokenlake.kernels.attention import partial_attention_ref
from tokenlake.kernels.paged import paged_batch, paged_reference, unpack

C = 16


def _slab(slots=12, layers=2, kv_heads=2, head_dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, layers, 2, kv_heads, C, head_dim, generator=g)


def _want(q, slab, layer, groups):
    """float64 attention of each group's rows over its slots' valid tokens."""
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for start, stop, slots, tokens in groups:
        live = [(s, n) for s, n in zip(slots, tokens) if n]
        if not live:
            continue
        k = torch.cat([slab[s, layer, 0, :, :n].transpose(0, 1) for s, n in live]).double()
        v = torch.cat([slab[s, layer, 1, :, :n].transpose(0, 1) for s, n in live]).double()
        o[start:stop], lse[start:stop] = partial_attention_ref(q[start:stop].double(), k, v, scale=0.3)
    return o, lse


def _check(q, slab, layer, groups):
    batch = paged_batch(groups, C)
    for e in range(batch.entries):  # FlashInfer's rule: only an entry's last page may be short
        pages = batch.kv_indices[batch.kv_indptr[e]:batch.kv_indptr[e + 1]]
        assert pages and 1 <= batch.last_page_len[e] <= C
        start, stop = batch.rows[e]
        assert batch.qo_indptr[e + 1] - batch.qo_indptr[e] == stop - start
    q_packed = q[torch.tensor(batch.q_index(), dtype=torch.long)] if batch.entries else q[:0]
    o, lse = paged_reference(q_packed, slab[:, layer, 0], slab[:, layer, 1], batch, 0.3)
    got = unpack(batch, o, lse, q.shape[0])
    want_o, want_lse = _want(q, slab, layer, groups)
    torch.testing.assert_close(got.o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    return batch


def test_full_slots_and_one_tail_are_one_entry():
    slab, q = _slab(), torch.randn(3, 4, 8)
    batch = _check(q, slab, 1, [(0, 3, [5, 2, 7], [C, 9, C])])
    assert batch.kv_indices == (5, 7, 2) and batch.last_page_len == (9,) and batch.entries == 1
    assert batch.is_identity(3)  # the packed rows are the caller's: no gather, no merge
    assert not paged_batch([(0, 2, [5], [C])], C).is_identity(3)  # row 2 attends nothing


def test_a_page_hit_beside_an_own_tail_is_a_second_entry_merged_back():
    """Two partial slots over the same rows (a page hit read in place and the request's
    own tail): two entries, merged exactly."""
    slab, q = _slab(), torch.randn(2, 4, 8)
    batch = _check(q, slab, 0, [(0, 2, [1, 3, 4], [C, 4, 11])])
    assert batch.entries == 2 and batch.rows == ((0, 2), (0, 2))
    assert not batch.is_identity(2)


def test_groups_of_several_requests_empty_slots_and_rows_without_prefix():
    slab, q = _slab(), torch.randn(7, 4, 8)
    groups = [(0, 1, [0, 1], [C, C]), (1, 4, [2, 6, 8], [0, 3, C]), (4, 5, [9], [0]), (5, 7, [10], [5])]
    batch = _check(q, slab, 1, groups)
    assert batch.entries == 3  # the group with only an empty slot has no entry: row 4 sees nothing


@pytest.mark.parametrize("seed", range(6))
def test_random_groups(seed):
    rng = random.Random(seed)
    slab, q = _slab(seed=seed), torch.randn(12, 4, 8, generator=torch.Generator().manual_seed(seed))
    groups, row = [], 0
    while row < 12:
        stop = min(12, row + rng.randint(1, 4))
        slots = rng.sample(range(12), rng.randint(1, 5))
        groups.append((row, stop, slots, [rng.choice([0, C, rng.randint(1, C)]) for _ in slots]))
        row = stop
    _check(q, slab, rng.randrange(2), groups)


def test_a_layouts_shared_slots_are_one_entry_over_their_rows():
    """The query engine's GPU groups (``AttendLayout.paged_groups``): six decode rows, five
    of them behind the same three-slot system prompt (row 4 is not, so the five are two
    runs), each with its own tail. The prompt is one entry per run of rows, so its pages
    are read twice, not five times; merged back, every row equals attending its slots
    one row at a time."""
    from tokenlake.dataplane.messages import AttendItem
    from tokenlake.engines.query import AttendLayout

    prompt = ((0, 1, 2), (C, C, C))
    items = [AttendItem(r, r + 1, (3 + r,), (1 + r,)) for r in range(6)]
    items += [AttendItem(r, r + 1, *prompt) for r in (0, 1, 2, 3, 5)]
    cascade, flat = AttendLayout.of({0: items}), AttendLayout.of({0: items}, cascade=False)
    slab, q = _slab(), torch.randn(6, 4, 8)
    batch, per_row = paged_batch(cascade.paged_groups, C), paged_batch(flat.paged_groups, C)
    assert len(batch.kv_indices) == 2 * 3 + 6 and len(per_row.kv_indices) == 5 * 3 + 6
    assert sorted(batch.rows) == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (5, 6)]
    q_packed = q[torch.tensor(batch.q_index(), dtype=torch.long)]
    got = unpack(batch, *paged_reference(q_packed, slab[:, 1, 0], slab[:, 1, 1], batch, 0.3), 6)
    want_o, want_lse = _want(q, slab, 1, flat.paged_groups)  # one group per row: all its slots
    torch.testing.assert_close(got.o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match="token counts"):
        paged_batch([(0, 1, [0], [C + 1])], C)
    with pytest.raises(ValueError, match="empty row range"):
        paged_batch([(2, 2, [0], [1])], C)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_flashinfer_launch_equals_the_reference():
    """Layer after layer with the same groups (planned once), then other groups (planned
    again), then one row per request (the decode kernel; a page hit beside an own tail
    makes two entries of one row): every result equals the reference of its groups and layer."""
    pytest.importorskip("flashinfer")
    from tokenlake.kernels.paged import flashinfer_slab_attention

    slab = torch.randn(12, 2, 2, 8, 64, 128).bfloat16().cuda()
    q = torch.randn(6, 32, 128).cuda()
    first = [(0, 1, [0, 1, 2], [64, 64, 17]), (1, 6, [3, 4, 5], [64, 30, 12])]
    other = [(0, 6, [6, 7], [64, 5]), (2, 4, [8], [40])]
    decode = [(0, 1, [0, 1, 9], [64, 20, 7]), (2, 3, [10], [64]), (5, 6, [11, 3], [64, 64])]  # one row each
    assert paged_batch(decode, 64).is_decode() and not paged_batch(first, 64).is_decode()
    for groups, layer in ((first, 1), (first, 0), (other, 1), (decode, 1), (decode, 0), (first, 1)):
        got = flashinfer_slab_attention(q, slab, layer, groups, 128 ** -0.5)
        batch = paged_batch(groups, 64)
        q_packed = q[torch.tensor(batch.q_index(), device=q.device)].bfloat16().float()
        want = unpack(batch, *paged_reference(q_packed, slab[:, layer, 0], slab[:, layer, 1], batch,
                                              128 ** -0.5), 6)
        torch.testing.assert_close(got.o, want.o, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got.lse, want.lse, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", [None, 200, 1])
def test_the_torch_path_of_a_gpu_pool_equals_the_reference(dtype, step, monkeypatch):
    """Where FlashInfer is not installed a GPU pool's query engines attend with
    ``torch_slab_attention``; it runs on any device, so its result is checked here on the
    CPU: groups with full and partial slots, a page hit beside an own tail, entries of
    different row counts, an empty slot; all entries in one padded step, in several
    (``step`` elements a step), and one row at a time."""
    from tokenlake.kernels import paged_torch
    from tokenlake.kernels.paged_torch import torch_slab_attention

    if step is not None:
        monkeypatch.setattr(paged_torch, "TORCH_STEP_ELEMENTS", step)

    slab, q = _slab().to(dtype), torch.randn(7, 4, 8)
    groups = [(0, 2, [0, 1, 2], [C, C, 5]), (2, 3, [3, 4, 5], [C, 9, 3]), (3, 6, [6, 7], [C, 0]), (6, 7, [8], [C])]
    got = torch_slab_attention(q, slab, 1, groups, 0.3)
    want_o, want_lse = _want(q, slab.float(), 1, groups)
    torch.testing.assert_close(got.o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    empty = torch_slab_attention(q, slab, 0, [(0, 7, [3], [0])])  # nothing to attend: lse -inf
    assert torch.isinf(empty.lse).all() and not empty.o.any()


def test_the_torch_paths_runs_keep_their_bound_and_little_padding(monkeypatch):
    """Runs of sorted entries: each one's padded K and V fit half the bound and its padding
    adds at most half again to its work (here with no slack), unless the run is a single
    entry. With the slack, a decode batch's shared prefix and its requests' short tails
    stay one run."""
    from tokenlake.kernels import paged_torch
    from tokenlake.kernels.paged_torch import PADDING, _entry_runs

    tails = [2] * 8 + [17]  # 8 requests' own tails (1 row each), their shared document (8 rows)
    assert _entry_runs(tails, [1] * 8 + [8], 256, 9, 192, 1 << 26) == [(0, 9)]
    monkeypatch.setattr(paged_torch, "PADDING_SLACK", 0)

    rng = random.Random(0)
    for _ in range(200):
        entries = sorted((rng.randint(1, 40), rng.choice([1, 1, 1, 4, 64])) for _ in range(rng.randint(1, 30)))
        pages, rows = [p for p, _ in entries], [r for _, r in entries]
        bound = rng.choice([1 << 12, 1 << 16, 1 << 20])
        runs = _entry_runs(pages, rows, 16, 9, 192, bound)
        assert [a for a, _ in runs] == [0, *(b for _, b in runs[:-1])] and runs[-1][1] == len(entries)
        for a, b in runs:
            if b - a == 1:
                continue
            n, most_p, most_r = b - a, max(pages[a:b]), max(rows[a:b])
            assert 2 * n * most_p * 16 * 192 <= bound // 2
            real = sum(p * 16 * (r * 9 + 192) for p, r in zip(pages[a:b], rows[a:b]))
            assert n * most_p * 16 * (most_r * 9 + 192) <= PADDING * real
