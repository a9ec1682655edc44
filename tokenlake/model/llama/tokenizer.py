"""SmolLM2's tokenizer and chat template, built from the GGUF file alone (no network).

The GGUF holds a GPT-2 style byte-level BPE (``tokenizer.ggml.model == "gpt2"``): the
vocabulary ``tokenizer.ggml.tokens`` (byte-level strings, id = position), the ranked
``tokenizer.ggml.merges`` (``"a b"``) and ``tokenizer.ggml.token_type`` (3 = control:
``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2 and 14 more). Its pre-tokenizer
``smollm`` is, in llama.cpp, the regex pair ``\\p{N}`` (every digit alone) then the GPT-2
split; here that is ``Digits(individual_digits=True)`` followed by ``ByteLevel`` with the
GPT-2 regex and no prefix space. ``add_bos_token`` is false, so nothing is prepended.

Control tokens are matched as single ids wherever their text appears in
:meth:`ChatTokenizer.encode` input (as llama.cpp with ``parse_special`` and the Hugging
Face tokenizer do); :meth:`ChatTokenizer.encode_text` never matches them.

Building the tokenizer needs the GGUF metadata (a ~4 s parse), so the built tokenizer
and the chat metadata are cached as JSON next to the cached weights
(:func:`tokenlake.model.llama.weights.cache_file`; unreadable files are rebuilt).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tokenlake.core.errors import ConfigError
from tokenlake.model.llama.weights import (
    cache_file,
    find_smollm2_gguf,
    open_reader,
    write_cache_atomically,
)

_CACHE_KIND = "tok1.json"
_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED = 4
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# What tokenizer.chat_template inserts when the first message is not a system message
# (copied from the template text; note: no final full stop).
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _build_plain(tokens: Sequence[str], merges: Sequence[str]) -> Tokenizer:
    """Byte-level BPE with the ``smollm`` pre-tokenizer and no added tokens."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _read_gguf(path: Path) -> dict:
    """The tokenizer data of the GGUF, as the JSON-able dict that is cached."""
    reader = open_reader(path)

    def get(key: str):
        field = reader.fields.get(key)
        if field is None:
            raise ConfigError(f"GGUF metadata key {key!r} is missing")
        return field.contents()

    if get("tokenizer.ggml.model") != "gpt2":
        raise ConfigError(f"expected a gpt2 (byte-level BPE) tokenizer, got "
                          f"{get('tokenizer.ggml.model')!r}")
    tokens, types = list(get("tokenizer.ggml.tokens")), list(get("tokenizer.ggml.token_type"))
    plain = _build_plain(tokens, list(get("tokenizer.ggml.merges")))
    special = [(i, t) for i, (t, kind) in enumerate(zip(tokens, types))
               if kind in (_CONTROL, _USER_DEFINED)]
    return {"plain": plain.to_str(), "special": special,
            "chat_template": get("tokenizer.chat_template"),
            "eos_id": int(get("tokenizer.ggml.eos_token_id")),
            "bos_id": int(get("tokenizer.ggml.bos_token_id")),
            "pre": get("tokenizer.ggml.pre"), "vocab_size": len(tokens)}


def _load_data(path: Path, use_cache: bool) -> dict:
    target = cache_file(path, _CACHE_KIND) if use_cache else None
    if target is not None and target.is_file():
        try:
            data = json.loads(target.read_text(encoding="utf-8"))
            if {"plain", "special", "chat_template", "eos_id", "vocab_size"} <= set(data):
                return data
        except (OSError, ValueError):
            pass  # unreadable cache: rebuild below
    data = _read_gguf(path)
    if target is not None:
        write_cache_atomically(target, lambda tmp: tmp.write_text(json.dumps(data),
                                                                  encoding="utf-8"))
    return data


