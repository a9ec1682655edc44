"""The model's pieces as pure functions of (weights, tensors): float32 on the CPU as
loaded, or on the weights' device with half matrix products (``LlamaWeights.placed``).

A forward pass of a layer is ``q, k, v = qkv(...)``, attention of ``q`` over the cached
and new ``k, v`` (done by the caller: :func:`tokenlake.kernels.cpu.partial_attention`
locally, or the pool's query engines plus an exact merge), then ``finish_layer(...)``.
The reference engine (:mod:`tokenlake.model.llama.reference`) and the stateless compute engine
share these functions, so they compute the same numbers.

Shapes: ``n`` rows (tokens) at a time; ``hidden`` ``[n, hidden_size]``; ``q``
``[n, q_heads, head_dim]``; ``k`` / ``v`` ``[n, kv_heads, head_dim]``. Positions are
absolute token positions in the sequence (0-based), one per row.

RoPE layout: interleaved pairs. Dimension pair ``(2i, 2i+1)`` of every head is rotated
by ``pos * rope_base ** (-2i / head_dim)``; this is llama.cpp's ``LLAMA_ROPE_TYPE_NORM``,
which matches the GGUF converter's permutation of the Q/K weights.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tokenlake.core.errors import TokenLakeError
from tokenlake.kernels import native
from tokenlake.model.llama.weights import LayerWeights, LlamaConfig, LlamaWeights

Tensor = torch.Tensor

#: Rows up to which the projections go to the csrc kernel (:func:`linear`) where it is
#: built: on SmolLM2's shapes it reads the weights 2.3x faster than BLAS sgemm at 1 and 8
#: rows, 1.3-1.4x at 32 (the ``linear`` rows of ``tokenlake bench kernel``, on AVX-512 and on
#: AVX2 alike); at 64 the two were even.
NATIVE_LINEAR_ROWS = 32
#: Whether :func:`linear` uses the kernel when it is built (:func:`use_native_linear`).
_native_linear = {"on": True}


class LlamaInputError(TokenLakeError, ValueError):
    """Token ids or lengths a model cannot take (base of the three below)."""


class EmptyPromptError(LlamaInputError):
    """A prompt with no tokens."""


class TokenIdError(LlamaInputError):
    """A token id outside ``[0, vocab_size)``."""


class ContextLengthError(LlamaInputError):
    """More tokens than the model's ``max_context``."""


def check_token_ids(config: LlamaConfig, token_ids: Sequence[int] | Tensor) -> Tensor:
    """``token_ids`` as a 1-D int64 tensor, validated: raises :class:`TokenIdError` for
    an id outside ``[0, vocab_size)`` or a non-integer / non-1-D input."""
    ids = torch.as_tensor(token_ids)
    if ids.dim() != 1 or (ids.numel() and (ids.is_floating_point() or ids.is_complex()
                                           or ids.dtype == torch.bool)):
        raise TokenIdError(f"token ids must be a 1-D sequence of ints, got {ids.dtype} "
                           f"shape {tuple(ids.shape)}")
    ids = ids.to(torch.long)
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.numel():
        raise TokenIdError(f"token ids outside [0, {config.vocab_size}): {bad[:5].tolist()}")
    return ids


def use_native_linear(on: bool) -> None:
    """Turns the csrc kernel for few-row projections on (the default, where it is built)
    or off (BLAS; benchmarks and tests compare the two)."""
    _native_linear["on"] = bool(on)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` (``x`` ``[n, in]``, ``w`` ``[out, in]``): the csrc kernel for at most
    :data:`NATIVE_LINEAR_ROWS` float32 CPU rows where it is built (each row then depends on
    itself alone: a request decodes the same numbers in any batch of up to that many
    rows), ``F.linear`` otherwise (and where autograd records). The reference engine and
    the compute engine both project through here. Half weights
    (:meth:`~tokenlake.model.llama.weights.LlamaWeights.placed`): ``x`` is rounded to
    their dtype, the product runs in it (float32 accumulation on a GPU) and comes back
    as float32 (on a GPU straight from the float32 accumulators, ``torch.mm``'s
    ``out_dtype``, where this torch has it: a logit is then not rounded to 8 bits)."""
    if w.dtype != x.dtype:
        return _half_linear(x.to(w.dtype), w)
    if (x.dim() == 2 and x.shape[0] <= NATIVE_LINEAR_ROWS and _native_linear["on"]
            and x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and w.device.type == "cpu" and w.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        mod = native.load_prebuilt()  # never compiles here
        if mod is not None:
            return mod.small_linear(x, w)
    return F.linear(x, w)


@functools.cache
def _mm_float_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` runs here for half inputs on
    ``device`` (probed once, on a 2 x 2 product: an older torch lacks it; a later error of
    a real product, out of memory say, is raised as it is)."""
    probe = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        torch.mm(probe, probe, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _half_linear(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w.T`` of half ``x`` and ``w`` as float32: the float32 accumulators themselves
    on a GPU whose torch offers ``out_dtype``, the half product widened otherwise."""
    if x.is_cuda and x.dim() == 2 and _mm_float_out(x.device, x.dtype):
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return F.linear(x, w).float()


