"""The csrc CPU kernel of slab partial attention against the float64 reference: shapes,
GQA, dtypes (float32, bfloat16, float16 K/V), empty and partial slots, large logits, every
instruction set this CPU has and every path (vector, panel, tile), and its refusals."""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenlake.kernels import native
from tokenlake.kernels.attention import partial_attention_ref


def _slab(slots, layers, kv_heads, capacity, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, layers, 2, kv_heads, capacity, head_dim, generator=g).to(dtype)


def _reference(q, slab, layer, slots, tokens, scale):
    """Float64 attention over the concatenated valid tokens of the slots."""
    ks = [slab[s, layer, 0, :, :n].transpose(0, 1) for s, n in zip(slots, tokens)]
    vs = [slab[s, layer, 1, :, :n].transpose(0, 1) for s, n in zip(slots, tokens)]
    k, v = torch.cat(ks).double(), torch.cat(vs).double()  # [tokens, kv_heads, E]
    return partial_attention_ref(q.double(), k, v, scale=scale)


TOL = {torch.float32: 4e-6, torch.bfloat16: 4e-6, torch.float16: 4e-6}  # the exp polynomial alone once cost 5e-6


@pytest.mark.parametrize("dtype", native.DTYPES)
@pytest.mark.parametrize("rows,q_heads,kv_heads,head_dim", [
    (1, 9, 3, 64),     # SmolLM2's GQA, one decode row
    (8, 32, 8, 128),   # Llama-3-8B shape, eight rows
    (3, 4, 4, 32),     # no GQA, odd rows
    (7, 8, 8, 128),    # no GQA, 7 rows: the vector path's row groups of 4, 2 and 1
    (7, 9, 3, 64),     # 21 grouped rows per kv head: five row groups of 4, then 1
    (5, 16, 2, 128),   # 40 grouped rows: three row tiles of the tile path, the last part padding
    (2, 8, 1, 64),     # 16 grouped rows: the fewest the tile path takes, one full row tile
    (100, 9, 3, 64),   # 300 grouped rows: a prefill chunk's query, 19 row tiles
])
def test_kernel_equals_the_reference(kernel, isas, paths, dtype, rows, q_heads, kv_heads, head_dim):
    capacity = 80  # not a multiple of the kernel's blocks: partial blocks at every slot end
    slab = _slab(6, 2, kv_heads, capacity, head_dim, dtype)
    q = torch.randn(rows, q_heads, head_dim, generator=torch.Generator().manual_seed(1))
    slots, tokens = [4, 0, 2, 5], [80, 17, 0, 33]  # full, partial, empty, partial
    scale = head_dim ** -0.5
    want = _reference(q, slab, 1, slots, tokens, scale)
    for isa, panel_rows in itertools.product(isas, paths):
        kernel.set_isa(isa)
        kernel.set_panel_rows(panel_rows)
        got = native.slab_attention(q, slab, 1, slots, tokens, scale)
        assert got.o.dtype == torch.float32 and got.o.shape == (rows, q_heads, head_dim)
        assert got.lse.shape == (rows, q_heads)
        torch.testing.assert_close(got.o.double(), want.o, rtol=TOL[dtype], atol=TOL[dtype])
        torch.testing.assert_close(got.lse.double(), want.lse, rtol=1e-6, atol=4e-6)


