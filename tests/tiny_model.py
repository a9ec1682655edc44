"""A small Llama built in code for the serving tests, and reference answers computed once.

Why: the serving tests compare every answer of the pool with :class:`ReferenceEngine`'s.
Run on SmolLM2-135M (30 layers, hidden 576) most of their time is the model's compute,
which says nothing about the pool. :func:`tiny_weights` has what matters to the pool and
the engines: grouped-query attention with three q heads per kv head (as SmolLM2's 9/3),
head_dim 64 (SmolLM2's, the CPU kernels' vector path), several layers, SmolLM2's vocab,
BOS/EOS ids and context length (so ids of the real tokenizer stay valid and its EOS stops
generation), in 3 layers of hidden size 192.

Margins. Random weights give near ties: the top two logits of a random model often lie
within float rounding of each other, and then the pool and the reference may pick
different tokens on another CPU; a model whose attention picks one position by content
is no better (where two positions score alike, rounding moves the mixture). So the
weights are built (:func:`tiny_weights`) to copy by position: in the last layer, one q
head per kv head attends to the position ``COPY_OFFSET`` tokens back and copies half of
that token's embedding, with gain ``COPY_GAIN``, into the hidden state; the tied LM head
then scores that token far above the rest (``|e|^2`` against ``e . e'``). So the answer
to a prompt replays its last ``COPY_OFFSET + 1`` tokens, and a lost, misplaced or
duplicated segment changes the tokens. The other heads of every layer attend by content
and add random terms to the logits, so every layer's K/V moves them: the tests compare
them to 1e-4. Measured on the tests' prompts: the pool's logits lie within ~2e-5 of the
reference's (SmolLM2's: ~4e-5), a 0.1% error in the weight of the pool's partial
attention moves them by ~4e-3 (SmolLM2's: ~7e-3), and the top-1 logit leads the top-2
by more than 0.5 of the largest logit.

:class:`CachedReference` checks every reference answer of the tiny model it hands out:
at every step the top-1 logit must lead the top-2 by at least ``MIN_MARGIN`` times the
largest logit magnitude, else it raises (a near tie fails loudly instead of flaking on
another CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tokenlake.model.llama.reference import GenerationResult, ReferenceEngine
from tokenlake.model.llama.weights import LayerWeights, LlamaConfig, LlamaWeights

NAME = "tiny-llama"
CONFIG = LlamaConfig(
    num_layers=3, hidden_size=192, num_q_heads=6, num_kv_heads=2, head_dim=64,
    intermediate_size=128, vocab_size=49152, rope_base=100000.0, rms_eps=1e-5,
    max_context=8192, bos_id=1, eos_id=2)
#: Layout of the hidden state: the embeddings live in the first EMBED_DIMS coordinates
#: ("A", where the copy goes: one head_dim of it per kv head); the layers before the last
#: write into the next ones ("B"); the last coordinate holds KAPPA for every token, so
#: that after RMSNorm it is a constant (~sqrt(hidden)), from which the copying heads of
#: the last layer make their positional q and k (the norm weights scale A and B back to
#: their own size).
EMBED_DIMS = 128
KAPPA = 256.0
COPY_OFFSET = 10  # the copying heads attend to the token this many positions back
COPY_GAIN = 8.0  # their output, in units of the (norm sqrt(EMBED_DIMS)) embedding
#: RoPE pairs of the copying heads (the fastest-turning ones): summed over these, the
#: score at the wanted offset leads every other offset up to max_context by 11%.
POSITION_PAIRS = 8
POSITION_AMPLITUDE = 1.0  # of the positional q and k pairs: a lead of ~22 in the score
CONTENT_GAIN = 2.0  # of the other heads' q and k (they attend by content)
OTHER_GAIN = 2.0  # of what the last layer's other heads add to A
MLP_GAIN = 0.1  # of what its MLP adds to A
FINAL_NORM = 0.8  # the logits' scale: their largest ~45 (SmolLM2's ~20)
#: Smallest accepted (top-1 - top-2) / max |logit| of a reference step of the tiny model.
#: Float32 reduction order moves the logits by ~1e-6 relative; a half-precision KV cache
#: by ~1e-3 relative.
MIN_MARGIN = 1e-2


def _orthogonal(gen: torch.Generator, n: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen))
    return (q * torch.sign(torch.diagonal(r))).contiguous()


@functools.lru_cache(maxsize=4)
def tiny_weights(seed: int = 0) -> LlamaWeights:
    """The tiny model's float32 weights (deterministic in ``seed``; shared, do not modify).

    Every layer's heads attend by content (q and k read A and B) and write into B, but in
    the last layer: there q head ``g * group`` of each kv head ``g`` is a copying head (its
    q and the first ``POSITION_PAIRS`` pairs of kv head ``g``'s k are made from the
    constant coordinate only, so that after RoPE q . k peaks at ``COPY_OFFSET`` positions
    back, and kv head ``g``'s value is head_dim coordinates of A, rotated); the copying
    heads write ``COPY_GAIN`` times the copied A back into A, the other heads and the
    MLP a little (``OTHER_GAIN``)."""
    c, a = CONFIG, EMBED_DIMS
    h, hd, f = c.hidden_size, c.head_dim, c.intermediate_size
    group = c.num_q_heads // c.num_kv_heads
    assert a == c.num_kv_heads * hd and a < h - 1
    k_idx, content = h - 1, slice(0, h - 1)  # the constant coordinate; A and B
    q_rows, kv_rows = c.num_q_heads * hd, c.num_kv_heads * hd
    scale = KAPPA / h ** 0.5  # RMSNorm divides by ~this (KAPPA dominates the norm)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    embed = torch.zeros(c.vocab_size, h)
    embed[:, :a] = randn(c.vocab_size, a)
    embed[:, :a] *= a ** 0.5 / embed[:, :a].norm(dim=1, keepdim=True)
    embed[:, k_idx] = KAPPA
    norm = torch.full((h,), scale)
    norm[k_idx] = 1.0
    theta = c.rope_base ** (-torch.arange(POSITION_PAIRS, dtype=torch.float64) * 2 / hd)
    pairs = 2 * POSITION_PAIRS
    layers = []
    for index in range(c.num_layers):
        wq = torch.zeros(q_rows, h)
        wk = torch.zeros(kv_rows, h)
        wq[:, content] = randn(q_rows, h - 1, std=CONTENT_GAIN * h ** -0.5)
        wk[:, content] = randn(kv_rows, h - 1, std=CONTENT_GAIN * h ** -0.5)
        wv = randn(kv_rows, h, std=h ** -0.5)
        wv[:, k_idx] = 0.0
        wo = torch.zeros(h, q_rows)
        w_down = torch.zeros(h, f)
        if index == c.num_layers - 1:
            wo[:a] = randn(a, q_rows, std=OTHER_GAIN * q_rows ** -0.5)
            w_down[:a] = randn(a, f, std=MLP_GAIN * f ** -0.5)
            for g in range(c.num_kv_heads):
                kv, qh = slice(g * hd, (g + 1) * hd), slice(g * group * hd, (g * group + 1) * hd)
                wq[qh] = 0.0  # the copying head: q pair i is (1, 0)
                wq[qh.start:qh.start + pairs:2, k_idx] = POSITION_AMPLITUDE
                wq[qh.stop:(g + 1) * group * hd, kv.start:kv.start + pairs] = 0.0  # the others: content pairs only
                wk[kv.start:kv.start + pairs] = 0.0  # k pair i: (cos, sin)(offset * theta_i)
                wk[kv.start:kv.start + pairs:2, k_idx] = (POSITION_AMPLITUDE * torch.cos(COPY_OFFSET * theta)).float()
                wk[kv.start + 1:kv.start + pairs:2, k_idx] = (POSITION_AMPLITUDE * torch.sin(COPY_OFFSET * theta)).float()
                rot = _orthogonal(gen, hd)
                wv[kv] = 0.0
                wv[kv, kv] = rot  # kv head g's value: A[g*hd:(g+1)*hd], rotated
                wo[kv, qh] = COPY_GAIN * rot.T
        else:  # writes into B, where the later layers read it
            wo[a:k_idx] = randn(k_idx - a, q_rows, std=q_rows ** -0.5)
            w_down[a:k_idx] = randn(k_idx - a, f, std=f ** -0.5)
        layers.append(LayerWeights(
            attn_norm=norm, wq=wq.contiguous(), wk=wk.contiguous(), wv=wv.contiguous(),
            wo=wo.contiguous(), ffn_norm=norm, w_gate=randn(f, h, std=h ** -0.5),
            w_up=randn(f, h, std=h ** -0.5), w_down=w_down.contiguous()))
    final_norm = torch.zeros(h)
    final_norm[:a] = FINAL_NORM
    return LlamaWeights(config=c, embed=embed.contiguous(), layers=tuple(layers),
                        final_norm=final_norm)


def is_tiny(weights: LlamaWeights) -> bool:
    return weights.config == CONFIG


def model_spec(weights: LlamaWeights):
    """The pool's :class:`ModelSpec` of ``weights`` (the tiny model or SmolLM2)."""
    return weights.config.to_model_spec(NAME if is_tiny(weights) else "smollm2-135m")


def pool_bytes(weights: LlamaWeights, segment_tokens: int, slots: int) -> int:
    """Bytes of a pool instance holding ``slots`` float32 segments of ``segment_tokens``
    tokens of ``weights``' model (twice as many in a half-precision pool). Tests that
    rely on a pool filling up size it in segments, not bytes: a byte size that held a
    few SmolLM2 segments holds ~150x as many of the tiny model."""
    return slots * model_spec(weights).segment_bytes(segment_tokens)


def check_margins(result: GenerationResult, min_margin: float = MIN_MARGIN) -> None:
    """Raises ``AssertionError`` where a step's top-1 logit leads the top-2 by less than
    ``min_margin`` times the step's largest logit magnitude."""
    for step, logits in enumerate(result.logits):
        top = logits.topk(2).values
        margin = (top[0] - top[1]).item() / logits.abs().max().item()
        assert margin >= min_margin, (
            f"near tie at step {step}: top-1 leads top-2 by {margin:.2e} of the largest "
            f"logit (< {min_margin:g}); choose prompts (or a seed) without one")


class CachedReference:
    """:class:`ReferenceEngine` whose ``generate`` answers are kept per (prompt, stop ids)
    and computed once per process: a shorter request is a prefix of a longer one's
    answer (greedy steps are the same computation), so it is cut from it. With
    ``min_margin`` every answer is checked by :func:`check_margins` first.
    Results are shared: do not modify them."""

    def __init__(self, weights: LlamaWeights, kv_dtype: torch.dtype = torch.float32,
                 min_margin: float | None = None) -> None:
        self.engine = ReferenceEngine(weights, kv_dtype)
        self.weights, self.kv_dtype, self.min_margin = weights, kv_dtype, min_margin
        self._answers: dict[tuple, GenerationResult] = {}
        self.computed = 0  # answers generated (not cut from a kept one)

    def __getattr__(self, name: str):  # prefill, decode_step, ... of the engine
        return getattr(self.engine, name)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 stop_ids: Sequence[int] | None = None) -> GenerationResult:
        stops = None if stop_ids is None else tuple(sorted({int(s) for s in stop_ids}))
        key = (tuple(int(t) for t in prompt_ids), stops)
        kept = self._answers.get(key)
        if kept is None or (len(kept.output_ids) < max_new_tokens and not kept.stopped):
            kept = self.engine.generate(list(key[0]), max_new_tokens, stop_ids=stop_ids)
            self.computed += 1
            if self.min_margin is not None:
                check_margins(kept, self.min_margin)
            self._answers[key] = kept
        if len(kept.output_ids) <= max_new_tokens:
            return kept
        return GenerationResult(kept.output_ids[:max_new_tokens], kept.logits[:max_new_tokens], False)


_references: dict[tuple[int, torch.dtype], tuple[LlamaWeights, CachedReference]] = {}


def reference(weights: LlamaWeights, kv_dtype: torch.dtype = torch.float32) -> CachedReference:
    """The process's :class:`CachedReference` of ``weights`` and ``kv_dtype`` (answers are
    shared by every test module); the tiny model's answers are checked for margins."""
    key = (id(weights), kv_dtype)
    if key not in _references:
        _references[key] = (weights, CachedReference(
            weights, kv_dtype, MIN_MARGIN if is_tiny(weights) else None))
    return _references[key][1]
