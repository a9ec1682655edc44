"""The CPU backend of partial attention: torch's flash-attention kernel (docs/design.md §4
"Attention backends").

:func:`partial_attention` has the contract of
:func:`tokenlake.kernels.attention.partial_attention_ref` and returns a float32
:class:`~tokenlake.kernels.attention.Partial`; :func:`single_token_attention` is a
decode step's self-attention for a whole batch, :func:`merge_single_token` the same
merged with the step's prefix partial in one pass. The grouped-layout helpers
(:func:`to_grouped`, :func:`from_grouped`, :func:`attend_grouped`) are shared with the
slab attention (:mod:`tokenlake.kernels.slab`).

What torch's CPU op ``aten::_scaled_dot_product_flash_attention_for_cpu`` does (torch
2.13, checked numerically, see tests): it takes ``[B, H, L, E]`` q and ``[B, Hk, S, E]``
k/v (non-contiguous views are fine) and returns ``o`` ``[B, H, L, E]`` in the input dtype
and ``logsumexp`` ``[B, H, L]`` in float32 (float64 for float64 input), **natural log**.
It supports ``H != Hk`` natively with the ``h // (H // Hk)`` mapping. ``is_causal`` is
aligned to the **top left** (row ``i`` sees keys ``0..i``), not the bottom right that
causal attention over the last ``rows`` tokens needs. ``L == 0`` or ``S == 0`` kills the
process with SIGFPE, and a fully masked row (additive ``-inf`` mask) yields ``o = 0`` with
``lse = 0`` instead of ``-inf``; both are guarded here, the op never sees them.
"""

from __future__ import annotations

import torch

from tokenlake.kernels import native
from tokenlake.kernels.attention import (
    HALF_TYPES,
    Partial,
    Tensor,
    check_qkv,
    empty_partial,
    merge,
    softmax_scale,
)

_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)

#: Up to this many (query row, key) pairs per head the plain matmul path beats the
#: flash kernel's fixed cost (~0.8 ms measured for a decode step's 1 x 1 self-attention
#: on this CPU, against ~0.05 ms with matmuls).
TINY_SCORES = 4096


# ---------------------------------------------------------------------------- layouts


def to_grouped(q: Tensor, kv_heads: int) -> Tensor:
    """``[rows, Hq, E]`` -> ``[Hk, rows*group, E]``: kv head j's query heads as extra rows.

    Copies q (small), never K/V. Row index in the result is ``r * group + g``.
    """
    rows, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    return q.reshape(rows, kv_heads, group, head_dim).transpose(0, 1).reshape(
        kv_heads, rows * group, head_dim)


def from_grouped(o_g: Tensor, lse_g: Tensor, rows: int) -> Partial:
    """Inverse of :func:`to_grouped` for a partial: ``[Hk, rows*group, E]``, ``[Hk, rows*group]``
    -> ``[rows, Hq, E]`` float32, ``[rows, Hq]`` float32 (both contiguous)."""
    kv_heads, _, head_dim = o_g.shape
    o = o_g.reshape(kv_heads, rows, -1, head_dim).transpose(0, 1).reshape(rows, -1, head_dim)
    lse = lse_g.reshape(kv_heads, rows, -1).transpose(0, 1).reshape(rows, -1)
    return Partial(o.float().contiguous(), lse.float().contiguous())


def _kernel_dtype(k: Tensor) -> torch.dtype:
    """float16/bfloat16 K/V go to the kernel as they are (it accumulates in float32);
    anything else is computed in float32."""
    return k.dtype if k.dtype in HALF_TYPES else torch.float32


# ---------------------------------------------------------------------------- kernel calls


def _attend_matmul(qh: Tensor, kh: Tensor, vh: Tensor, scale: float,
                   causal_tl: bool) -> tuple[Tensor, Tensor]:
    """Plain float32 matmul + logsumexp: tiny calls, tensors on a GPU (the model's own
    attention there), and the fallback where the flash op is missing or rejects the input. Shapes and ``causal_tl`` as :func:`_attend_heads`; GQA is done by
    repeating K/V heads here (a copy, acceptable on this fallback path)."""
    qh, kh, vh = qh.float(), kh.float(), vh.float()
    group = qh.shape[0] // kh.shape[0]
    if group > 1:
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if causal_tl:
        rows, tokens = s.shape[1], s.shape[2]
        allowed = torch.arange(tokens, device=s.device).unsqueeze(0) <= torch.arange(rows, device=s.device).unsqueeze(1)
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), vh), lse


