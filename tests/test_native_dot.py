"""The csrc kernel's dot path (csrc/slab_dot.h): bfloat16 K/V with many grouped rows on CPUs
with AVX-512 BF16 dot products and no AMX tiles, when bfloat16 products are allowed
(``native.use_bf16_products``; a pool's ``bf16_products``). Its answers are checked against
a float64 reference of what it promises: q rounded to bfloat16 (one part) or split into
two bfloat16 parts, exact products of those, and probabilities rounded to bfloat16, whose
effect on the output is bounded by 2^-9 of each weight."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from dataplane_util import TINY, execute, token_kv

from tokenlake.core.errors import ConfigError
from tokenlake.core.plans import Batch, BatchRequest
from tokenlake.deploy.local import LocalCluster
from tokenlake.kernels import native
from tokenlake.kernels.attention import Partial, partial_attention_ref


@pytest.fixture
def dots(kernel, isas):
    """The kernel with the dot path available (``isa`` avx512: on a CPU with tiles, as on
    one without); bfloat16 products, the panel threshold and the instruction set are back
    to their defaults afterwards, also when the test fails."""
    if not kernel.has_bf16_dots() or "avx512" not in isas:
        pytest.skip("this CPU has no AVX-512 BF16 dot products")
    kernel.set_isa("avx512")
    yield kernel
    kernel.set_bf16_products(0)
    kernel.set_panel_rows(0)


def _slab(slots, kv_heads, capacity, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, 1, 2, kv_heads, capacity, head_dim, generator=g).to(torch.bfloat16)


def _q_parts(q, scale, parts):
    """q scaled and then as the dot path holds it: rounded to bfloat16 (nearest even), or
    that plus the rounded remainder."""
    qs = q * scale
    hi = qs.bfloat16().float()
    return hi if parts == 1 else hi + (qs - hi).bfloat16().float()


def _check(got, q, slab, slots, tokens, scale, parts):
    """The promise: with q as the dot path holds it, the output is within 2^-9 x (max |v|
    + |o|) of the float64 attention (each weight off by at most 2^-9 of itself, the
    weights renormalised), the log-sum-exp within log(1 + 2^-9)."""
    ks = [slab[s, 0, 0, :, :n].transpose(0, 1) for s, n in zip(slots, tokens)]
    vs = [slab[s, 0, 1, :, :n].transpose(0, 1) for s, n in zip(slots, tokens)]
    k, v = torch.cat(ks).double(), torch.cat(vs).double()
    want = partial_attention_ref(_q_parts(q, scale, parts).double(), k, v, scale=1.0)
    bound = 2 ** -9 * (v.abs().max() + want.o.abs().max()) + 1e-5
    assert (got.o.double() - want.o).abs().max() <= bound
    assert (got.lse.double() - want.lse).abs().max() <= 2 ** -9 + 1e-5
    return want


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("rows,q_heads,kv_heads,head_dim", [
    (2, 9, 3, 64),     # 6 grouped rows: the fewest the dot path takes, one pass of 16 lanes
    (8, 32, 8, 128),   # Llama-3-8B shape, eight decodes: 32 grouped rows, one pass of 2 x 16
    (7, 9, 3, 64),     # 21: a pass of 32 lanes, 11 of them padding
    (100, 9, 3, 64),   # 300: a prefill chunk's query, ten passes (the first prefetches)
])
def test_the_dot_path_keeps_its_promise(dots, parts, rows, q_heads, kv_heads, head_dim):
    capacity = 80  # blocks of 32 tokens: a partial one at every slot end
    slab = _slab(6, kv_heads, capacity, head_dim)
    q = torch.randn(rows, q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    slots, tokens = [4, 0, 2, 5, 1], [80, 17, 0, 33, 1]  # full, odd partials, empty, a lone token
    scale = head_dim ** -0.5
    dots.set_bf16_products(parts)
    assert native.attention_path(torch.bfloat16, rows * q_heads // kv_heads, head_dim) == "dot"
    got = native.slab_attention(q, slab, 0, slots, tokens, scale)
    want = _check(got, q, slab, slots, tokens, scale, parts)
    # and the rounding is what it says: not the exact paths' answer
    dots.set_bf16_products(0)
    exact = native.slab_attention(q, slab, 0, slots, tokens, scale)
    assert (got.o - exact.o).abs().max() > 1e-5
    assert (exact.o.double() - want.o).abs().max() > 1e-5 or parts == 2


def test_two_parts_of_q_are_closer_than_one(dots):
    """Two parts of q carry 16 significant bits: the scores, so the log-sum-exp, move less
    than with q rounded once (both against the float64 attention with q as given)."""
    slab = _slab(8, 8, 512, 128, seed=5)
    q = 4 * torch.randn(8, 32, 128, generator=torch.Generator().manual_seed(6))
    slots, tokens = list(range(8)), [512] * 8
    ks = slab[:, 0, 0].transpose(0, 1).reshape(8, -1, 128).transpose(0, 1).double()
    vs = slab[:, 0, 1].transpose(0, 1).reshape(8, -1, 128).transpose(0, 1).double()
    want = partial_attention_ref(q.double(), ks, vs, scale=128 ** -0.5)
    err = {}
    for parts in (1, 2):
        dots.set_bf16_products(parts)
        got = native.slab_attention(q, slab, 0, slots, tokens, 128 ** -0.5)
        err[parts] = (got.lse.double() - want.lse).abs().max().item()
    assert err[2] < err[1] / 4, err


@pytest.mark.parametrize("rows", [2, 16])  # 8 and 64 grouped rows
def test_the_dot_path_never_reads_past_a_slots_valid_tokens(dots, rows):
    slab = _slab(3, 2, 48, 128, seed=7)
    slots, tokens = [2, 0], [37, 5]
    for s, n in zip(slots, tokens):
        slab[s, :, :, :, n::2] = float("nan")
        slab[s, :, :, :, n + 1::2] = float("inf")
    q = torch.randn(rows, 8, 128, generator=torch.Generator().manual_seed(8))
    dots.set_bf16_products(1)
    got = native.slab_attention(q, slab, 0, slots, tokens, 128 ** -0.5)
    assert torch.isfinite(got.o).all() and torch.isfinite(got.lse).all()
    _check(got, q, slab, slots, tokens, 128 ** -0.5, 1)


def test_many_slots_over_threads_and_large_logits(dots):
    """64 slots split over tasks (merged by LSE) and logits near 1e3."""
    slab = _slab(64, 2, 64, 64, seed=3)
    q = 40 * torch.randn(12, 4, 64, generator=torch.Generator().manual_seed(4))
    slots = list(range(63, -1, -1))
    tokens = [64 if s % 3 else 5 for s in slots]
    dots.set_bf16_products(1)
    got = native.slab_attention(q, slab, 0, slots, tokens, 1.0)
    want = _check(got, q, slab, slots, tokens, 1.0, 1)
    assert want.lse.max() > 500


def test_the_dot_path_is_taken_only_where_allowed(dots, isas):
    path = native.attention_path
    bf16 = torch.bfloat16
    assert dots.bf16_products() == 0 and path(bf16, 32, 128) == "panel"  # exact by default
    dots.set_bf16_products(1)
    assert path(bf16, 6, 64) == "dot" and path(bf16, 2048, 128) == "dot"
    assert path(bf16, 5, 128) == "vector" and path(bf16, 32, 96) == "scalar"
    assert path(torch.float32, 64, 128) == "panel" and path(torch.float16, 32, 128) == "panel"
    dots.set_panel_rows(1)  # the forced threshold moves the dot path's too
    assert path(bf16, 1, 128) == "dot"
    dots.set_panel_rows(0)
    dots.set_isa("avx2")
    assert path(bf16, 32, 128) == "panel"
    if "amx" in isas:
        dots.set_isa("amx")
        assert path(bf16, 16, 128) == "tile"  # the tiles keep exact products
    with pytest.raises(RuntimeError, match="1 or 2 parts"):
        dots.set_bf16_products(3)
    with pytest.raises(ValueError, match="1 or 2 parts"):
        native.use_bf16_products(-1, module=dots)


def test_the_pool_sends_dot_path_calls_to_the_kernel(dots):
    """The query engines' slab attention gives a dot-path call of up to PANEL_ELEMENTS to
    the kernel (as a panel-path call), beyond it to torch."""
    from tokenlake.kernels import slab as slab_mod

    slab = _slab(2, 3, 64, 64)
    dots.set_bf16_products(1)
    assert slab_mod._kernel_for(slab, 300, True) is not None  # 300 x 64 <= PANEL_ELEMENTS
    assert slab_mod._kernel_for(slab, 2000, True) is None


def test_without_the_dot_path_the_setting_changes_nothing(kernel, isas):
    """On every instruction set this CPU runs without the dot path (and on CPUs without
    AVX-512 BF16, every one), allowing bfloat16 products leaves the path and the answer
    exactly as they were."""
    slab = _slab(3, 2, 80, 64, seed=9)
    q = torch.randn(8, 8, 64, generator=torch.Generator().manual_seed(10))
    slots, tokens = [0, 2], [80, 41]
    try:
        for isa in isas:
            kernel.set_isa(isa)
            kernel.set_bf16_products(0)
            path = native.attention_path(torch.bfloat16, 32, 64)
            exact = native.slab_attention(q, slab, 0, slots, tokens, 0.125)
            kernel.set_bf16_products(1)
            if native.attention_path(torch.bfloat16, 32, 64) == "dot":
                continue  # the dot path serves here: the tests above
            assert native.attention_path(torch.bfloat16, 32, 64) == path
            got = native.slab_attention(q, slab, 0, slots, tokens, 0.125)
            assert torch.equal(got.o, exact.o) and torch.equal(got.lse, exact.lse)
    finally:
        kernel.set_bf16_products(0)


def test_an_engine_spec_sets_its_process(kernel):
    """What a query engine runs at start-up: its torch threads and bfloat16 products."""
    from tokenlake.engines.spec import EngineSpec

    threads = torch.get_num_threads()
    try:
        EngineSpec("query", 0, "c", {"slab": {}}, torch_threads=1, bf16_products=2).apply_to_process()
        assert kernel.bf16_products() == 2 and torch.get_num_threads() == 1
    finally:
        kernel.set_bf16_products(0)
        torch.set_num_threads(threads)


def test_the_setting_is_checked_and_reaches_the_query_engines_only():
    from tokenlake.deploy.config import ClusterConfig, engine_fields
    from tokenlake.engines.spec import EngineSpec

    with pytest.raises(ConfigError, match="bf16_products"):
        ClusterConfig(1, TINY, 1 << 20, segment_tokens=16, bf16_products=3)
    with pytest.raises(ConfigError, match="bf16_products"):
        EngineSpec("query", 0, "c", {"slab": {}}, bf16_products=-1)
    config = ClusterConfig(1, TINY, 1 << 20, segment_tokens=16, kv_dtype="bfloat16", bf16_products=2)
    assert engine_fields(config, "query", 0) == {"bf16_products": 2}
    assert engine_fields(config, "transfer", 0) == {}


def test_bench_kernel_compares_the_dot_path_with_exact_products(dots):
    """A tiny ``tokenlake bench kernel``: without bfloat16 products a bfloat16 row the dot
    path would take also times it (``dot_gbps``); with them, the row is on the dot path
    and times exact products beside it, with the difference of their answers."""
    from tokenlake.tools.bench.kernel import bench_kernel

    kw = dict(tokens=(1024,), rows=(2,), dtypes=("bfloat16",), repeats=1, buffer_gib=0.05,
              linear_rows=(1,), linear_layers=1, isa="avx512")
    off = bench_kernel(**kw)
    assert off["bf16_dots"] and off["bf16_products"] == 0
    (row,) = off["results"]
    assert row["path"] == "vector" and row["dot_gbps"] > 0 and "exact_gbps" not in row
    on = bench_kernel(**kw, bf16_products=1)
    (row,) = on["results"]
    assert on["bf16_products"] == 1 and row["path"] == "dot" and row["exact_path"] == "vector"
    assert row["exact_gbps"] > 0 and row["kernel_vs_exact"] > 0 and row["products_parts"] == 1
    assert 1e-6 < row["products_error"] < 2e-2 and row["products_lse_error"] > 0
    assert dots.bf16_products() == 0  # the process's setting is back


@pytest.mark.parametrize("parts", [0, 1, 2])
def test_a_pools_query_engines_take_bfloat16_products_from_its_config(dots, isas, parts):
    """A bfloat16 pool of two instances whose config allows bfloat16 products (this
    process's kernel does not): its query engines, processes of their own, attend a
    cached document for two requests in one batch, 8 new rows each (64 grouped rows per
    kv head, so the dot path), within the dot path's bound and not as exact products
    would; without it, as exact products."""
    if isas[-1] == "amx":
        pytest.skip("the engines (processes of their own) take the tile path, exact, on this CPU")
    model = replace(TINY, name="tiny-dot", num_q_heads=8, num_kv_heads=2, head_dim=64)
    c = 16
    rng = random.Random(5)
    doc = [rng.randrange(3, 900) for _ in range(6 * c)]
    tokens = {"doc": doc + [5], "c0": doc + [rng.randrange(3, 900) for _ in range(8)],
              "c1": doc + [rng.randrange(3, 900) for _ in range(8)]}
    with LocalCluster(2, model, 1 << 20, segment_tokens=c, max_rows=128, kv_dtype="bfloat16",
                      bf16_products=parts) as cluster:
        cp = cluster.control
        first = cp.gen_plans([Batch((BatchRequest("doc", tuple(tokens["doc"]), ()),))], [1])
        execute(cluster, first, tokens, {"doc": len(tokens["doc"])}, model=model)
        cp.complete(first)
        reqs = tuple(BatchRequest(rid, tuple(tokens[rid][len(doc):]), tuple(doc)) for rid in ("c0", "c1"))
        plans = cp.gen_plans([Batch(reqs)], [1])
        results = execute(cluster, plans, tokens, {"c0": 8, "c1": 8}, model=model)
        cp.complete(plans)
    assert dots.bf16_products() == 0  # this process's own setting is untouched
    checked = 0
    for (rid, _pos, layer), (q, o, lse, span) in results.items():
        if not span.prefix_tokens:
            continue
        kv = token_kv(tokens[rid][: span.prefix_tokens], 0, layer, model).to(torch.bfloat16)
        slab = kv.permute(1, 2, 0, 3).unsqueeze(0).unsqueeze(0)  # one slot [1, 1, 2, kv_heads, n, E]
        n = span.prefix_tokens
        if parts:
            _check(Partial(o, lse), q, slab, [0], [n], 64 ** -0.5, parts)
        exact = partial_attention_ref(q.double(), kv[:, 0].double(), kv[:, 1].double(), scale=64 ** -0.5)
        err = (o.double() - exact.o).abs().max().item()
        assert err > 3e-5 if parts else err < 1e-5, (parts, err)  # the probabilities were rounded
        checked += q.shape[0]
    assert checked == 2 * 8 * model.num_layers
