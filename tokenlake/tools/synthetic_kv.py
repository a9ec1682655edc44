"""A synthetic "model" for driving a pool without weights, and its float64 reference.

Every token gets its K/V from its id, its position and the layer alone (a smooth
function, see :func:`token_kv`), so equal prefixes have equal K/V in any process, and
what the pool answers can be checked exactly: the partial attention of a query over a
request's cached prefix must equal :func:`reference_partial`, float64 attention over the
K/V those prefix tokens stand for, rounded once to the pool's KV dtype (what its slabs
hold). ``tokenlake bench serve --mixed`` drives compute engines with it
(:mod:`tokenlake.tools.bench.serve_worker`); ``tests/dataplane_util.py`` has the same
formula for the data-plane tests.

Query rows are seeded by a stable digest (BLAKE2b) of the request key, position and
layer, never by Python's ``hash()``, which is salted per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenlake.kernels.attention import Partial, partial_attention_ref


@dataclass(frozen=True)
class KVShape:
    """The attention shape of a pool's model, as its client buffers give it.

    Attributes:
        num_layers: layers (the ``kv`` buffer's first dimension).
        num_q_heads: query heads (``q`` is ``[rows, q_heads, head_dim]``).
        num_kv_heads: K/V heads (``kv`` is ``[layers, rows, 2, kv_heads, head_dim]``).
        head_dim: elements per head.
        max_rows: rows of the ``q`` / ``kv`` buffers: new tokens per iteration at most.
        kv_dtype: the pool's KV element type, as torch names it (``"float32"``,
            ``"bfloat16"``, ``"float16"``); ``q`` is always float32.
        device: where the buffers live (``"cpu"``, or ``"cuda"`` / ``"cuda:N"``).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_rows: int
    kv_dtype: str = "float32"
    device: str = "cpu"

    @classmethod
    def from_buffers(cls, buffers: Mapping[str, Any]) -> KVShape:
        """The shape of ``buffers`` (name -> ``BufferSpec``: ``shape``, ``dtype``,
        ``device``), e.g. ``cp.client_info(instance).buffers`` of ``tokenlake.connect``."""
        layers, rows, two, kv_heads, head_dim = buffers["kv"].shape
        q_rows, q_heads, q_dim = buffers["q"].shape
        if two != 2 or q_dim != head_dim or q_rows != rows or q_heads % kv_heads:
            raise ValueError(f"unexpected client buffers: kv {buffers['kv'].shape}, "
                             f"q {buffers['q'].shape}")
        return cls(layers, q_heads, kv_heads, head_dim, rows, buffers["kv"].dtype,
                   buffers["kv"].device)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)


def token_kv(tokens: Sequence[int], start: int, layer: int, shape: KVShape) -> torch.Tensor:
    """K/V of ``tokens`` at positions ``start, start + 1, ...`` in ``layer``:
    ``[n, 2, kv_heads, head_dim]`` float32, every element in [-1.5, 1.5]."""
    n = len(tokens)
    t = torch.tensor(list(tokens), dtype=torch.float64)[:, None]
    p = torch.arange(start, start + n, dtype=torch.float64)[:, None]
    width = 2 * shape.num_kv_heads * shape.head_dim
    base = torch.arange(width, dtype=torch.float64)[None, :]
    x = (torch.sin(t * 0.37 + p * 0.011 + layer * 1.3 + base * 0.173)
         + 0.5 * torch.cos(t * 0.05 + base * 0.71))
    return x.reshape(n, 2, shape.num_kv_heads, shape.head_dim).to(torch.float32)


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (their ``str``), the same in every process."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def query_rows(key: str, start: int, n: int, layer: int, shape: KVShape) -> torch.Tensor:
    """Deterministic query rows of request ``key`` at positions ``start..start + n`` in
    ``layer``: ``[n, q_heads, head_dim]`` float32, standard normal."""
    g = torch.Generator().manual_seed(stable_seed(key, start, layer))
    return torch.randn(n, shape.num_q_heads, shape.head_dim, generator=g)


def reference_partial(tokens: Sequence[int], prefix_tokens: int, q: torch.Tensor, layer: int,
                      shape: KVShape) -> Partial:
    """float64 attention of ``q`` (``[rows, q_heads, head_dim]``) over the K/V of
    ``tokens[:prefix_tokens]`` in ``layer``, rounded once to the pool's KV dtype as its
    slabs store it: ``o`` ``[rows, q_heads, head_dim]``, natural-log ``lse``
    ``[rows, q_heads]`` (float64; ``-inf`` and zeros for an empty prefix)."""
    kv = token_kv(tokens[:prefix_tokens], 0, layer, shape).to(shape.torch_kv_dtype)
    kv = kv.to(torch.float64)
    return partial_attention_ref(q.to(torch.float64), kv[:, 0], kv[:, 1])


def difference(o: torch.Tensor, lse: torch.Tensor, ref: Partial) -> float:
    """The largest absolute difference of a pool's partial (``o``, ``lse``) from
    ``ref``; ``inf`` if any element is NaN or the shapes differ. Two ``-inf`` LSEs (an
    empty prefix on both sides) agree."""
    if o.shape != ref.o.shape or lse.shape != ref.lse.shape:
        return float("inf")
    lse, rlse = lse.to(torch.float64), ref.lse
    both_empty = torch.isneginf(lse) & torch.isneginf(rlse)
    d_lse = torch.where(both_empty, torch.zeros_like(lse), (lse - rlse).abs())
    d_o = (o.to(torch.float64) - ref.o).abs()
    worst = max(d_o.max().item() if d_o.numel() else 0.0,
                d_lse.max().item() if d_lse.numel() else 0.0)
    return float("inf") if worst != worst else worst  # NaN counts as the worst