def _attend_heads(qh: Tensor, kh: Tensor, vh: Tensor, scale: float,
                  causal_tl: bool = False) -> tuple[Tensor, Tensor]:
    """Head-major kernel call. qh ``[H, L, E]``, kh/vh ``[Hk, S, E]`` (``H % Hk == 0``,
    ``L, S >= 1``; views allowed). ``causal_tl``: top-left causal (row i sees keys 0..i).

    Returns ``o`` ``[H, L, E]`` (kernel dtype) and natural-log ``lse`` ``[H, L]`` float32.
    """
    dtype = _kernel_dtype(kh)
    if qh.shape[1] * kh.shape[1] <= TINY_SCORES or qh.device.type != "cpu":  # the op is CPU-only
        return _attend_matmul(qh, kh, vh, scale, causal_tl)  # the kernel's fixed cost dominates
    if _FLASH_CPU is not None:
        try:
            o, lse = _FLASH_CPU(qh.to(dtype).unsqueeze(0), kh.to(dtype).unsqueeze(0),
                                vh.to(dtype).unsqueeze(0), is_causal=causal_tl, scale=scale)
            return o[0], lse[0].float()
        except RuntimeError:
            pass  # unsupported dtype/shape on this build: fall through to the matmul path
    return _attend_matmul(qh, kh, vh, scale, causal_tl)


