"""Partial attention ``(o, lse)`` and its exact merge (DESIGN §4 "Attention math").

A *partial* over a set of KV tokens is a pair

* ``o``: ``[rows, q_heads, head_dim]``, the attention output normalised over that set,
* ``lse``: ``[rows, q_heads]``, the **natural-log** log-sum-exp of the scaled scores
  ``scale * q·k`` over that set (``-inf`` where a row attended no token; its ``o`` is 0).

Partials over disjoint token sets merge exactly (:func:`merge`, :func:`merge_many`), which
is how the pool answers a query whose prefix segments live on several instances. GQA:
query head ``h`` reads kv head ``h // (q_heads // kv_heads)``.

Backends (DESIGN §4 "Attention backends"): :func:`partial_attention_ref` (float64 torch,
for tests), :func:`partial_attention` (CPU, torch's flash-attention kernel, float32) and
:func:`flashinfer_partial_attention` (CUDA; FlashInfer is imported lazily). This module
imports torch and is therefore not part of the pure control-plane core.

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

import math
import time
from collections.abc import Callable, Sequence

import torch

Tensor = torch.Tensor
Partial = tuple[Tensor, Tensor]

_LN2 = math.log(2.0)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_HALF_TYPES = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------- partials


def empty_partial(rows: int, q_heads: int, head_dim: int, dtype=torch.float32, device=None) -> Partial:
    """The partial over no tokens, the identity of :func:`merge`.

    Returns ``o`` zeros ``[rows, q_heads, head_dim]`` and ``lse`` ``-inf``
    ``[rows, q_heads]``, both of ``dtype``.
    """
    o = torch.zeros(rows, q_heads, head_dim, dtype=dtype, device=device)
    lse = torch.full((rows, q_heads), float("-inf"), dtype=dtype, device=device)
    return o, lse


def lse_base2_to_natural(lse2: Tensor) -> Tensor:
    """Base-2 log-sum-exp (FlashInfer) to natural log: ``lse = lse2 * ln 2``; ``-inf`` stays."""
    return lse2 * _LN2


def lse_natural_to_base2(lse: Tensor) -> Tensor:
    """Natural-log log-sum-exp to base 2 (FlashInfer's ``merge_state``): ``lse / ln 2``."""
    return lse / _LN2


def _safe_max(lse_max: Tensor) -> Tensor:
    """The running maximum with ``-inf`` (no token on any side) replaced by 0."""
    return torch.where(torch.isneginf(lse_max), torch.zeros_like(lse_max), lse_max)


def _normalise(weighted_o: Tensor, den: Tensor, m: Tensor) -> Partial:
    """``(weighted_o / den, m + log den)``, dividing ``weighted_o`` in place (callers pass a
    fresh tensor); ``den == 0`` (no token anywhere) gives ``o = 0``, ``lse = -inf``."""
    inv = torch.where(den > 0, 1.0 / den, torch.zeros_like(den))
    return weighted_o.mul_(inv.unsqueeze(-1)), m + torch.log(den)


def merge(o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> Partial:
    """Exact merge of two partials over disjoint token sets (DESIGN §4).

    ``o_x``: ``[..., head_dim]``, ``lse_x``: ``[...]`` (natural log). With
    ``m = max(lse_a, lse_b)``, ``w_x = exp(lse_x - m)``:
    ``o = (w_a o_a + w_b o_b) / (w_a + w_b)``, ``lse = m + log(w_a + w_b)``.
    ``-inf`` on either side contributes nothing; on both sides gives ``o = 0``,
    ``lse = -inf`` (never NaN). Commutative; dtype follows torch type promotion.
    """
    m = _safe_max(torch.maximum(lse_a, lse_b))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    weighted = o_a * w_a.unsqueeze(-1) + o_b * w_b.unsqueeze(-1)
    return _normalise(weighted, w_a + w_b, m)


def _merge_seq(outs: Sequence[Tensor], lse: Tensor) -> Partial:
    """Merges ``n >= 1`` partials given as ``n`` outputs ``[..., head_dim]`` (a list, or a
    stacked tensor iterated on its first axis) and stacked natural-log ``lse`` ``[n, ...]``.

    Weights are relative to the element-wise maximum (stable). The weighted sum is
    accumulated in place over ``n``, vectorised over everything else: 3-9x faster than
    materialising ``o * w`` for ``[8, 32, 512, 128]`` float32 on this CPU.
    """
    m = _safe_max(lse.amax(dim=0))
    w = torch.exp(lse - m).unsqueeze(-1)
    acc = outs[0] * w[0]
    for o_i, w_i in zip(outs[1:], w[1:]):
        acc.addcmul_(o_i, w_i)
    return _normalise(acc, w.sum(dim=0).squeeze(-1), m)


def merge_many(o: Tensor, lse: Tensor) -> Partial:
    """Exact, stable merge of ``n >= 1`` stacked partials (over disjoint token sets).

    ``o``: ``[n, rows, heads, head_dim]`` (any shape ``[n, ..., head_dim]`` works),
    ``lse``: ``[n, rows, heads]``, natural log. Returns ``o`` ``[rows, heads, head_dim]``
    and ``lse`` ``[rows, heads]``; all ``-inf`` at an element gives ``o = 0``, ``lse = -inf``.
    ``n == 0`` raises ``ValueError`` (the shapes would be unknown): callers with no work
    pass one :func:`empty_partial` (``o[None]``, ``lse[None]``).
    """
    if o.shape[0] == 0 or o.shape[:-1] != lse.shape:
        raise ValueError(f"merge_many needs o [n>=1, ..., E] and lse [n, ...]; got "
                         f"{tuple(o.shape)}, {tuple(lse.shape)}")
    return _merge_seq(o, lse)


# ---------------------------------------------------------------------------- reference


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int, int, int, int]:
    """Validates q ``[rows, q_heads, E]``, k/v ``[tokens, kv_heads, E]``; returns the sizes."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"want q [rows,Hq,E], k=v [tokens,Hk,E]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    rows, q_heads, head_dim = q.shape
    tokens, kv_heads, _ = k.shape
    if k.shape[2] != head_dim or kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"head_dim/GQA mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}")
    return rows, q_heads, head_dim, tokens, kv_heads


def _scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale, ``1/sqrt(head_dim)`` by default."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _causal_allowed(rows: int, tokens: int, device=None) -> Tensor:
    """Bool ``[rows, tokens]``: row ``r`` may see tokens ``0 .. tokens - rows + r``."""
    r = torch.arange(rows, device=device).unsqueeze(1)
    t = torch.arange(tokens, device=device).unsqueeze(0)
    return t <= r + (tokens - rows)


def partial_attention_ref(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                          causal: bool = False) -> Partial:
    """Float64 reference partial attention (tests only; copies K/V per query head).

    q: ``[rows, q_heads, head_dim]``; k, v: ``[tokens, kv_heads, head_dim]``. ``causal``:
    the new tokens are the last ``rows`` of k/v, row ``r`` sees ``0 .. tokens-rows+r``.
    Returns float64 ``o`` ``[rows, q_heads, head_dim]`` and natural-log ``lse``
    ``[rows, q_heads]``; a row that sees no token gets ``o = 0``, ``lse = -inf``.
    """
    rows, q_heads, head_dim, tokens, kv_heads = _check_shapes(q, k, v)
    head_of = torch.arange(q_heads, device=q.device) // (q_heads // kv_heads)
    kk, vv = k.double()[:, head_of], v.double()[:, head_of]  # [tokens, Hq, E]
    s = torch.einsum("rhe,the->hrt", q.double(), kk) * _scale(scale, head_dim)
    if causal:
        s = s.masked_fill(~_causal_allowed(rows, tokens, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hq, rows]; -inf for an empty row
    p = torch.exp(s - _safe_max(lse).unsqueeze(-1))
    o = torch.einsum("hrt,the->rhe", p, vv)
    return o, lse.transpose(0, 1).contiguous()


# ---------------------------------------------------------------------------- fast CPU path


def _to_grouped(q: Tensor, kv_heads: int) -> Tensor:
    """``[rows, Hq, E]`` -> ``[Hk, rows*group, E]``: kv head j's query heads as extra rows.

    Copies q (small), never K/V. Row index in the result is ``r * group + g``.
    """
    rows, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    return q.reshape(rows, kv_heads, group, head_dim).transpose(0, 1).reshape(
        kv_heads, rows * group, head_dim)


def _from_grouped(o_g: Tensor, lse_g: Tensor, rows: int) -> Partial:
    """Inverse of :func:`_to_grouped` for a partial: ``[Hk, rows*group, E]``, ``[Hk, rows*group]``
    -> ``[rows, Hq, E]`` float32, ``[rows, Hq]`` float32 (both contiguous)."""
    kv_heads, _, head_dim = o_g.shape
    o = o_g.reshape(kv_heads, rows, -1, head_dim).transpose(0, 1).reshape(rows, -1, head_dim)
    lse = lse_g.reshape(kv_heads, rows, -1).transpose(0, 1).reshape(rows, -1)
    return o.float().contiguous(), lse.float().contiguous()


def _kernel_dtype(k: Tensor) -> torch.dtype:
    """float16/bfloat16 K/V go to the kernel as they are (it accumulates in float32);
    anything else is computed in float32."""
    return k.dtype if k.dtype in _HALF_TYPES else torch.float32


def _attend_matmul(qh: Tensor, kh: Tensor, vh: Tensor, scale: float, causal_tl: bool) -> Partial:
    """Plain float32 matmul + logsumexp fallback, used only when the flash op is missing
    or rejects the input. Shapes and ``causal_tl`` as :func:`_attend_heads`; GQA is done by
    repeating K/V heads here (a copy, acceptable on this fallback path)."""
    qh, kh, vh = qh.float(), kh.float(), vh.float()
    group = qh.shape[0] // kh.shape[0]
    if group > 1:
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    s = torch.matmul(qh, kh.transpose(1, 2)) * scale
    if causal_tl:
        rows, tokens = s.shape[1], s.shape[2]
        allowed = torch.arange(tokens).unsqueeze(0) <= torch.arange(rows).unsqueeze(1)
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), vh), lse


#: Up to this many (query row, key) pairs per head the plain matmul path beats the
#: flash kernel's fixed cost (~0.8 ms measured for a decode step's 1 x 1 self-attention
#: on this CPU, against ~0.05 ms with matmuls).
TINY_SCORES = 4096


def _attend_heads(qh: Tensor, kh: Tensor, vh: Tensor, scale: float, causal_tl: bool = False) -> Partial:
    """Head-major kernel call. qh ``[H, L, E]``, kh/vh ``[Hk, S, E]`` (``H % Hk == 0``,
    ``L, S >= 1``; views allowed). ``causal_tl``: top-left causal (row i sees keys 0..i).

    Returns ``o`` ``[H, L, E]`` (kernel dtype) and natural-log ``lse`` ``[H, L]`` float32.
    """
    dtype = _kernel_dtype(kh)
    if qh.shape[1] * kh.shape[1] <= TINY_SCORES:
        return _attend_matmul(qh, kh, vh, scale, causal_tl)  # the kernel's fixed cost dominates
    if _FLASH_CPU is not None:
        try:
            o, lse = _FLASH_CPU(qh.to(dtype).unsqueeze(0), kh.to(dtype).unsqueeze(0),
                                vh.to(dtype).unsqueeze(0), is_causal=causal_tl, scale=scale)
            return o[0], lse[0].float()
        except RuntimeError:
            pass  # unsupported dtype/shape on this build: fall through to the matmul path
    return _attend_matmul(qh, kh, vh, scale, causal_tl)


def _attend_grouped(qg: Tensor, kh: Tensor, vh: Tensor, scale: float) -> Partial:
    """Non-causal partial in the grouped layout: qg ``[Hk, rows*group, E]`` (from
    :func:`_to_grouped`), kh/vh ``[Hk, S, E]`` with ``S >= 1``. One kernel call; each kv
    head serves its whole query group, K/V are read in place."""
    return _attend_heads(qg, kh, vh, scale)


def _causal_diagonal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Partial:
    """Causal attention of ``n`` rows over their own ``n`` tokens (square, so top-left
    alignment is right). q ``[n, Hq, E]``, k/v ``[n, Hk, E]``. Uses the op's native GQA in
    the head-major layout (the grouped layout would break the causal row order)."""
    o, lse = _attend_heads(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, True)
    return o.transpose(0, 1).float(), lse.transpose(0, 1)


def _causal_partial(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Partial:
    """Bottom-right causal partial, split into exact pieces the top-left op can do:
    the prefix ``k[:tokens-rows]`` (non-causal, grouped layout) merged with the square
    diagonal block; when ``rows > tokens`` the first ``rows - tokens`` rows see nothing."""
    rows, q_heads, head_dim = q.shape
    tokens, kv_heads = k.shape[0], k.shape[1]
    if rows > tokens:
        o, lse = empty_partial(rows, q_heads, head_dim)
        o[rows - tokens:], lse[rows - tokens:] = _causal_diagonal(q[rows - tokens:], k, v, scale)
        return o, lse
    diag = _causal_diagonal(q, k[tokens - rows:], v[tokens - rows:], scale)
    if tokens == rows:
        return diag
    prefix_k, prefix_v = k[: tokens - rows].transpose(0, 1), v[: tokens - rows].transpose(0, 1)
    prefix = _from_grouped(*_attend_grouped(_to_grouped(q, kv_heads), prefix_k, prefix_v, scale), rows)
    return merge(*prefix, *diag)


def partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                      causal: bool = False) -> Partial:
    """Fast CPU partial attention, float32 accumulation; same contract as
    :func:`partial_attention_ref` but returns float32 ``o`` ``[rows, q_heads, head_dim]``
    and float32 natural-log ``lse`` ``[rows, q_heads]``.

    Non-causal: one call of torch's CPU flash kernel with q in the grouped layout
    ``[kv_heads, rows*group, E]`` against K/V views ``[kv_heads, tokens, E]`` (no K/V copy).
    Causal: the kernel's causal flag is top-left aligned and the grouped layout would break
    its row order, so the prefix part runs grouped and the square diagonal block runs with
    the kernel's native GQA, merged exactly (:func:`_causal_partial`). float16/bfloat16 K/V
    are read as they are (``o`` is then rounded to that dtype before the float32 cast);
    other dtypes are computed in float32. ``tokens == 0`` / ``rows == 0`` never reach the
    kernel (it crashes on them).
    """
    rows, q_heads, head_dim, tokens, kv_heads = _check_shapes(q, k, v)
    if rows == 0 or tokens == 0:
        return empty_partial(rows, q_heads, head_dim, device=q.device)
    scale = _scale(scale, head_dim)
    if causal:
        return _causal_partial(q, k, v, scale)
    o_g, lse_g = _attend_grouped(_to_grouped(q, kv_heads), k.transpose(0, 1), v.transpose(0, 1), scale)
    return _from_grouped(o_g, lse_g, rows)


def single_token_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Partial:
    """Row-wise attention of each query row over its own single key: row ``i`` of ``q``
    ``[n, q_heads, E]`` attends only to row ``i`` of ``k``/``v`` ``[n, kv_heads, E]``.

    This is the causal self-attention of a decode step (each request's one new token),
    for a whole batch at once: the softmax over one key is 1, so ``o`` is that key's
    ``v`` and ``lse`` its scaled score. Equals :func:`partial_attention` on each row with
    ``causal=True``.
    """
    n, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != head_dim or q_heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    group = q_heads // kv_heads
    qf = q.float().view(n, kv_heads, group, head_dim)
    lse = (qf * k.float().unsqueeze(2)).sum(-1).mul_(_scale(scale, head_dim)).view(n, q_heads)
    o = v.float().unsqueeze(2).expand(n, kv_heads, group, head_dim).reshape(n, q_heads, head_dim)
    return o, lse


# ---------------------------------------------------------------------------- slab


def _slot_kv(slab: Tensor, layer: int, slot: int, n: int) -> tuple[Tensor, Tensor]:
    """Views ``[kv_heads, n, E]`` of slot ``slot``'s first ``n`` K and V tokens of ``layer``."""
    return slab[slot, layer, 0, :, :n], slab[slot, layer, 1, :, :n]


def _check_slab(q: Tensor, slab: Tensor, layer: int, slots: Sequence[int], tokens: Sequence[int]) -> None:
    """Validates the slab call (layout DESIGN §4, ``0 <= tokens[i] <= C``)."""
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
    at its front. Equals :func:`partial_attention` over the concatenation of those tokens
    (order is irrelevant, it is not causal). Returns float32 ``o`` ``[rows, q_heads,
    head_dim]`` and natural-log ``lse`` ``[rows, q_heads]``; no slots -> empty partial.

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
    if slab.is_cuda:
        return _slab_cuda(q, slab, layer, work, scale)
    scale = _scale(scale, head_dim)
    qg = _to_grouped(q, slab.shape[3])
    if qg.shape[1] <= SMALL_ROWS:
        return _from_grouped(*_slab_small_rows(qg, slab, layer, work, scale), rows)
    parts = [_attend_grouped(qg, *_slot_kv(slab, layer, s, n), scale) for s, n in work]
    if len(parts) == 1:
        return _from_grouped(*parts[0], rows)
    o_g, lse_g = _merge_seq([p[0].float() for p in parts], torch.stack([p[1] for p in parts]))
    return _from_grouped(o_g, lse_g, rows)


#: Grouped query rows (rows x query heads per kv head) up to which the slab attention
#: uses plain matmuls with one softmax over all slots instead of one flash-kernel call
#: per slot: the kernel's fixed cost (~0.2 ms per call on this CPU) dominates decode.
#: Measured for SmolLM2 shapes (9/3 heads x 64, C=256, 1 thread, 1 row): 4 slots
#: 0.87 -> 0.09 ms, 16 slots 3.1 -> 0.25 ms.
SMALL_ROWS = 64


def _slab_small_rows(qg: Tensor, slab: Tensor, layer: int, work: list[tuple[int, int]],
                     scale: float) -> Partial:
    """Few-row slab attention: scores of every slot, one exact softmax, then P @ V per
    slot. K/V are read in place (float32 math; half K/V are upcast per slot)."""
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
    o_g, lse_g = _attend_grouped(_to_grouped(q, slab.shape[3]), kh, vh, _scale(scale, head_dim))
    return _from_grouped(o_g, lse_g, rows)


def _slab_cuda(q: Tensor, slab: Tensor, layer: int, work: list[tuple[int, int]],
               scale: float | None) -> Partial:
    """CUDA slab path: one FlashInfer call per slot on HND views, merged exactly."""
    parts = [flashinfer_partial_attention(q, *_slot_kv(slab, layer, s, n), scale=scale, kv_layout="HND")
             for s, n in work]
    return _merge_seq([p[0] for p in parts], torch.stack([p[1] for p in parts]))


# ---------------------------------------------------------------------------- CUDA


def flashinfer_partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None,
                                 causal: bool = False, kv_layout: str = "NHD") -> Partial:
    """CUDA partial attention through FlashInfer (imported here, only when used).

    q: ``[rows, q_heads, head_dim]``; k/v: ``[tokens, kv_heads, head_dim]`` (``NHD``) or
    ``[kv_heads, tokens, head_dim]`` (``HND``), float16/bfloat16 (q is cast to k's dtype).
    Returns float32 ``o`` ``[rows, q_heads, head_dim]`` and float32 **natural-log** ``lse``
    (FlashInfer's own LSE is base 2 and is converted here). FlashInfer's causal mask is
    bottom-right aligned; rows that would see no token are handled here, not by it.
    Raises ``RuntimeError`` without CUDA or FlashInfer.
    """
    if not (torch.cuda.is_available() and q.is_cuda and k.is_cuda):
        raise RuntimeError("flashinfer_partial_attention needs CUDA tensors on a CUDA build")
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError("FlashInfer is not installed (pip install 'tokenlake[gpu]')") from exc
    if k.dtype not in _HALF_TYPES:
        raise TypeError(f"FlashInfer needs float16/bfloat16 K/V, got {k.dtype}")
    rows, q_heads, head_dim = q.shape
    tokens = k.shape[0] if kv_layout == "NHD" else k.shape[1]
    skip = max(rows - tokens, 0) if causal else 0
    out = empty_partial(rows, q_heads, head_dim, device=q.device)
    if rows == skip or tokens == 0:
        return out
    o, lse2 = flashinfer.single_prefill_with_kv_cache(
        q[skip:].to(k.dtype), k, v, causal=causal, kv_layout=kv_layout,
        sm_scale=_scale(scale, head_dim), return_lse=True)
    out[0][skip:], out[1][skip:] = o.float(), lse_base2_to_natural(lse2.float())
    return out


def backend_for(device: str | torch.device) -> Callable[..., Partial]:
    """The partial-attention function for a device: ``cpu`` -> :func:`partial_attention`,
    ``cuda`` -> :func:`flashinfer_partial_attention`. All share the
    ``(q, k, v, scale=None, causal=False)`` call and the natural-log ``(o, lse)`` result."""
    kind = torch.device(device).type
    if kind == "cpu":
        return partial_attention
    if kind == "cuda":
        return flashinfer_partial_attention
    raise ValueError(f"no attention backend for device type {kind!r}")


# ---------------------------------------------------------------------------- benchmark


def _time_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """``{name: (min, median)}`` wall times in ms of each ``fn()``, runs interleaved (so
    load from other processes hits all alike) after one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (min(ts), sorted(ts)[len(ts) // 2]) for name, ts in times.items()}


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
