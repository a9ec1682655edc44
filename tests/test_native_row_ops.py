"""The csrc kernel's per-row operations of a decode layer (csrc/row_ops_cpu.cpp): RMSNorm,
RoPE of q and k, and the merge of the pool's prefix partial with each row's own new token.
Each against the float64 reference and against the torch operations it replaces (RoPE
bit for bit), on the row counts of a decode, a batch and a prefill chunk; the fallbacks
for what it does not take; and that the reference engine decodes the same with and
without it."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from tiny_model import tiny_weights

from tokenlake.kernels import native
from tokenlake.kernels.cpu import merge_single_token
from tokenlake.model.llama import model as llama
from tokenlake.model.llama.reference import ReferenceEngine

SHAPES = [(1, 9, 3, 64), (8, 32, 8, 128), (300, 9, 3, 64), (0, 4, 2, 16)]


@pytest.fixture
def torch_ops():
    """Runs a block with the kernel's row operations off; on again afterwards."""
    class Off:
        def __enter__(self):
            native.use_row_ops(False)

        def __exit__(self, *exc):
            native.use_row_ops(True)
    return Off()


def _rows(n, q_heads, kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, q_heads, head_dim, generator=g)
    k = torch.randn(n, kv_heads, head_dim, generator=g)
    v = torch.randn(n, kv_heads, head_dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("n,q_heads,kv_heads,head_dim", SHAPES)
def test_rms_norm_equals_the_reference(kernel, torch_ops, n, q_heads, kv_heads, head_dim):
    d = q_heads * head_dim
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, d, generator=g) * 3, torch.randn(d, generator=g)
    x[1::3] *= 1e-3  # rows whose mean square is near eps: a wrong or missing eps shows
    x[2::5] = 0.0  # and rows of zeros (eps alone)
    got = llama.rms_norm(x, w, 1e-5)
    assert native.row_ops(x, w) is kernel
    xd = x.double()
    want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
    with torch_ops:
        torch.testing.assert_close(got, llama.rms_norm(x, w, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("n,q_heads,kv_heads,head_dim", SHAPES)
def test_rope_equals_the_torch_operations_bit_for_bit(kernel, torch_ops, n, q_heads, kv_heads, head_dim):
    q, k, _ = _rows(n, q_heads, kv_heads, head_dim, seed=1)
    cos, sin = llama.rope_tables(SimpleNamespace(head_dim=head_dim, rope_base=10000.0), torch.arange(n) * 97 + 3)
    got_q, got_k = llama.rope_qk(q, k, cos, sin)
    with torch_ops:
        want_q, want_k = llama.rope_qk(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(got_q, q) or n == 0  # it rotated something
    # the rotation in float64: within float32 rounding of it
    half = head_dim // 2
    pairs = q.double().reshape(n, q_heads, half, 2)
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    rot = torch.stack((pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 0] * s + pairs[..., 1] * c), -1)
    torch.testing.assert_close(got_q.double(), rot.reshape(q.shape), rtol=1e-6, atol=1e-6)


def _merged_reference(o, lse, q, k, v, scale):
    """Attention over a prefix summarised by (o, lse) plus each row's own token, float64."""
    n, q_heads, head_dim = q.shape
    group = q_heads // k.shape[1]
    kd = k.double().repeat_interleave(group, dim=1)
    vd = v.double().repeat_interleave(group, dim=1)
    s = (q.double() * kd).sum(-1) * scale
    m = torch.maximum(lse.double(), s)
    wo, ws = (lse.double() - m).exp(), (s - m).exp()
    return (o.double() * wo.unsqueeze(-1) + vd * ws.unsqueeze(-1)) / (wo + ws).unsqueeze(-1)


@pytest.mark.parametrize("n,q_heads,kv_heads,head_dim", SHAPES)
def test_merge_own_token_equals_the_reference(kernel, torch_ops, n, q_heads, kv_heads, head_dim):
    q, k, v = _rows(n, q_heads, kv_heads, head_dim, seed=2)
    g = torch.Generator().manual_seed(3)
    o = torch.randn(n, q_heads, head_dim, generator=g)
    lse = torch.randn(n, q_heads, generator=g) * 4
    if n:
        lse[0, 0] = float("-inf")  # an empty prefix: the row's own v
        o[0, 0] = 0
        lse[-1, -1] = 80.0  # a prefix far above its own token: o unchanged
    assert native.row_ops(o, lse, q, k, v) is kernel
    got = merge_single_token(o, lse, q, k, v)
    assert got.dtype == torch.float32 and got.shape == q.shape
    want = _merged_reference(o, lse, q, k, v, head_dim ** -0.5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    if n:
        assert torch.equal(got[0, 0], v[0, 0])
        torch.testing.assert_close(got[-1, -1], o[-1, -1])
    with torch_ops:
        torch.testing.assert_close(got, merge_single_token(o, lse, q, k, v), rtol=1e-5, atol=1e-5)


def test_what_the_kernel_does_not_take_goes_to_torch(kernel):
    q, k, v = _rows(2, 4, 2, 16, seed=4)
    o, lse = torch.randn(2, 4, 16), torch.randn(2, 4)
    assert native.row_ops(o, lse, q, k, v) is kernel
    assert native.row_ops(o, lse, q.bfloat16(), k, v) is None  # not float32
    assert native.row_ops(o.transpose(0, 1)) is None  # not contiguous
    leaf = o.clone().requires_grad_()
    assert native.row_ops(leaf) is None  # autograd records
    with torch.no_grad():
        assert native.row_ops(leaf) is kernel
    native.use_row_ops(False)
    try:
        assert native.row_ops(o) is None
    finally:
        native.use_row_ops(True)
    half = merge_single_token(o, lse, q.bfloat16(), k.bfloat16(), v.bfloat16())  # the torch path
    torch.testing.assert_close(half, merge_single_token(o, lse, q.bfloat16().float(), k.bfloat16().float(),
                                                        v.bfloat16().float()), rtol=1e-5, atol=1e-5)
    x2, cos, sin = torch.randn(3, 8), torch.rand(1, 2), torch.rand(1, 2)
    for weight in (torch.tensor(2.0), torch.full((1,), 2.0), torch.full((1, 8), 2.0)):  # broadcast: torch's
        torch.testing.assert_close(llama.rms_norm(x2, weight, 1e-5), x2 * torch.rsqrt(x2.pow(2).mean(-1, True) + 1e-5) * 2)
    q3, k3 = torch.randn(3, 2, 4), torch.randn(3, 1, 4)  # cos / sin of one row for all: torch's
    got_q, got_k = llama.rope_qk(q3, k3, cos, sin)
    assert torch.equal(got_q, llama.apply_rope(q3, cos, sin)) and torch.equal(got_k, llama.apply_rope(k3, cos, sin))
    x = torch.randn(3, 2, 8)  # three dimensions: torch's RMSNorm
    torch.testing.assert_close(llama.rms_norm(x, torch.ones(8), 1e-5), x * torch.rsqrt(x.pow(2).mean(-1, True) + 1e-5))
    with pytest.raises(RuntimeError, match="do not fit"):
        kernel.merge_own_token(o, lse, q, k[:, :1].contiguous().expand(2, 3, 16).contiguous(), v, 1.0)
    with pytest.raises(RuntimeError, match="do not fit"):
        kernel.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="cos and sin"):
        kernel.rope_qk(q, k, torch.ones(2, 7), torch.ones(2, 7))


def test_the_reference_engine_decodes_the_same_with_and_without_them(kernel, torch_ops):
    weights = tiny_weights()
    prompt = list(range(5, 40))
    ref = ReferenceEngine(weights)
    logits, cache = ref.prefill(prompt)
    with torch_ops:
        logits_t, cache_t = ReferenceEngine(weights).prefill(prompt)
    torch.testing.assert_close(logits, logits_t, rtol=1e-5, atol=1e-5)
    tok = tok_t = int(logits.argmax())
    for _ in range(6):
        step = ref.decode_batch([cache], [tok])[0]
        with torch_ops:
            step_t = ReferenceEngine(weights).decode_batch([cache_t], [tok_t])[0]
        torch.testing.assert_close(step, step_t, rtol=1e-4, atol=1e-4)
        tok, tok_t = int(step.argmax()), int(step_t.argmax())
        assert tok == tok_t


def test_the_environment_can_turn_them_off(kernel):
    """``TOKENLAKE_ROW_OPS=0`` in a new process: the torch operations serve."""
    probe = "import torch; from tokenlake.kernels import native; print(native.row_ops(torch.ones(2)) is None)"
    for value, none in (("0", "True"), ("1", "False")):
        env = {**os.environ, native.ROW_OPS_ENV: value}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == none, out.stderr[-2000:]