def attend_grouped(qg: Tensor, kh: Tensor, vh: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Non-causal partial in the grouped layout: qg ``[Hk, rows*group, E]`` (from
    :func:`to_grouped`), kh/vh ``[Hk, S, E]`` with ``S >= 1``. One kernel call; each kv
    head serves its whole query group, K/V are read in place. Returns ``o`` ``[Hk,
    rows*group, E]`` and natural-log ``lse`` ``[Hk, rows*group]`` (:func:`from_grouped`
    turns them into a :class:`~tokenlake.kernels.attention.Partial`)."""
    return _attend_heads(qg, kh, vh, scale)


# ---------------------------------------------------------------------------- causal


def _causal_diagonal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Partial:
    """Causal attention of ``n`` rows over their own ``n`` tokens (square, so top-left
    alignment is right). q ``[n, Hq, E]``, k/v ``[n, Hk, E]``. Uses the op's native GQA in
    the head-major layout (the grouped layout would break the causal row order)."""
    o, lse = _attend_heads(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, True)
    return Partial(o.transpose(0, 1).float(), lse.transpose(0, 1))


def _causal_partial(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Partial:
    """Bottom-right causal partial, split into exact pieces the top-left op can do:
    the prefix ``k[:tokens-rows]`` (non-causal, grouped layout) merged with the square
    diagonal block; when ``rows > tokens`` the first ``rows - tokens`` rows see nothing."""
    rows, q_heads, head_dim = q.shape
    tokens, kv_heads = k.shape[0], k.shape[1]
    if rows > tokens:
        o, lse = empty_partial(rows, q_heads, head_dim, device=q.device)
        o[rows - tokens:], lse[rows - tokens:] = _causal_diagonal(q[rows - tokens:], k, v, scale)
        return Partial(o, lse)
    diag = _causal_diagonal(q, k[tokens - rows:], v[tokens - rows:], scale)
    if tokens == rows:
        return diag
    prefix_k, prefix_v = k[: tokens - rows].transpose(0, 1), v[: tokens - rows].transpose(0, 1)
    prefix = from_grouped(*attend_grouped(to_grouped(q, kv_heads), prefix_k, prefix_v, scale), rows)
    return merge(*prefix, *diag)


# ---------------------------------------------------------------------------- entry points


def partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                      causal: bool = False) -> Partial:
    """Fast CPU partial attention, float32 accumulation; same contract as
    :func:`~tokenlake.kernels.attention.partial_attention_ref` but returns float32 ``o``
    ``[rows, q_heads, head_dim]`` and float32 natural-log ``lse`` ``[rows, q_heads]``.

    Non-causal: one call of torch's CPU flash kernel with q in the grouped layout
    ``[kv_heads, rows*group, E]`` against K/V views ``[kv_heads, tokens, E]`` (no K/V copy).
    Causal: the kernel's causal flag is top-left aligned and the grouped layout would break
    its row order, so the prefix part runs grouped and the square diagonal block runs with
    the kernel's native GQA, merged exactly (:func:`_causal_partial`). float16/bfloat16 K/V
    are read as they are (``o`` is then rounded to that dtype before the float32 cast);
    other dtypes are computed in float32. ``tokens == 0`` / ``rows == 0`` never reach the
    kernel (it crashes on them).
    """
    rows, q_heads, head_dim, tokens, kv_heads = check_qkv(q, k, v)
    if rows == 0 or tokens == 0:
        return empty_partial(rows, q_heads, head_dim, device=q.device)
    scale = softmax_scale(scale, head_dim)
    if causal:
        return _causal_partial(q, k, v, scale)
    o_g, lse_g = attend_grouped(to_grouped(q, kv_heads), k.transpose(0, 1), v.transpose(0, 1), scale)
    return from_grouped(o_g, lse_g, rows)


def single_token_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Partial:
    """Row-wise attention of each query row over its own single key: row ``i`` of ``q``
    ``[n, q_heads, E]`` attends only to row ``i`` of ``k``/``v`` ``[n, kv_heads, E]``.

    This is the causal self-attention of a decode step (each request's one new token),
    for a whole batch at once: the softmax over one key is 1, so ``o`` is that key's
    ``v`` and ``lse`` its scaled score. Equals :func:`partial_attention` on each row with
    ``causal=True``. Returns float32 ``o`` ``[n, q_heads, E]`` and ``lse`` ``[n, q_heads]``.
    """
    n, q_heads, head_dim, kv_heads = _own_token_shape(q, k, v)
    group = q_heads // kv_heads
    qf = q.float().view(n, kv_heads, group, head_dim)
    lse = (qf * k.float().unsqueeze(2)).sum(-1).mul_(softmax_scale(scale, head_dim)).view(n, q_heads)
    o = v.float().unsqueeze(2).expand(n, kv_heads, group, head_dim).reshape(n, q_heads, head_dim)
    return Partial(o, lse)


def merge_single_token(o: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor,
                       scale: float | None = None) -> Tensor:
    """A decode step's prefix partial ``(o, lse)`` (float32, ``[n, q_heads, E]`` and
    ``[n, q_heads]``) merged with each row's attention over its own new token: equals
    ``merge(o, lse, *single_token_attention(q, k, v, scale)).o`` (to float32 rounding:
    a matmul for the dot products, a division for the normalisation), in half the tensor
    operations (a layer of a decode step pays their dispatch, not their arithmetic).
    A row whose prefix is empty (``lse = -inf``, ``o = 0``) gets its token's ``v``.
    Returns a new float32 ``[n, q_heads, E]``."""
    n, q_heads, head_dim, kv_heads = _own_token_shape(q, k, v)
    if o.shape != q.shape or lse.shape != q.shape[:2]:
        raise ValueError(f"o {tuple(o.shape)}, lse {tuple(lse.shape)} do not fit q {tuple(q.shape)}")
    mod = native.row_ops(o, lse, q, k, v)
    if mod is not None:  # one call (csrc/row_ops_cpu.cpp) for the dozen operations below
        return mod.merge_own_token(o, lse, q, k, v, softmax_scale(scale, head_dim))
    group = q_heads // kv_heads
    kf = k.float().reshape(n, kv_heads, head_dim, 1)
    s = torch.matmul(q.float().reshape(n, kv_heads, group, head_dim), kf).view(n, q_heads)
    s.mul_(softmax_scale(scale, head_dim))
    m = torch.maximum(lse, s)  # finite: s is
    w_o, w_s = (lse - m).exp_(), (s - m).exp_()
    out = o * w_o.unsqueeze(-1)
    out.view(n, kv_heads, group, head_dim).addcmul_(v.float().reshape(n, kv_heads, 1, head_dim),
                                                    w_s.view(n, kv_heads, group, 1))
    return out.div_((w_o + w_s).unsqueeze(-1))


def _own_token_shape(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int]:
    """``(n, q_heads, head_dim, kv_heads)`` of ``n`` query rows ``[n, q_heads, E]`` each
    with its own key and value ``[n, kv_heads, E]``; ValueError if they do not fit."""
    n, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != head_dim or q_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    return n, q_heads, head_dim, kv_heads
