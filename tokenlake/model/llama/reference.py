"""The oracle: a plain monolithic forward pass with a local KV cache per sequence.

Everything the stateless compute engine does must reproduce these numbers (the tests
compare logits to 1e-4). It uses the same pieces (:mod:`tokenlake.model.llama.model`) and the
same attention (:func:`tokenlake.kernels.cpu.partial_attention`) over one contiguous cache:
causal over the whole cache for a chunk of new tokens, plain (every cached token) for a
single decode row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenlake.kernels.cpu import partial_attention
from tokenlake.model.llama import model
from tokenlake.model.llama.model import (
    ContextLengthError,
    EmptyPromptError,
    LlamaInputError,
    check_token_ids,
)
from tokenlake.model.llama.weights import LlamaConfig, LlamaWeights

Tensor = torch.Tensor
#: How far (max abs) the pool's logits may lie from this engine's when both hold their
#: KV in the same dtype (docs/design.md "KV dtype"). float32: reduction order only.
#: Half K/V: the two engines' float32 K/V differ by reduction order (~1e-6), and where
#: a value lies that close to a rounding boundary the two round it to neighbouring
#: half values; measured maxima on the demo 0.11 (bfloat16) and 0.014 (float16).
#: Greedy outputs then agree token for token except at near ties: a step where the
#: reference's margin between its token and the pool's is at most twice this tolerance
#: (each logit of one engine may lie this far from the other's, so the pool's choice can
#: only differ where the margin is that small).
LOGIT_TOLERANCE = {"float32": 1e-4, "float16": 0.05, "bfloat16": 0.25}
_MIN_CAPACITY = 64  # tokens preallocated for a new cache (doubles as it fills)


@dataclass
class KVCache:
    """K and V of one sequence, every layer: ``keys[l]`` / ``values[l]`` are
    ``[capacity, kv_heads, head_dim]`` buffers (float32 unless the engine's ``kv_dtype``
    says otherwise) whose first ``length`` rows are valid (post-RoPE K, as attention
    reads them). Owned and grown by the engine."""

    keys: list[Tensor]
    values: list[Tensor]
    length: int = 0

    @classmethod
    def empty(cls, config: LlamaConfig, capacity: int, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> KVCache:
        shape = (capacity, config.num_kv_heads, config.head_dim)
        return cls([torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)],
                   [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)])

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0]

    def k(self, layer: int) -> Tensor:
        """Valid keys of ``layer``: a view ``[length, kv_heads, head_dim]``."""
        return self.keys[layer][: self.length]

    def v(self, layer: int) -> Tensor:
        """Valid values of ``layer``: a view ``[length, kv_heads, head_dim]``."""
        return self.values[layer][: self.length]

    def attend(self, q: Tensor, layer: int, stop: int, causal: bool = False) -> Tensor:
        """Attention of ``q`` over the first ``stop`` cached rows of ``layer`` in
        float32 (half K/V read back as float32): ``[n, q_heads, head_dim]``."""
        keys, values = self.keys[layer][:stop], self.values[layer][:stop]
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        return partial_attention(q, keys, values, causal=causal)[0]

    def reserve(self, tokens: int) -> None:
        """Grows the buffers (doubling) so that ``tokens`` tokens fit."""
        if tokens <= self.capacity:
            return
        capacity = max(tokens, 2 * self.capacity)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype, device=old.device)
                new[: self.length] = old[: self.length]
                buffers[i] = new


@dataclass(frozen=True)
class GenerationResult:
    """What :meth:`ReferenceEngine.generate` produced.

    ``output_ids``: the generated ids, the stop id included when one ended generation;
    ``logits``: per generated token, the float32 ``[vocab]`` logits it was chosen from
    (``logits[i].argmax() == output_ids[i]``); ``stopped``: True when a stop id ended
    generation, False when ``max_new_tokens`` did."""

    output_ids: list[int]
    logits: list[Tensor] = field(repr=False)
    stopped: bool


def greedy(logits: Tensor) -> int:
    """Argmax of ``[vocab]`` logits, ties to the lowest id. Raises ``ValueError`` on NaN."""
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")
    return int(torch.nonzero(logits == logits.max())[0, 0])


class ReferenceEngine:
    """Monolithic greedy engine over :class:`LlamaWeights` (float32 on the CPU as loaded,
    or placed on a GPU in half, :meth:`LlamaWeights.placed`: it runs where they are), its
    KV cache held in ``kv_dtype`` (float32, bfloat16 or float16; attention math in
    float32). Logits come back on the host.

    Constructor only stores. All methods validate their input and raise subclasses of
    :class:`tokenlake.model.llama.model.LlamaInputError` (a ``ValueError``) with a message.
    """

    def __init__(self, weights: LlamaWeights, kv_dtype: torch.dtype = torch.float32) -> None:
        self.weights = weights
        self.config = weights.config
        self.kv_dtype = kv_dtype

    def extend(self, cache: KVCache, token_ids: Sequence[int] | Tensor) -> Tensor:
        """Runs ``token_ids`` (``n >= 1``) after the ``cache.length`` cached tokens,
        appends their K/V to ``cache`` and returns the float32 ``[vocab]`` logits of the
        last of them (the LM head runs on that row only)."""
        ids = check_token_ids(self.config, token_ids)
        n, start = ids.numel(), cache.length
        if n == 0:
            raise EmptyPromptError("no tokens to run (empty prompt)")
        if start + n > self.config.max_context:
            raise ContextLengthError(f"{start} cached + {n} new tokens exceed max_context "
                                     f"{self.config.max_context}")
        cache.reserve(start + n)
        w = self.weights
        positions = torch.arange(start, start + n, device=w.device)
        rope = model.rope_tables(self.config, positions)
        hidden = model.embed(w, ids)
        for i in range(self.config.num_layers):
            q, k, v = model.qkv(w, i, hidden, positions, rope=rope)
            cache.keys[i][start: start + n] = k
            cache.values[i][start: start + n] = v
            attn = cache.attend(q, i, start + n, causal=n > 1)
            hidden = model.finish_layer(w, i, hidden, attn)
        cache.length = start + n
        return model.logits(w, hidden[-1:])[0].cpu()

    def prefill(self, token_ids: Sequence[int] | Tensor) -> tuple[Tensor, KVCache]:
        """Runs a prompt from scratch: returns the last position's ``[vocab]`` logits and
        a new :class:`KVCache` holding the prompt's K/V."""
        ids = check_token_ids(self.config, token_ids)
        n = ids.numel()
        if n == 0:
            raise EmptyPromptError("empty prompt: at least one token is needed")
        if n > self.config.max_context:
            raise ContextLengthError(f"prompt of {n} tokens exceeds max_context "
                                     f"{self.config.max_context}")
        cache = KVCache.empty(self.config, min(max(n, _MIN_CAPACITY), self.config.max_context), self.kv_dtype,
                              self.weights.device)
        return self.extend(cache, ids), cache

    def decode_step(self, cache: KVCache, token_id: int) -> Tensor:
        """Appends one token to ``cache``; returns its ``[vocab]`` logits."""
        if cache.length == 0:
            raise EmptyPromptError("decode_step needs a prefilled cache")
        return self.extend(cache, [int(token_id)])

    def decode_batch(self, caches: Sequence[KVCache], token_ids: Sequence[int]) -> Tensor:
        """One decode step of several sequences at once: ``token_ids[i]`` is appended to
        ``caches[i]``. The projections and MLP run on the whole batch (one weight pass,
        as a batching engine does); attention runs per sequence over its own cache.
        Returns ``[batch, vocab]`` logits; row ``i`` equals ``decode_step(caches[i], ...)``.
        """
        if len(caches) != len(token_ids) or not caches:
            raise LlamaInputError(f"{len(caches)} caches for {len(token_ids)} tokens")
        if len({id(c) for c in caches}) != len(caches):
            raise LlamaInputError("a cache appears twice in one batch")
        ids = check_token_ids(self.config, [int(t) for t in token_ids])
        for c in caches:
            if c.length == 0:
                raise EmptyPromptError("decode_batch needs prefilled caches")
            if c.length + 1 > self.config.max_context:
                raise ContextLengthError(f"{c.length} cached + 1 new token exceed max_context "
                                         f"{self.config.max_context}")
            c.reserve(c.length + 1)
        w = self.weights
        positions = torch.tensor([c.length for c in caches], device=w.device)
        rope = model.rope_tables(self.config, positions)
        hidden = model.embed(w, ids)
        for i in range(self.config.num_layers):
            q, k, v = model.qkv(w, i, hidden, positions, rope=rope)
            attn = torch.empty_like(q)
            for b, c in enumerate(caches):
                c.keys[i][c.length] = k[b]
                c.values[i][c.length] = v[b]
                attn[b : b + 1] = c.attend(q[b : b + 1], i, c.length + 1)
            hidden = model.finish_layer(w, i, hidden, attn)
        for c in caches:
            c.length += 1
        return model.logits(w, hidden).cpu()

    def generate(self, prompt_ids: Sequence[int] | Tensor, max_new_tokens: int,
                 stop_ids: Sequence[int] | None = None) -> GenerationResult:
        """Greedy generation (argmax, ties to the lowest id) of up to ``max_new_tokens``
        tokens after ``prompt_ids``, stopping after a token in ``stop_ids`` (default: the
        EOS id). ``len(prompt_ids) + max_new_tokens`` must fit ``max_context``."""
        ids = check_token_ids(self.config, prompt_ids)
        if ids.numel() == 0:
            raise EmptyPromptError("empty prompt: at least one token is needed")
        if max_new_tokens < 0:
            raise LlamaInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if ids.numel() + max_new_tokens > self.config.max_context:
            raise ContextLengthError(
                f"prompt of {ids.numel()} tokens + max_new_tokens {max_new_tokens} exceed "
                f"max_context {self.config.max_context}")
        stops = {self.config.eos_id} if stop_ids is None else {int(s) for s in stop_ids}
        out: list[int] = []
        all_logits: list[Tensor] = []
        if max_new_tokens == 0:
            return GenerationResult(out, all_logits, False)
        step_logits, cache = self.prefill(ids)
        while True:
            token = greedy(step_logits)
            out.append(token)
            all_logits.append(step_logits)
            if token in stops:
                return GenerationResult(out, all_logits, True)
            if len(out) == max_new_tokens:
                return GenerationResult(out, all_logits, False)
            step_logits = self.decode_step(cache, token)