@pytest.mark.parametrize("dtype", native.DTYPES)
@pytest.mark.parametrize("head_dim", [128, 64, 32])  # the vector path (two widths) and the scalar one
@pytest.mark.parametrize("rows", [2, 16])  # 4 grouped rows per kv head, 32 (eight row groups)
def test_what_lies_past_a_slots_valid_tokens_is_never_read(kernel, isas, paths, dtype, head_dim, rows):
    """A slot's rows past its valid tokens hold whatever an earlier segment or an
    uninitialised page left there: NaN and infinities there must not reach the result
    (the vector path reads whole 16-token blocks, so a partial block is copied and
    padded first)."""
    capacity = 48
    slab = _slab(3, 1, 2, capacity, head_dim, dtype, seed=7)
    slots, tokens = [2, 0], [37, 5]
    for s, n in zip(slots, tokens):
        slab[s, :, :, :, n::2] = float("nan")
        slab[s, :, :, :, n + 1::2] = float("inf")
    q = torch.randn(rows, 4, head_dim, generator=torch.Generator().manual_seed(8))
    want = _reference(q, slab, 0, slots, tokens, head_dim ** -0.5)
    for isa, panel_rows in itertools.product(isas, paths):
        kernel.set_isa(isa)
        kernel.set_panel_rows(panel_rows)
        got = native.slab_attention(q, slab, 0, slots, tokens, head_dim ** -0.5)
        assert torch.isfinite(got.o).all() and torch.isfinite(got.lse).all(), (isa, panel_rows)
        torch.testing.assert_close(got.o.double(), want.o, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 12])  # 4 grouped rows per kv head, 24 (six row groups)
def test_many_slots_split_over_threads_and_large_logits(kernel, isas, paths, rows, dtype):
    """64 slots (tasks split a kv head's slots, merged by LSE) and logits near 1e3:
    the online softmax neither overflows nor loses the small terms (the tile path raises
    its running max lazily: here it must, many times)."""
    slab = _slab(64, 1, 2, 64, 64, dtype, seed=3)
    q = 40 * torch.randn(rows, 4, 64, generator=torch.Generator().manual_seed(4))
    slots = list(range(63, -1, -1))
    tokens = [64 if s % 3 else 5 for s in slots]
    want = _reference(q, slab, 0, slots, tokens, 1.0)
    for isa, panel_rows in itertools.product(isas, paths):
        kernel.set_isa(isa)
        kernel.set_panel_rows(panel_rows)
        got = native.slab_attention(q, slab, 0, slots, tokens, 1.0)
        assert torch.isfinite(got.o).all() and got.lse.max() > 500
        torch.testing.assert_close(got.o.double(), want.o, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.lse.double(), want.lse, rtol=1e-6, atol=1e-3)


def test_the_tile_path_takes_many_bfloat16_rows(kernel, isas):
    """With tiles (``isa() == "amx"``), bfloat16 calls of 16 or more grouped rows and head
    dim 64 or 128 take the tile path; the rest, and every call on a lower instruction set,
    take the vector or the scalar path. The tests above run each on every path this CPU has."""
    if "amx" not in isas:
        pytest.skip("this CPU (or OS) gives no tiles")
    path = kernel.attention_path
    assert path("bfloat16", 32, 128) == "tile" and path("bfloat16", 16, 64) == "tile"
    assert path("bfloat16", 15, 128) == "vector"  # fewer rows than a tile pays for
    assert path("float32", 64, 128) == "panel" and path("float16", 32, 128) == "panel"
    assert path("bfloat16", 32, 96) == "scalar"
    kernel.set_isa("avx512")
    assert path("bfloat16", 32, 128) == "panel"
    with pytest.raises(RuntimeError, match="dtype"):
        path("int8", 32, 128)


def test_many_rows_take_the_panel_path(kernel, isas, paths):
    """Without tiles, calls of many grouped rows and head dim 64 or 128 take the panel
    path where it was measured faster than the vector path: from 6 rows with AVX2 and the
    baseline; with AVX-512 from 32 for 2-byte K/V (bfloat16 measured, float16 alike) and
    64 for float32. A forced threshold
    moves it for every dtype, 0 gives the instruction set's back, and a negative one is
    refused."""
    path = kernel.attention_path
    for isa in isas:
        kernel.set_isa(isa)
        wide = isa in ("avx512", "amx")
        for dtype in ("float32", "float16") + (() if isa == "amx" else ("bfloat16",)):
            fewest = (64 if dtype == "float32" else 32) if wide else 6
            assert kernel.panel_rows(dtype) == fewest
            assert path(dtype, fewest, 64) == "panel" and path(dtype, 300, 128) == "panel"
            assert path(dtype, fewest - 1, 128) == "vector"
            assert path(dtype, 300, 96) == "scalar"  # the vector width only
        kernel.set_panel_rows(1)
        assert path("float32", 1, 128) == "panel" and kernel.panel_rows() == 1
        assert kernel.panel_rows("bfloat16") == 1
        kernel.set_panel_rows(0)
        assert kernel.panel_rows() == (64 if wide else 6)
    with pytest.raises(RuntimeError, match="at least 1"):
        kernel.set_panel_rows(-1)


