"""What an engine process is told at start-up (:class:`EngineSpec`): its role, instance,
shared buffers, address, peers' limits and keys. Sent to it as msgpack; the engines
themselves are :mod:`tokenlake.engines.loop`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from tokenlake.core.control import check_bf16_products
from tokenlake.core.errors import ConfigError
from tokenlake.dataplane.auth import ClusterKeys

ROLES = ("query", "transfer")


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine process needs, sent to it as msgpack at start-up.

    Attributes:
        role: ``"query"`` or ``"transfer"``.
        instance: instance id.
        cluster_id: unique id of the cluster (names of shared buffers).
        buffers: name -> :class:`tokenlake.dataplane.shm.BufferSpec` dict of the shared buffers
            this engine maps: ``slab`` always; the home buffers of its instance's compute
            engine (``q``, ``out_o``, ``out_lse`` for a query engine, ``kv`` for a
            transfer engine).
        host: interface to bind (loopback unless configured).
        peer_timeout_s: how long to wait for a peer engine before failing the request.
        torch_threads: intra-op threads of torch in this process.
        port_range: ``(first, last)`` ports to bind (the first free one, inclusive
            bounds); ``None`` binds any free port.
        owner_pid: the launcher's process: once it is gone (killed with ``kill -9``,
            say) the engine stops within ``tick_s`` and unlinks its cluster's buffers;
            ``None``: no owner to watch (Ray watches its actors' owners itself).
        keys: the cluster's CURVE keys as the engine holds them
            (:meth:`tokenlake.dataplane.auth.ClusterKeys.engine_view`, as a dict);
            ``None``: no CURVE (the launcher was told ``insecure``).
        shared_slabs: instance -> BufferSpec dict of the slabs of other instances on
            this machine that this engine maps: a query engine attends their slots
            itself instead of asking their query engines, a transfer engine copies
            segments straight into them (docs/data-plane.md "Co-located slabs"); empty:
            everything between instances goes by message.
        orphan_grace_s: how long the engine waits, once its owner is gone, for a new
            control process to adopt it (``ADOPT``) with its slab intact; 0: it stops at
            once and unlinks its cluster's buffers (docs/design.md §4 "Restart").
        state_file: the pool's state file (:mod:`tokenlake.dataplane.pool_state`),
            removed with the files it names when the grace ends unadopted.
        grant_key: the key the control server signs client sessions' plans and leases
            with (:mod:`tokenlake.dataplane.grants`); ``None``: a client session's plans
            are taken without a grant (a launcher that makes no key).
        tier_path: a transfer engine's disk tier directory (this instance's own);
            ``None``: its tier, if any, is in host memory. ``tier_bytes``: what the
            tier may take (its files, or its host memory); 0: no tier. ``tier_fsync``:
            flush each file to the disk before it counts (off only in tests).
            ``tier_write_bw``: bytes a second the disk tier's writer may write (0:
            unbounded).
        bf16_products: a query engine's bfloat16 products on the attention kernel's
            dot path (``native.use_bf16_products``: q's parts, 0 exact products).
    """

    role: str
    instance: int
    cluster_id: str
    buffers: dict[str, dict[str, Any]]
    host: str = "127.0.0.1"
    peer_timeout_s: float = 2.0
    torch_threads: int = 1
    port_range: tuple[int, int] | None = None
    owner_pid: int | None = None
    keys: dict[str, Any] | None = None
    shared_slabs: dict[int, dict[str, Any]] = field(default_factory=dict)
    grant_key: bytes | None = None
    orphan_grace_s: float = 0.0
    state_file: str | None = None
    tier_path: str | None = None
    tier_bytes: int = 0
    tier_fsync: bool = True
    tier_write_bw: int = 0
    bf16_products: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.instance in self.shared_slabs:
            raise ConfigError("shared_slabs names other instances' slabs, not this one's")
        if "slab" not in self.buffers:
            raise ConfigError("an engine needs its instance's slab")
        if self.peer_timeout_s <= 0:
            raise ConfigError("peer_timeout_s must be > 0")
        if not self.orphan_grace_s >= 0:
            raise ConfigError(f"orphan_grace_s must be >= 0, got {self.orphan_grace_s}")
        if (self.tier_path is not None or self.tier_bytes) and (self.role != "transfer" or self.tier_bytes <= 0):
            raise ConfigError("a tier is a transfer engine's, with tier_bytes > 0")
        if self.port_range is not None:
            lo, hi = self.port_range  # msgpack gives a list
            object.__setattr__(self, "port_range", (int(lo), int(hi)))
            if not 1 <= lo <= hi <= 65535:
                raise ConfigError(f"port_range must be 1 <= first <= last <= 65535, got {self.port_range}")
        if self.keys is not None:
            ClusterKeys.from_dict(self.keys)  # refuses malformed keys here, not at bind
        if self.grant_key is not None and (not isinstance(self.grant_key, bytes) or len(self.grant_key) < 16):
            raise ConfigError("grant_key must be at least 16 bytes")
        check_bf16_products(self.bf16_products)

    def apply_to_process(self) -> None:
        """The engine process's torch threads and attention-kernel settings, as given."""
        import torch

        torch.set_num_threads(self.torch_threads)
        if self.bf16_products:
            from tokenlake.kernels import native

            native.use_bf16_products_if_built(self.bf16_products)

    def to_bytes(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def from_bytes(cls, raw: bytes) -> EngineSpec:
        return cls(**msgpack.unpackb(raw, strict_map_key=False))