def _layer(w: LlamaWeights, layer: int | LayerWeights) -> LayerWeights:
    return w.layers[layer] if isinstance(layer, int) else layer


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` (float32; rows ``[n, d]`` by the csrc
    kernel where :func:`~tokenlake.kernels.native.row_ops` takes them, its sum of squares in double)."""
    mod = native.row_ops(x, weight) if x.dim() == 2 and weight.shape == x.shape[1:] else None
    if mod is not None:
        return mod.rms_norm(x, weight, eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(config: LlamaConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """``cos``, ``sin`` ``[n, head_dim // 2]`` float32 for absolute ``positions`` ``[n]``
    (angles computed in float64, then rounded)."""
    half = config.head_dim // 2
    pos = torch.as_tensor(positions, dtype=torch.float64)
    inv_freq = config.rope_base ** (-torch.arange(half, dtype=torch.float64, device=pos.device) * 2 / config.head_dim)
    angles = pos.reshape(-1, 1) * inv_freq
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates interleaved pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x`` ``[n, heads,
    head_dim]`` by the angles of ``cos`` / ``sin`` ``[n, head_dim // 2]``; new tensor."""
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)  # (not -1: no rows is a shape too)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).reshape(x.shape)


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`apply_rope` of ``q`` and of ``k`` at the same rows: one call of the csrc
    kernel where :func:`~tokenlake.kernels.native.row_ops` takes them (the same roundings: equal bit for bit)."""
    mod = native.row_ops(q, k, cos, sin)
    if mod is not None and cos.shape == sin.shape == (q.shape[0], q.shape[-1] // 2) and q.dim() == k.dim() == 3:
        return mod.rope_qk(q, k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def embed(w: LlamaWeights, token_ids: Tensor) -> Tensor:
    """``[n, hidden]`` float32 rows of the embedding table (ids are not re-validated;
    use :func:`check_token_ids` on untrusted input; moved to the weights' device)."""
    return w.embed[token_ids.to(w.embed.device)].float()


def qkv(w: LlamaWeights, layer: int | LayerWeights, hidden: Tensor, positions: Tensor,
        rope: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Attention inputs of ``layer`` (an index or its :class:`LayerWeights`):
    attention RMSNorm of ``hidden`` ``[n, hidden]``, the Q/K/V projections and RoPE at
    ``positions`` ``[n]`` on q and k. ``rope``: precomputed :func:`rope_tables` of
    ``positions`` (optional, saves recomputing them per layer).

    Returns q ``[n, q_heads, head_dim]``, k and v ``[n, kv_heads, head_dim]``, float32.
    """
    c, lw = w.config, _layer(w, layer)
    n = hidden.shape[0]
    x = rms_norm(hidden, lw.attn_norm, c.rms_eps)
    q = linear(x, lw.wq).view(n, c.num_q_heads, c.head_dim)
    k = linear(x, lw.wk).view(n, c.num_kv_heads, c.head_dim)
    v = linear(x, lw.wv).view(n, c.num_kv_heads, c.head_dim)
    cos, sin = rope if rope is not None else rope_tables(c, positions)
    return (*rope_qk(q, k, cos, sin), v)


def stored_kv(k: Tensor, v: Tensor, kv_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``k`` and ``v`` as attention reads them back from a cache of ``kv_dtype``: rounded
    to it once, then float32 again (unchanged for float32). Every engine attends over
    these values, its own new rows included, so a pool and a reference of the same KV
    dtype compute the same attention (docs/design.md "KV dtype")."""
    if kv_dtype == k.dtype:
        return k, v
    return k.to(kv_dtype).to(k.dtype), v.to(kv_dtype).to(v.dtype)


def finish_layer(w: LlamaWeights, layer: int | LayerWeights, hidden: Tensor,
                 attn: Tensor) -> Tensor:
    """The rest of ``layer`` after attention: output projection of ``attn``
    ``[n, q_heads, head_dim]`` plus the residual ``hidden`` ``[n, hidden]``, then the FFN
    RMSNorm and SwiGLU MLP (``down(silu(gate(x)) * up(x))``) plus the residual.
    Returns the new ``[n, hidden]`` float32."""
    c, lw = w.config, _layer(w, layer)
    hidden = hidden + linear(attn.reshape(attn.shape[0], -1), lw.wo)
    x = rms_norm(hidden, lw.ffn_norm, c.rms_eps)
    return hidden + linear(F.silu(linear(x, lw.w_gate)) * linear(x, lw.w_up), lw.w_down)


def logits(w: LlamaWeights, hidden: Tensor) -> Tensor:
    """``[n, vocab]`` float32 logits: final RMSNorm, then the tied LM head (``embed.T``)."""
    return linear(rms_norm(hidden, w.final_norm, w.config.rms_eps), w.embed)
