"""Partial attention and its exact log-sum-exp merge (tokenlake.kernels.attention and its
CPU, slab and device-backend modules, docs/design.md §4)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenlake.kernels import attention as A
from tokenlake.kernels import backends as BACKENDS
from tokenlake.kernels import cpu as CPU
from tokenlake.kernels import slab as SLAB

HEADS = [(9, 3), (32, 32), (32, 8)]  # (q_heads, kv_heads)
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


def _qkv(rows, tokens, q_heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, q_heads, head_dim, generator=g, dtype=dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g, dtype=dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g, dtype=dtype)
    return q, k, v


def assert_partial_close(got, want, atol):
    """o within atol; lse within atol where finite, -inf exactly where want is -inf."""
    (o, lse), (o_ref, lse_ref) = got, want
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.double(), o_ref.double(), atol=atol, rtol=0)
    empty = torch.isneginf(lse_ref)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse.double()[~empty], lse_ref.double()[~empty], atol=atol, rtol=0)


# ---------------------------------------------------------------------------- fast path


@SETTINGS
@given(heads=st.sampled_from(HEADS), head_dim=st.sampled_from([64, 128]),
       rows=st.integers(1, 70), tokens=st.integers(0, 300), causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fast_path_matches_float64_reference(heads, head_dim, rows, tokens, causal, seed):
    q, k, v = _qkv(rows, tokens, *heads, head_dim, seed=seed)
    got = CPU.partial_attention(q, k, v, causal=causal)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_partial_close(got, A.partial_attention_ref(q, k, v, causal=causal), atol=1e-5)


@pytest.mark.parametrize("rows,tokens", [(0, 5), (4, 0), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_rows_or_tokens(rows, tokens, causal):
    q, k, v = _qkv(rows, tokens, 9, 3, 16)
    o, lse = CPU.partial_attention(q, k, v, causal=causal)
    assert o.shape == (rows, 9, 16) and lse.shape == (rows, 9)
    assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    assert_partial_close((o, lse), A.partial_attention_ref(q, k, v, causal=causal), atol=0)


def test_every_entry_point_returns_a_named_partial():
    """One ``Partial`` type (fields ``o``, ``lse``) from every function, still a pair."""
    q, k, v = _qkv(3, 20, 9, 3, 16)
    slab = _slab(2, 1, 3, 16, 16)
    got = [A.partial_attention_ref(q, k, v), CPU.partial_attention(q, k, v, causal=True),
           CPU.partial_attention(q, k, v), CPU.single_token_attention(q, k[:3], v[:3]),
           A.empty_partial(3, 9, 16), SLAB.slab_partial_attention(q, slab, 0, [0, 1], [16, 4])]
    got.append(A.merge(*got[1], *got[2]))
    got.append(A.merge_many(torch.stack([got[1].o, got[2].o]), torch.stack([got[1].lse, got[2].lse])))
    for part in got:
        assert isinstance(part, A.Partial)
        o, lse = part
        assert o is part.o and lse is part.lse
        assert o.shape == (3, 9, 16) and lse.shape == (3, 9)


def test_causal_rows_beyond_tokens_see_nothing():
    q, k, v = _qkv(7, 3, 32, 8, 64)
    o, lse = CPU.partial_attention(q, k, v, causal=True)
    assert torch.all(torch.isneginf(lse[:4])) and torch.all(o[:4] == 0)
    assert torch.isfinite(lse[4:]).all()


def test_explicit_scale_and_float64_inputs():
    q, k, v = _qkv(5, 40, 32, 8, 64, dtype=torch.float64)
    got = CPU.partial_attention(q, k, v, scale=0.3, causal=True)
    assert got[0].dtype == torch.float32
    assert_partial_close(got, A.partial_attention_ref(q, k, v, scale=0.3, causal=True), atol=1e-5)


def test_bfloat16_kv_is_close():
    q, k, v = _qkv(6, 50, 32, 8, 64)
    got = CPU.partial_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    want = A.partial_attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert got[0].dtype == torch.float32
    assert_partial_close(got, want, atol=2e-2)


@pytest.mark.parametrize("broken", ["missing", "raises"])
def test_matmul_fallback_matches_reference(monkeypatch, broken):
    calls = {"kernel": 0, "matmul": 0}
    matmul = CPU._attend_matmul

    def raising(*args, **kwargs):
        calls["kernel"] += 1
        raise RuntimeError("unsupported")

    def counting_matmul(*args, **kwargs):
        calls["matmul"] += 1
        return matmul(*args, **kwargs)

    monkeypatch.setattr(CPU, "_FLASH_CPU", None if broken == "missing" else raising)
    monkeypatch.setattr(CPU, "_attend_matmul", counting_matmul)
    for causal in (False, True):
        # Big enough for the kernel (more than TINY_SCORES scores per head, also in the
        # causal diagonal block), so the fallback is what computes it.
        q, k, v = _qkv(70, 100, 9, 3, 64)
        assert 70 * 70 > CPU.TINY_SCORES
        got = CPU.partial_attention(q, k, v, causal=causal)
        assert_partial_close(got, A.partial_attention_ref(q, k, v, causal=causal), atol=1e-5)
    assert calls["matmul"] == 3  # non-causal: one call; causal: prefix and diagonal
    assert calls["kernel"] == (0 if broken == "missing" else 3)


@pytest.mark.skipif(CPU._FLASH_CPU is None, reason="torch has no CPU flash-attention op")
def test_torch_cpu_flash_op_facts():
    """What the fast path relies on: natural-log LSE, native h // group GQA, top-left causal."""
    q, k, v = _qkv(5, 7, 6, 2, 16)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    o, lse = CPU._FLASH_CPU(qh, kh, vh, scale=0.25)
    assert o.shape == (1, 6, 5, 16) and lse.shape == (1, 6, 5) and lse.dtype == torch.float32
    want = A.partial_attention_ref(q, k, v, scale=0.25)
    torch.testing.assert_close(lse[0].T.double(), want[1], atol=1e-5, rtol=0)
    _, lse_c = CPU._FLASH_CPU(qh, kh, vh, is_causal=True, scale=0.25)
    top_left = A.partial_attention_ref(q, k[:5], v[:5], scale=0.25, causal=True)  # sees 0..r
    torch.testing.assert_close(lse_c[0].T.double(), top_left[1], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- merge


def _fold(parts):
    o, lse = parts[0]
    for part in parts[1:]:
        o, lse = A.merge(o, lse, *part)
    return o, lse


@SETTINGS
@given(heads=st.sampled_from(HEADS), rows=st.integers(1, 20), tokens=st.integers(0, 200),
       cuts=st.lists(st.integers(0, 200), min_size=0, max_size=5), causal=st.booleans(),
       seed=st.integers(0, 2**16))
def test_merge_of_pieces_equals_monolithic(heads, rows, tokens, cuts, causal, seed):
    """Splitting K/V into 1..6 pieces (some possibly empty) and merging is exact. Causal:
    the cuts lie in the prefix every row sees; the last piece carries the causal block."""
    q, k, v = _qkv(rows, tokens, *heads, 64, dtype=torch.float64, seed=seed)
    seen_by_all = max(tokens - rows, 0) if causal else tokens
    bounds = [0, *sorted(min(c, seen_by_all) for c in cuts), tokens]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    whole = A.partial_attention_ref(q, k, v, causal=causal)
    for fn, atol in ((A.partial_attention_ref, 1e-12), (CPU.partial_attention, 1e-5)):
        parts = [fn(q, k[a:b], v[a:b], causal=causal and i == len(pieces) - 1)
                 for i, (a, b) in enumerate(pieces)]
        assert_partial_close(_fold(parts), whole, atol)
        stacked = A.merge_many(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        assert_partial_close(stacked, whole, atol)


def test_merge_with_empty_partial_is_identity_and_merge_commutes():
    q, k, v = _qkv(4, 30, 9, 3, 64)
    a = CPU.partial_attention(q, k[:10], v[:10])
    b = CPU.partial_attention(q, k[10:], v[10:])
    e = A.empty_partial(4, 9, 64)
    for got in (A.merge(*a, *e), A.merge(*e, *a),
                A.merge_many(torch.stack([e[0], a[0]]), torch.stack([e[1], a[1]]))):
        torch.testing.assert_close(got, a, atol=1e-7, rtol=1e-6)
    ab, ba = A.merge(*a, *b), A.merge(*b, *a)
    assert torch.equal(ab[0], ba[0]) and torch.equal(ab[1], ba[1])


def test_merge_of_two_empty_partials_is_empty_without_nan():
    e = A.empty_partial(3, 4, 8)
    for o, lse in (A.merge(*e, *e), A.merge_many(torch.stack([e[0]] * 3), torch.stack([e[1]] * 3))):
        assert torch.all(o == 0) and torch.all(torch.isneginf(lse))
    # mixed: -inf on one side in some elements only
    o_a, lse_a = torch.ones(2, 1, 2), torch.tensor([[float("-inf")], [0.0]])
    o_b, lse_b = 2 * torch.ones(2, 1, 2), torch.tensor([[1.0], [float("-inf")]])
    o, lse = A.merge(o_a, lse_a, o_b, lse_b)
    assert torch.equal(o, torch.tensor([[[2.0, 2.0]], [[1.0, 1.0]]]))
    assert torch.equal(lse, torch.tensor([[1.0], [0.0]]))


def test_merge_many_needs_at_least_one_partial():
    with pytest.raises(ValueError):
        A.merge_many(torch.zeros(0, 2, 3, 4), torch.zeros(0, 2, 3))
    with pytest.raises(ValueError):
        A.merge_many(torch.zeros(2, 2, 3, 4), torch.zeros(2, 3, 3))


def test_merge_is_stable_for_large_lse():
    o = torch.randn(2, 3, 1, 4, dtype=torch.float64)
    lse = torch.tensor([1000.0, 1000.0 + math.log(3.0)], dtype=torch.float64).view(2, 1, 1).expand(2, 3, 1)
    got_o, got_lse = A.merge_many(o, lse)
    torch.testing.assert_close(got_o, 0.25 * o[0] + 0.75 * o[1], atol=1e-12, rtol=0)
    torch.testing.assert_close(got_lse, torch.full((3, 1), 1000.0 + math.log(4.0), dtype=torch.float64))


def test_base2_natural_round_trip():
    lse = torch.tensor([-3.5, 0.0, 2.25, 80.0, float("-inf")], dtype=torch.float64)
    torch.testing.assert_close(A.lse_base2_to_natural(A.lse_natural_to_base2(lse)), lse)
    torch.testing.assert_close(A.lse_natural_to_base2(torch.tensor([math.log(8.0)])), torch.tensor([3.0]))
    s = torch.randn(10, dtype=torch.float64)
    torch.testing.assert_close(A.lse_base2_to_natural(torch.log2(torch.exp(s).sum())), torch.logsumexp(s, 0))


# ---------------------------------------------------------------------------- slab


def _slab(num_slots, layers, kv_heads, capacity, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, layers, 2, kv_heads, capacity, head_dim, generator=g)


def _slab_kv(slab, layer, slots, tokens):
    """The concatenated valid K/V, ``[total, kv_heads, E]`` each (reference only)."""
    k = torch.cat([slab[s, layer, 0, :, :n].transpose(0, 1) for s, n in zip(slots, tokens)])
    v = torch.cat([slab[s, layer, 1, :, :n].transpose(0, 1) for s, n in zip(slots, tokens)])
    return k, v


@SETTINGS
@given(heads=st.sampled_from(HEADS), rows=st.integers(1, 40), data=st.data())
def test_slab_matches_reference_over_concatenated_tokens(heads, rows, data):
    q_heads, kv_heads = heads
    slab = _slab(8, 3, kv_heads, 16, 64)
    slots = data.draw(st.permutations(range(8)))[: data.draw(st.integers(1, 8))]
    tokens = [16] * (len(slots) - 1) + [data.draw(st.integers(1, 16))]
    layer = data.draw(st.integers(0, 2))
    q = torch.randn(rows, q_heads, 64)
    k, v = _slab_kv(slab, layer, slots, tokens)
    got = SLAB.slab_partial_attention(q, slab, layer, slots, tokens)
    assert_partial_close(got, A.partial_attention_ref(q, k, v), atol=1e-5)
    assert_partial_close(SLAB._slab_gather(q, slab, layer, slots, tokens), A.partial_attention_ref(q, k, v), atol=1e-5)


def test_slab_edge_cases():
    slab = _slab(4, 2, 3, 8, 32)
    q = torch.randn(5, 9, 32)
    for slots, tokens in (([], []), ([2, 1], [0, 0])):
        o, lse = SLAB.slab_partial_attention(q, slab, 1, slots, tokens)
        assert o.shape == (5, 9, 32) and torch.all(o == 0) and torch.all(torch.isneginf(lse))
    k, v = _slab_kv(slab, 0, [3, 0], [5, 8])
    got = SLAB.slab_partial_attention(q, slab, 0, [3, 2, 0], [5, 0, 8], scale=0.2)
    assert_partial_close(got, A.partial_attention_ref(q, k, v, scale=0.2), atol=1e-5)
    with pytest.raises(ValueError):
        SLAB.slab_partial_attention(q, slab, 0, [0], [9])
    with pytest.raises(ValueError):
        SLAB.slab_partial_attention(q, slab, 2, [0], [1])
    with pytest.raises(ValueError):
        SLAB.slab_partial_attention(torch.randn(5, 8, 32), slab, 0, [0], [1])


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("new", [1, 7, 40])
def test_pool_prefix_merged_with_causal_self_attention_equals_full_causal(heads, new):
    """The compute engine's step: pool prefix partial (+) causal attention over the new tokens."""
    q_heads, kv_heads = heads
    slab = _slab(6, 2, kv_heads, 16, 64, seed=3)
    slots, tokens = [4, 0, 5, 2], [16, 16, 16, 9]
    prefix_k, prefix_v = _slab_kv(slab, 1, slots, tokens)
    q, new_k, new_v = _qkv(new, new, q_heads, kv_heads, 64, seed=new)
    prefix = SLAB.slab_partial_attention(q, slab, 1, slots, tokens)
    own = CPU.partial_attention(q, new_k, new_v, causal=True)
    full = A.partial_attention_ref(q, torch.cat([prefix_k, new_k]), torch.cat([prefix_v, new_v]), causal=True)
    assert_partial_close(A.merge(*prefix, *own), full, atol=1e-5)


# ---------------------------------------------------------------------------- backends


def test_backend_for():
    assert BACKENDS.backend_for("cpu") is CPU.partial_attention
    assert BACKENDS.backend_for(torch.device("cpu")) is CPU.partial_attention
    assert BACKENDS.backend_for("cuda:0") is BACKENDS.flashinfer_partial_attention
    with pytest.raises(ValueError):
        BACKENDS.backend_for("meta")


def test_flashinfer_path_refuses_cpu_tensors():
    q, k, v = _qkv(2, 3, 4, 2, 8)
    with pytest.raises(RuntimeError):
        BACKENDS.flashinfer_partial_attention(q, k, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_flashinfer_matches_reference(causal):
    pytest.importorskip("flashinfer")
    q, k, v = (x.cuda().bfloat16() for x in _qkv(33, 200, 32, 8, 128))
    got = BACKENDS.backend_for("cuda")(q, k, v, causal=causal)
    want = A.partial_attention_ref(q.cpu(), k.cpu(), v.cpu(), causal=causal)
    assert_partial_close((got[0].cpu(), got[1].cpu()), want, atol=2e-2)
    slab = torch.stack([k[:100], v[:100]]).transpose(1, 2)[None, None].contiguous()  # [1, 1, 2, 8, 100, 128]
    got = SLAB.slab_partial_attention(q, slab, 0, [0], [100])
    want = A.partial_attention_ref(q.cpu(), k[:100].cpu(), v[:100].cpu())
    assert_partial_close((got[0].cpu(), got[1].cpu()), want, atol=2e-2)


@pytest.mark.parametrize("q_heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_single_token_attention_equals_causal_attention_row_by_row(q_heads, kv_heads):
    g = torch.Generator().manual_seed(q_heads * 10 + kv_heads)
    n, e = 5, 16
    q, k, v = (torch.randn(n, h, e, generator=g) for h in (q_heads, kv_heads, kv_heads))
    o, lse = CPU.single_token_attention(q, k, v)
    for i in range(n):
        ro, rlse = A.partial_attention_ref(q[i : i + 1], k[i : i + 1], v[i : i + 1], causal=True)
        assert torch.allclose(o[i].double(), ro[0], atol=1e-6)
        assert torch.allclose(lse[i].double(), rlse[0], atol=1e-5)
    with pytest.raises(ValueError):
        CPU.single_token_attention(q, k[:-1], v[:-1])


@pytest.mark.parametrize("q_heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_merge_single_token_is_attention_over_the_prefix_and_the_new_token(q_heads, kv_heads):
    """Each row's prefix partial merged with its own new token equals attention over the
    prefix and that token (float64 reference); a row with an empty prefix gets its v."""
    g = torch.Generator().manual_seed(q_heads * 7 + kv_heads)
    n, e, prefix = 4, 16, 11
    q, k, v = (torch.randn(n, h, e, generator=g) * 2 for h in (q_heads, kv_heads, kv_heads))
    pk, pv = (torch.randn(n, prefix, kv_heads, e, generator=g) for _ in range(2))
    po = torch.empty(n, q_heads, e)
    plse = torch.empty(n, q_heads)
    for i in range(n):
        po[i], plse[i] = (x[0].float() for x in A.partial_attention_ref(q[i:i + 1], pk[i], pv[i]))
    po[3], plse[3] = 0.0, float("-inf")  # no prefix
    got = CPU.merge_single_token(po, plse, q, k, v)
    for i in range(n):
        keys = torch.cat([pk[i], k[i:i + 1]]) if i < 3 else k[i:i + 1]
        vals = torch.cat([pv[i], v[i:i + 1]]) if i < 3 else v[i:i + 1]
        want, _ = A.partial_attention_ref(q[i:i + 1], keys, vals)
        assert torch.allclose(got[i].double(), want[0], atol=1e-5)
    assert torch.equal(got[3], v[3].repeat_interleave(q_heads // kv_heads, dim=0))
    want = A.merge(po, plse, *CPU.single_token_attention(q, k, v)).o
    assert torch.allclose(got, want, atol=1e-6)
    half = CPU.merge_single_token(po, plse, q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert half.dtype == torch.float32
    with pytest.raises(ValueError):
        CPU.merge_single_token(po[:-1], plse[:-1], q, k, v)
