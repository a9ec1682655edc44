"""A small Llama built in code for the serving tests, and reference answers computed once.

Why: the serving tests compare every answer of the pool with :class:`ReferenceEngine`'s.
Run on SmolLM2-135M (30 layers, hidden 576) most of their time is the model's compute,
which says nothing about the pool. :func:`tiny_weights` has what matters to the pool and
the engines: grouped-query attention with three q heads per kv head (as SmolLM2's 9/3),
head_dim 64 (SmolLM2's, the CPU kernels' vector path), several layers, SmolLM2's vocab,
BOS/EOS ids and context length (so ids of the real tokenizer stay valid and its EOS stops
generation), in 3 layers of hidden size 128.

Margins. Random weights give near ties: the top two logits of a random model often lie
within float rounding of each other, and then the pool and the reference may pick
different tokens on another CPU. So the weights are built to copy: an embedding lives in
the first ``EMBED_DIMS`` coordinates of the hidden state ("A"); the layers before the last
write only into the other coordinates ("B"), so they steer what later layers attend to;
in the last layer, q head 0 (of kv head 0) attends sharply and copies the A part of the
position it attends to, with gain ``COPY_GAIN``, into A. The tied LM head then scores that
position's token far above the rest (it scores ``|e|^2`` against ``e . e'`` for others).
Which position it copies depends on every layer's attention over the whole context, so a
wrong K/V anywhere (a lost or misplaced segment, a chunk run twice) changes the tokens;
the other heads and the MLPs add smaller random terms to the logits, which the tests that
keep logits compare to 1e-4. :class:`CachedReference` checks every reference answer it
hands out: at every step the top-1 logit must lead the top-2 by at least
``MIN_MARGIN`` times the largest logit magnitude, else it raises (a near tie fails loudly
instead of flaking).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from tokenlake.model.llama.reference import GenerationResult, ReferenceEngine
from tokenlake.model.llama.weights import LayerWeights, LlamaConfig, LlamaWeights

NAME = "tiny-llama"
EMBED_DIMS = 64  # "A": where the embeddings live; the other HIDDEN - EMBED_DIMS are "B"
HIDDEN = 128
HEAD_DIM = 64
COPY_GAIN = 8.0  # the copying head's output gain (the embedding has norm sqrt(EMBED_DIMS))
QK_GAIN = 6.0  # scales q and k: scores of std ~QK_GAIN**2, so attention picks one position
FINAL_NORM = 0.25  # brings the logits to SmolLM2's range (max ~20-30)
#: Smallest accepted (top-1 - top-2) / max |logit| of a reference step of the tiny model.
#: Float32 reduction order moves the logits by ~1e-6 relative; a half-precision KV cache
#: by ~1e-3 relative.
MIN_MARGIN = 1e-2

CONFIG = LlamaConfig(
    num_layers=3, hidden_size=HIDDEN, num_q_heads=6, num_kv_heads=2, head_dim=HEAD_DIM,
    intermediate_size=128, vocab_size=49152, rope_base=100000.0, rms_eps=1e-5,
    max_context=8192, bos_id=1, eos_id=2)


def _orthogonal(gen: torch.Generator, n: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen))
    return (q * torch.sign(torch.diagonal(r))).contiguous()


@functools.lru_cache(maxsize=4)
def tiny_weights(seed: int = 0) -> LlamaWeights:
    """The tiny model's float32 weights (deterministic in ``seed``; shared, do not modify)."""
    c, a = CONFIG, EMBED_DIMS
    h, b, hd, f = c.hidden_size, c.hidden_size - a, c.head_dim, c.intermediate_size
    q_rows, kv_rows = c.num_q_heads * hd, c.num_kv_heads * hd
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    embed = torch.zeros(c.vocab_size, h)
    embed[:, :a] = randn(c.vocab_size, a)
    embed[:, :a] *= a ** 0.5 / embed[:, :a].norm(dim=1, keepdim=True)
    layers = []
    for index in range(c.num_layers):
        wv = randn(kv_rows, h, std=h ** -0.5)
        wo = torch.zeros(h, q_rows)
        w_down = torch.zeros(h, f)
        if index == c.num_layers - 1:  # copies A of the attended position into A
            rot = _orthogonal(gen, hd)
            wv[:hd] = 0.0
            wv[:hd, :a] = rot
            wo[:a] = randn(a, q_rows, std=0.5 * q_rows ** -0.5)
            wo[:a, :hd] = COPY_GAIN * rot.T
            w_down[:a] = randn(a, f, std=0.5 * f ** -0.5)
        else:  # steers later attention through B
            wo[a:] = randn(b, q_rows, std=(h / b / q_rows) ** 0.5)
            w_down[a:] = randn(b, f, std=f ** -0.5)
        layers.append(LayerWeights(
            attn_norm=torch.ones(h), wq=randn(q_rows, h, std=QK_GAIN * h ** -0.5),
            wk=randn(kv_rows, h, std=QK_GAIN * h ** -0.5), wv=wv.contiguous(),
            wo=wo.contiguous(), ffn_norm=torch.ones(h), w_gate=randn(f, h, std=h ** -0.5),
            w_up=randn(f, h, std=h ** -0.5), w_down=w_down.contiguous()))
    return LlamaWeights(config=c, embed=embed.contiguous(), layers=tuple(layers),
                        final_norm=torch.full((h,), FINAL_NORM))


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
