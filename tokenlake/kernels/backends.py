"""Partial attention by device: the CUDA backend (FlashInfer) and :func:`backend_for`,
which names each device's backend (docs/design.md §4 "Attention backends").

Every backend takes ``(q, k, v, scale=None, causal=False)`` and returns a natural-log
:class:`~tokenlake.kernels.attention.Partial`. The CPU one is
:func:`tokenlake.kernels.cpu.partial_attention`; FlashInfer is imported only
when the CUDA one runs, so this module loads without it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenlake.kernels.attention import (
    HALF_TYPES,
    Partial,
    Tensor,
    empty_partial,
    lse_base2_to_natural,
    softmax_scale,
)
from tokenlake.kernels.cpu import partial_attention
from tokenlake.kernels.paged import FLASHINFER_BACKEND


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
        import flashinfer  # optional GPU dependency: only where this backend runs
    except ImportError as exc:
        raise RuntimeError("FlashInfer is not installed (pip install 'tokenlake[gpu]')") from exc
    if k.dtype not in HALF_TYPES:
        raise TypeError(f"FlashInfer needs float16/bfloat16 K/V, got {k.dtype}")
    rows, q_heads, head_dim = q.shape
    tokens = k.shape[0] if kv_layout == "NHD" else k.shape[1]
    skip = max(rows - tokens, 0) if causal else 0
    out = empty_partial(rows, q_heads, head_dim, device=q.device)
    if rows == skip or tokens == 0:
        return out
    o, lse2 = flashinfer.single_prefill_with_kv_cache(
        q[skip:].to(k.dtype), k, v, causal=causal, kv_layout=kv_layout,
        sm_scale=softmax_scale(scale, head_dim), return_lse=True, backend=FLASHINFER_BACKEND)
    out.o[skip:], out.lse[skip:] = o.float(), lse_base2_to_natural(lse2.float())
    return out


def backend_for(device: str | torch.device) -> Callable[..., Partial]:
    """The partial-attention function for a device: ``cpu`` -> :func:`partial_attention`,
    ``cuda`` -> :func:`flashinfer_partial_attention`. All share the
    ``(q, k, v, scale=None, causal=False)`` call and the natural-log ``(o, lse)`` result.
    Raises ``ValueError`` for any other device type."""
    kind = torch.device(device).type
    if kind == "cpu":
        return partial_attention
    if kind == "cuda":
        return flashinfer_partial_attention
    raise ValueError(f"no attention backend for device type {kind!r}")
