"""Model and hardware specifications: the inputs of the cost model, kept as data.

A :class:`ModelSpec` describes the shape of a decoder-only transformer (enough to count
KV-cache bytes and attention FLOPs); a :class:`HardwareProfile` describes one instance
(one GPU, or this CPU) by its roofline numbers. Both are frozen and validated at
construction. The shipped tables live in ``tokenlake/data/models.json`` and
``tokenlake/data/hardware.json`` and are read with :func:`load_model` /
:func:`load_hardware`.

Pure Python: importing this module imports no numpy, torch or zmq.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from functools import cache
from importlib import resources
from typing import Any

from tokenlake.core.errors import ConfigError

_FLOAT32_BYTES = 4  # partial results (o, lse) are float32 on the wire (docs/design.md §4)
_INT_FIELDS = ("num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "vocab_size", "dtype_bytes", "max_context")


def _require_positive(owner: str, **values: float) -> None:
    for key, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"{owner}.{key} must be a positive number, got {value!r}")


def _from_dict(cls: type, data: dict[str, Any], owner: str) -> Any:
    """Build a dataclass from a dict, rejecting missing and unknown keys by name."""
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    unknown = sorted(set(data) - names)
    missing = sorted(required - set(data))
    if unknown or missing:
        raise ConfigError(f"{owner}: unknown keys {unknown}, missing keys {missing}")
    return cls(**data)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer with (grouped-query) multi-head attention.

    All sizes are counts (layers, heads, elements); ``dtype_bytes`` is the size of one
    element of weights, activations and KV cache in bytes; ``num_params`` is the number
    of parameters; ``max_context`` is in tokens.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: float
    dtype_bytes: int
    max_context: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("ModelSpec.name must not be empty")
        _require_positive(
            f"ModelSpec({self.name})",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            num_params=self.num_params,
            dtype_bytes=self.dtype_bytes,
            max_context=self.max_context,
        )
        for key in _INT_FIELDS:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"ModelSpec({self.name}).{key} must be an int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(
                f"ModelSpec({self.name}): num_kv_heads={self.num_kv_heads} must divide "
                f"num_q_heads={self.num_q_heads}"
            )

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Bytes of K and V for one token in one layer (the paper's ``4d`` for fp16 MHA)."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def q_bytes_per_token_layer(self) -> int:
        """Bytes of one query row (all query heads) in one layer, in the model dtype."""
        return self.num_q_heads * self.head_dim * self.dtype_bytes

    @property
    def partial_bytes_per_token_layer(self) -> int:
        """Bytes of one returned partial result per query row and layer.

        ``o`` is float32 ``[q_heads, head_dim]`` and ``lse`` float32 ``[q_heads]``.
        """
        return self.num_q_heads * (self.head_dim + 1) * _FLOAT32_BYTES

    @property
    def attn_flops_per_query_prefix_token_layer(self) -> int:
        """FLOPs for one query row against one cached token in one layer.

        ``q.k`` and ``p.v`` are ``head_dim`` multiply-adds each, per query head:
        ``4 * q_heads * head_dim`` FLOPs (the paper's ``4d``).
        """
        return 4 * self.num_q_heads * self.head_dim

    def segment_bytes(self, segment_tokens: int) -> int:
        """Bytes of one segment of ``segment_tokens`` tokens over all layers (K and V)."""
        _require_positive(f"ModelSpec({self.name}).segment_bytes", segment_tokens=segment_tokens)
        return self.kv_bytes_per_token * segment_tokens

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (JSON-serialisable)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Inverse of :meth:`to_dict`; unknown or missing keys raise :class:`ConfigError`."""
        return _from_dict(cls, data, "ModelSpec")


@dataclass(frozen=True)
class HardwareProfile:
    """Roofline numbers of one instance.

    ``flops``: peak FLOP/s in the dtype the instance computes in (dense 16-bit on GPUs,
    float32 on the CPU); ``mem_bw``: device memory bandwidth, bytes/s; ``net_bw``:
    instance-to-instance bandwidth of one transfer, bytes/s; ``net_latency_s``: one-way
    latency of one message, seconds; ``mem_bytes``: device memory, bytes; ``notes``:
    where the numbers come from. ``shared_host``: every instance of a cluster runs on
    this one machine's cores (the ``cpu`` profile), so the instances' query engines do
    not work in parallel: the simulator adds their work up instead of waiting for the
    busiest (:mod:`evals.sim.instance_load`). ``tier_read_bw``: how fast a segment comes
    back from the instance's disk tier into its slab (read from the disk, digest
    checked), bytes/s (:mod:`tokenlake.core.tier`; the simulator charges promotions at it).
    ``host_tier_bw``: the same from a tier in host memory (over PCIe into a GPU's
    slab; one memory copy on the CPU), bytes/s.
    """

    name: str
    flops: float
    mem_bw: float
    net_bw: float
    net_latency_s: float
    mem_bytes: float
    notes: str = ""
    shared_host: bool = False
    tier_read_bw: float = 2e9
    host_tier_bw: float = 2e10

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("HardwareProfile.name must not be empty")
        _require_positive(
            f"HardwareProfile({self.name})",
            tier_read_bw=self.tier_read_bw,
            host_tier_bw=self.host_tier_bw,
            flops=self.flops,
            mem_bw=self.mem_bw,
            net_bw=self.net_bw,
            net_latency_s=self.net_latency_s,
            mem_bytes=self.mem_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (JSON-serialisable)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """Inverse of :meth:`to_dict`; unknown or missing keys raise :class:`ConfigError`."""
        return _from_dict(cls, data, "HardwareProfile")


@cache
def _read_table(filename: str) -> dict[str, dict[str, Any]]:
    """Read ``tokenlake/data/<filename>``: a JSON object mapping name -> fields."""
    text = resources.files("tokenlake").joinpath("data", filename).read_text(encoding="utf-8")
    table = json.loads(text)
    if not isinstance(table, dict):
        raise ConfigError(f"tokenlake/data/{filename} must hold a JSON object")
    return table


def _lookup(filename: str, name: str, kind: str) -> dict[str, Any]:
    table = _read_table(filename)
    if name not in table:
        raise ConfigError(f"unknown {kind} {name!r}; valid names: {', '.join(sorted(table))}")
    return {"name": name, **table[name]}


def list_models() -> list[str]:
    """Names of the shipped model specs, sorted."""
    return sorted(_read_table("models.json"))


def list_hardware() -> list[str]:
    """Names of the shipped hardware profiles, sorted."""
    return sorted(_read_table("hardware.json"))


def load_model(name: str) -> ModelSpec:
    """The shipped :class:`ModelSpec` called ``name``; unknown names raise ConfigError."""
    return ModelSpec.from_dict(_lookup("models.json", name, "model"))


def load_hardware(name: str) -> HardwareProfile:
    """The shipped :class:`HardwareProfile` called ``name``; unknown names raise ConfigError."""
    return HardwareProfile.from_dict(_lookup("hardware.json", name, "hardware"))