class ChatTokenizer:
    """Encode/decode and the ChatML chat template of SmolLM2-135M-Instruct.

    ``eos_id`` (``<|im_end|>``, 2), ``im_start_id`` (1), ``im_end_id`` (2),
    ``vocab_size`` (49,152), ``chat_template`` (the GGUF's Jinja text, for reference).
    """

    def __init__(self, data: Mapping) -> None:
        self._plain = Tokenizer.from_str(data["plain"])
        self._tok = Tokenizer.from_str(data["plain"])
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                      for _, t in data["special"]])
        for i, t in data["special"]:
            if self._tok.token_to_id(t) != i:
                raise ConfigError(f"special token {t!r} maps to {self._tok.token_to_id(t)}, "
                                  f"not {i}")
        self.special_ids = frozenset(i for i, _ in data["special"])
        self._special = tuple((int(i), str(t)) for i, t in data["special"])
        self.chat_template: str = data["chat_template"]
        self.vocab_size: int = int(data["vocab_size"])
        self.eos_id: int = int(data["eos_id"])
        self.im_start_id: int = self._id(IM_START)
        self.im_end_id: int = self._id(IM_END)

    def special_tokens(self) -> tuple[tuple[int, str], ...]:
        """``(id, text)`` of every control token."""
        return self._special

    def to_json(self) -> str:
        """The whole tokenizer (BPE, pre-tokenizer, decoder, control tokens) as a
        ``tokenizer.json`` that the ``tokenizers`` library and Hugging Face load."""
        return self._tok.to_str()

    def _id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise ConfigError(f"token {token!r} is not in the vocabulary")
        return i

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; control tokens (``<|im_start|>``, ``<|im_end|>``,
        ``<|endoftext|>``, ...) written in the text become their single ids. No BOS.
        Releases the GIL while it runs (see :func:`_encode`)."""
        return _encode(self._tok, text)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with control-token text treated as ordinary characters
        (used for message contents, so a message cannot forge the template)."""
        return _encode(self._plain, text)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; control tokens appear as their text unless
        ``skip_special_tokens``. ``decode(encode(s)) == s`` for any string."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids outside [0, {self.vocab_size}): {bad[:5]}")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The text ``tokenizer.chat_template`` renders (ChatML): a default system message
        first when ``messages[0]`` is not a system message, then
        ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
        ``<|im_start|>assistant\\n`` if ``add_generation_prompt``."""
        return "".join(_segments(messages, add_generation_prompt))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> list[int]:
        """Token ids of :meth:`render_chat`: the template's ``<|im_start|>`` /
        ``<|im_end|>`` as single ids, roles and contents via :meth:`encode_text`. Equals
        ``encode(render_chat(messages))`` whenever no content contains control-token
        text (tokenizers split at added tokens first, so the pieces are independent)."""
        ids: list[int] = []
        for piece in _segments(messages, add_generation_prompt):
            if piece == IM_START:
                ids.append(self.im_start_id)
            elif piece == IM_END:
                ids.append(self.im_end_id)
            else:
                ids += self.encode_text(piece)
        return ids


def _encode(tok: Tokenizer, text: str) -> list[int]:
    """``tok.encode(text).ids`` (no BOS), through ``encode_batch``, which releases the GIL
    while it runs where ``encode`` holds it: a server tokenizing a long prompt on a worker
    thread (0.5 s for 660,000 characters) keeps its event loop answering. The same ids."""
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


def _segments(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> list[str]:
    """The template's output as pieces, each control token a piece of its own."""
    turns = [(str(m["role"]), str(m["content"])) for m in messages]
    if turns and turns[0][0] != "system":
        turns.insert(0, ("system", DEFAULT_SYSTEM_PROMPT))
    pieces: list[str] = []
    for role, content in turns:
        pieces += [IM_START, f"{role}\n{content}", IM_END, "\n"]
    if add_generation_prompt:
        pieces += [IM_START, "assistant\n"]
    return pieces


@functools.lru_cache(maxsize=2)
def _load(path: str, use_cache: bool) -> ChatTokenizer:
    return ChatTokenizer(_load_data(Path(path), use_cache))


def load_tokenizer(path: Path | str | None = None, use_cache: bool = True) -> ChatTokenizer:
    """The :class:`ChatTokenizer` of the GGUF at ``path`` (default
    :func:`tokenlake.model.llama.weights.find_smollm2_gguf`), once per process and path."""
    resolved = find_smollm2_gguf() if path is None else Path(path)
    return _load(str(resolved.resolve()), use_cache)