def test_no_tokens_gives_the_empty_partial(kernel):
    slab = _slab(2, 1, 1, 16, 8, torch.bfloat16)
    q = torch.randn(1, 2, 8)
    got = native.slab_attention(q, slab, 0, [0, 1], [0, 0], 1.0)
    assert torch.equal(got.o, torch.zeros(1, 2, 8)) and torch.isneginf(got.lse).all()
    got = native.slab_attention(q, slab, 0, [], [], 1.0)
    assert torch.isneginf(got.lse).all()


@pytest.mark.parametrize("rows", [1, 8, 100])  # one decode row, a batch, a chunk (panel or tile path)
@pytest.mark.parametrize("on", [True, False], ids=["kernel", "torch"])
def test_results_go_into_given_buffers_and_q_of_any_strides_is_read(kernel, rows, on):
    """A query engine hands its session's ``o``/``lse`` rows to the prepared call, which
    writes them in place (the kernel itself, or a copy on the torch path) and returns
    them; q may be a strided view (the kernel groups it by a loop that follows the
    strides). Both agree bit for bit with a call that allocates, and with the reference."""
    from tokenlake.kernels import slab as attention_slab

    slab = _slab(6, 2, 3, 48, 64, torch.bfloat16)
    slots, tokens = [1, 3, 4], [48, 20, 0]
    wide = torch.randn(rows, 9, 64, 2, generator=torch.Generator().manual_seed(rows))
    q = wide[..., 1]  # strided in every dimension: elements 2 floats apart, heads 128, rows 1,152
    assert q.stride() == (9 * 128, 128, 2)
    attention_slab.use_native(on)
    try:
        call = attention_slab.prepare_slabs_attention(rows, 9, [slab], [0] * 3, slots, tokens)
        alone = call(q.contiguous(), 1)
        out = (torch.full((rows, 9, 64), float("nan")), torch.full((rows, 9), float("nan")))
        got = call(q, 1, out)
    finally:
        attention_slab.use_native(True)
    assert got.o.data_ptr() == out[0].data_ptr() and got.lse.data_ptr() == out[1].data_ptr()
    assert torch.equal(out[0], alone.o) and torch.equal(out[1], alone.lse)
    want = _reference(q, slab, 1, slots, tokens, 0.125)
    torch.testing.assert_close(out[0].double(), want.o, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("o_shape,lse_shape,dtype,needle", [
    ((2, 9, 64), (1, 9), torch.float32, "must be"),  # more rows than q
    ((1, 9, 64), (1, 8), torch.float32, "must be"),  # lse of other heads
    ((1, 9, 64), (1, 9), torch.float64, "float32"),
])
def test_buffers_that_do_not_fit_the_call_are_refused(kernel, o_shape, lse_shape, dtype, needle):
    from tokenlake.kernels import slab as attention_slab

    slab = _slab(2, 1, 3, 16, 64, torch.float32)
    call = attention_slab.prepare_slabs_attention(1, 9, [slab], [0], [1], [16])
    out = (torch.zeros(o_shape, dtype=dtype), torch.zeros(lse_shape, dtype=dtype))
    with pytest.raises(ValueError, match=needle):
        call(torch.randn(1, 9, 64), 0, out)
    assert not out[0].any() and not out[1].any()  # refused before anything was written
    with pytest.raises(RuntimeError, match="both"):
        kernel.slab_attention(torch.randn(1, 9, 64), [slab], 0, torch.tensor([1]), torch.tensor([16]),
                              0.125, torch.tensor([0]), o=torch.zeros(1, 9, 64))
    if dtype == torch.float32:  # the torch path refuses a shape the same way (no broadcast)
        attention_slab.use_native(False)
        try:
            torch_call = attention_slab.prepare_slabs_attention(1, 9, [slab], [0], [1], [16])
            with pytest.raises(ValueError, match="must be"):
                torch_call(torch.randn(1, 9, 64), 0, out)
        finally:
            attention_slab.use_native(True)
        assert not out[0].any() and not out[1].any()


@pytest.mark.parametrize("slots,tokens,layer,needle", [
    ([2], [4], 0, "slot id"),
    ([0], [17], 0, "token count"),
    ([0], [-1], 0, "token count"),
    ([0], [4], 3, "layer"),
])
def test_calls_that_do_not_fit_are_refused(kernel, slots, tokens, layer, needle):
    slab = _slab(2, 1, 1, 16, 8, torch.float32)
    with pytest.raises(ValueError, match=needle):
        native.slab_attention(torch.randn(1, 2, 8), slab, layer, slots, tokens, 1.0)
    with pytest.raises(ValueError, match="heads"):
        native.slab_attention(torch.randn(1, 3, 8), _slab(2, 1, 2, 16, 8, torch.float32), 0, [0], [4], 1.0)


def test_an_instruction_set_above_the_cpus_is_refused(kernel):
    order = ["base", "avx2", "avx512", "amx"]
    have = order.index(kernel.isa())
    if have == len(order) - 1:
        pytest.skip("this CPU has every variant")
    with pytest.raises(RuntimeError, match="does not support"):
        kernel.set_isa(order[have + 1])
    assert kernel.isa() == order[have]


def test_bench_kernel_runs_as_a_cpu_without_tiles_would(kernel):
    """``--isa avx512`` on a CPU with AMX: 32 grouped rows take the panel path, not the
    tiles, and the CPU's own instruction set is back afterwards."""
    from tokenlake.tools.bench.kernel import bench_kernel

    best = kernel.isa()
    if best not in ("amx", "avx512"):
        pytest.skip("needs AVX-512")
    out = bench_kernel(tokens=(1024,), rows=(8,), dtypes=("bfloat16",), repeats=1, buffer_gib=0.05,
                       linear_rows=(1,), linear_layers=1, isa="avx512")
    assert out["isa"] == "avx512" and [r["path"] for r in out["results"]] == ["panel"]
    assert kernel.isa() == best


def test_bench_kernel_reports_the_fields_the_readme_quotes(kernel, capsys):
    """A tiny run of ``tokenlake bench kernel``: its JSON has the memory bandwidth, a row
    per (dtype, rows, tokens) with the kernel's and torch's GB/s, and a linear row per
    rows with the projection kernel's and BLAS's."""
    from tokenlake.tools.bench.kernel import bench_kernel

    out = bench_kernel(tokens=(1024,), rows=(1, 16), dtypes=("float32", "bfloat16"), repeats=1,
                       buffer_gib=0.05, linear_rows=(1, 3), linear_layers=1)
    assert out["memory_read_gbps"] > 0 and out["compute_gflops"] > 0 and out["isa"] == kernel.isa()
    assert [(r["dtype"], r["rows"], r["tokens"]) for r in out["results"]] == [
        ("float32", 1, 1024), ("float32", 16, 1024), ("bfloat16", 1, 1024), ("bfloat16", 16, 1024)]
    for r in out["results"]:
        assert r["kernel_gbps"] > 0 and r["torch_gbps"] > 0 and r["torch_slab_gbps"] > 0
        assert r["kernel_vs_torch"] == pytest.approx(r["kernel_gbps"] / r["torch_gbps"])
        per_byte = 2 * 4 * r["rows"] / (4 if r["dtype"] == "float32" else 2)  # 32 / 8 heads
        assert r["flops_per_byte"] == per_byte
        # rows=16 is 64 grouped rows: bfloat16 takes the tile path where the CPU has tiles,
        # whose roof is the bandwidth (the compute peak measured is the vector units'),
        # the rest the panel path
        assert r["path"] == kernel.attention_path(r["dtype"], 4 * r["rows"], 128)
        tiles = kernel.isa() == "amx" and r["dtype"] == "bfloat16"
        assert r["path"] == ("vector" if r["rows"] == 1 else "tile" if tiles else "panel")
        # a panel row also times the vector path on the same call, a vector row the panel path
        assert ("kernel_vs_vector" in r) == (r["path"] == "panel")
        assert ("panel_vs_kernel" in r) == (r["path"] == "vector")
        if r["path"] == "vector":
            assert r["panel_gbps"] > 0 and r["panel_vs_kernel"] == pytest.approx(r["panel_gbps"] / r["kernel_gbps"])
        if r["path"] == "panel":
            assert r["vector_gbps"] > 0 and r["kernel_vs_vector"] == pytest.approx(r["kernel_gbps"] / r["vector_gbps"])
        vector_roof = min(out["memory_read_gbps"], out["compute_gflops"] / per_byte)
        assert r["roof_gbps"] == pytest.approx(out["memory_read_gbps"] if r["path"] == "tile" else vector_roof)
        assert r["bound"] == ("memory" if r["roof_gbps"] == out["memory_read_gbps"] else "compute")
        # the stream loop does the attention's multiply-adds per 64-byte line (2 per
        # FLOP-byte), at most the 64 it takes
        assert r["stream_fmas_per_line"] == min(64, 2 * per_byte) and r["stream_gbps"] > 0
        assert r["kernel_vs_stream"] == pytest.approx(r["kernel_gbps"] / r["stream_gbps"])
    assert [r["rows"] for r in out["linear"]] == [1, 3]
    for r in out["linear"]:
        assert r["kernel_gbps"] > 0 and r["blas_gbps"] > 0 and r["weight_mb"] == pytest.approx(14.2, abs=0.1)
        assert r["kernel_vs_blas"] == pytest.approx(r["kernel_gbps"] / r["blas_gbps"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmas", [1, 4, 64])
def test_the_stream_loop_reads_every_line_once(kernel, isas, dtype, fmas):
    """``roof_stream`` (the bench's read-rate roof) reads each 64-byte line of the buffer
    once, as 16 floats, and multiplies it ``fmas`` times by c: its result is fmas x c x the
    buffer's sum as float32, on every instruction set; a line counted twice, or one left
    out, would move the sum by far more than rounding."""
    from tokenlake.kernels.native import roof_stream

    g = torch.Generator().manual_seed(fmas)
    # small integers, exact in float32 whatever the order of the sums; the buffer's bytes
    # read as float32 are what the loop sums, so a bfloat16 buffer is made from them
    as_float = torch.randint(-8, 9, (64 * 1024 + 48,), generator=g).float()
    buf = as_float.view(dtype)
    for isa in isas:
        kernel.set_isa(isa)
        assert roof_stream(buf, fmas, 0.5, module=kernel) == fmas * 0.5 * float(as_float.sum())


@pytest.mark.parametrize("buf, fmas, needle", [
    (torch.zeros(40), 4, "whole number of 64-byte lines"),
    (torch.zeros(32, 2)[:, 0], 4, "contiguous"),
    (torch.zeros(64), 3, "power of two"),
    (torch.zeros(64), 128, "power of two"),
])
def test_the_stream_loop_refuses_what_it_does_not_take(kernel, buf, fmas, needle):
    from tokenlake.kernels.native import roof_stream

    with pytest.raises(ValueError, match=needle):
        roof_stream(buf, fmas, module=kernel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_query_engines_few_row_path_runs_the_kernel(kernel, monkeypatch, dtype):
    """``slab_partial_attention`` (what a query engine calls) hands few-row calls to the
    kernel when it is built, many-row calls (prefill chunks) on its panel path up to
    PANEL_ELEMENTS and on its tile path (bfloat16 on AMX CPUs) up to TILE_ROWS, larger
    ones to torch; all give the reference's answer, and switching the kernel off gives
    torch's path."""
    from tokenlake.kernels import slab as attention_slab

    calls = []

    class Spy:
        def slab_attention(self, *args):
            calls.append(args[0].shape[0])
            return kernel.slab_attention(*args)

        def attention_path(self, *args):
            return kernel.attention_path(*args)

    monkeypatch.setattr(attention_slab, "_native_kernel", lambda: Spy() if attention_slab._native["on"] else None)
    slab = _slab(6, 2, 3, 64, 64, dtype)
    slots, tokens = [1, 3, 4], [64, 40, 0]
    # 64 rows x 3 heads per group: beyond SMALL_ROWS; 300 x 3 x 64: beyond PANEL_ELEMENTS
    assert 64 * 3 > attention_slab.SMALL_ROWS and 300 * 3 * 64 > attention_slab.PANEL_ELEMENTS
    for rows in (1, 8, 64, 300):
        q = torch.randn(rows, 9, 64, generator=torch.Generator().manual_seed(rows))
        want = _reference(q, slab, 1, slots, tokens, 0.125)
        got = attention_slab.slab_partial_attention(q, slab, 1, slots, tokens, 0.125)
        torch.testing.assert_close(got.o.double(), want.o, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got.lse.double(), want.lse, rtol=1e-6, atol=1e-5)
        attention_slab.use_native(False)
        try:
            off = attention_slab.slab_partial_attention(q, slab, 1, slots, tokens, 0.125)
        finally:
            attention_slab.use_native(True)
        torch.testing.assert_close(off.o.double(), want.o, rtol=2e-5, atol=2e-5)
    tiles = kernel.isa() == "amx" and dtype == torch.bfloat16
    assert calls == ([1, 8, 64, 300] if tiles else [1, 8, 64])


@pytest.mark.parametrize("head_dim", [64, 16])  # the vector path and the scalar one
def test_the_softmax_exp_is_accurate_to_float_rounding(kernel, isas, head_dim):
    """63 tokens whose scores sit 0.05 ln 2 below the first one's: every weight is
    2^-0.05, where a Taylor polynomial of 2^f (the kernel's first exp) is 4e-6 off; the
    LSE must be exact to float rounding."""
    import math

    slab = torch.zeros(1, 1, 2, 1, 64, head_dim)
    slab[0, 0, 0, 0, 1:, 0] = -0.05 * math.log(2)  # K: scores 0 and -0.05 ln 2 (q = e0, scale 1)
    slab[0, 0, 1, 0, 0, 0] = 1.0  # V: token 0 alone carries dim 0
    q = torch.zeros(1, 1, head_dim)
    q[0, 0, 0] = 1.0
    total = 1 + 63 * 2 ** -0.05
    for isa in isas:
        kernel.set_isa(isa)
        got = native.slab_attention(q, slab, 0, [0], [64], 1.0)
        assert abs(got.lse.item() - math.log(total)) < 5e-7, (isa, got.lse.item() - math.log(total))
        assert abs(got.o[0, 0, 0].item() - 1 / total) < 5e-7 / total


@pytest.mark.parametrize("dtype", native.DTYPES)
@pytest.mark.parametrize("on", [True, False], ids=["kernel", "torch"])
def test_slots_of_several_slabs_in_one_call_equal_the_reference(kernel, dtype, on):
    """A query engine's own slab and its co-located peers' (docs/data-plane.md
    "Co-located slabs"): slot i of slabs[sources[i]], one softmax over all of them, on the
    kernel and on the torch path (one call per slab, merged)."""
    from tokenlake.kernels.slab import slabs_partial_attention, use_native

    slabs = [_slab(5, 2, 3, 40, 64, dtype, seed=s) for s in range(3)]
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5))
    sources, slots, tokens = [2, 0, 2, 1, 0], [1, 1, 4, 0, 3], [40, 7, 0, 23, 40]
    scale = 64 ** -0.5
    ks = [slabs[k][s, 1, 0, :, :n].transpose(0, 1) for k, s, n in zip(sources, slots, tokens)]
    vs = [slabs[k][s, 1, 1, :, :n].transpose(0, 1) for k, s, n in zip(sources, slots, tokens)]
    ro, rlse = partial_attention_ref(q.double(), torch.cat(ks).double(), torch.cat(vs).double(), scale=scale)
    use_native(on)
    try:
        o, lse = slabs_partial_attention(q, slabs, 1, sources, slots, tokens, scale)
    finally:
        use_native(True)
    assert (o.double() - ro).abs().max() < 1e-5 and (lse.double() - rlse).abs().max() < 1e-5
    direct = native.slab_attention(q, slabs, 1, slots, tokens, scale, kernel, sources)
    assert (direct.o.double() - ro).abs().max() < 1e-5
    with pytest.raises(ValueError, match="slab index"):
        native.slab_attention(q, slabs, 1, slots, tokens, scale, kernel, [0, 0, 0, 3, 0])
    with pytest.raises(ValueError, match="one shape"):
        native.slab_attention(q, [slabs[0], _slab(6, 2, 3, 40, 64, dtype)], 1, [0], [4], scale, kernel, [1])
    with pytest.raises(ValueError, match="one shape"):
        slabs_partial_attention(q, [slabs[0], _slab(6, 2, 3, 40, 64, dtype)], 1, [0, 1], [0, 0], [4, 4], scale)


def test_several_slabs_on_two_threads_split_the_slots_right(kernel):
    """Work above the kernel's inline bound on two threads: tasks take runs of slots
    from different slabs (each with its own base), merged exactly."""
    slabs = [_slab(4, 1, 2, 256, 64, torch.float32, seed=10 + s) for s in range(3)]
    q = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(6))
    sources, slots, tokens = [1, 0, 2, 1, 0, 2], [3, 0, 1, 0, 2, 3], [256, 200, 256, 31, 256, 128]
    ks = [slabs[k][s, 0, 0, :, :n].transpose(0, 1) for k, s, n in zip(sources, slots, tokens)]
    vs = [slabs[k][s, 0, 1, :, :n].transpose(0, 1) for k, s, n in zip(sources, slots, tokens)]
    ro, rlse = partial_attention_ref(q.double(), torch.cat(ks).double(), torch.cat(vs).double(), scale=0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        o, lse = native.slab_attention(q, slabs, 0, slots, tokens, 0.125, kernel, sources)
    finally:
        torch.set_num_threads(threads)
    assert sum(tokens) * 4 * 8 > 16384  # above kParallelWork: the threaded path
    assert (o.double() - ro).abs().max() < 1e-5 and (lse.double() - rlse).abs().max() < 1e-5
    with pytest.raises(ValueError, match="sources"):
        native.slab_attention(q, slabs, 0, slots, tokens, 0.125, kernel)


def test_a_build_whose_fingerprint_differs_is_not_loaded(kernel, monkeypatch, tmp_path):
    """``load_prebuilt`` (what the engines and the model's projections use) imports the
    built module only when its stamp holds the current sources' fingerprint: a copy with
    new sources but old file times, or another torch, falls back to the torch path."""
    for name, value in (("_module", None), ("_prebuilt", None), ("_prebuilt_tried", False)):
        monkeypatch.setattr(native, name, value)
    stamp = tmp_path / "stamp"
    monkeypatch.setattr(native, "STAMP", stamp)
    stamp.write_text("0" * 64)
    assert native.load_prebuilt() is None
    assert native.load_prebuilt() is None  # the answer is kept
    monkeypatch.setattr(native, "_prebuilt_tried", False)
    stamp.write_text(native.fingerprint())
    assert native.load_prebuilt() is not None
    monkeypatch.setattr(native, "_prebuilt", None)
    monkeypatch.setattr(native, "_prebuilt_tried", False)
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, "-DOTHER"])
    assert native.load_prebuilt() is None, "other compiler flags: another build"
