""":class:`ClusterConfig`: what every launcher needs to lay out and start a pool, as one
frozen, validated object.

Both launchers (:class:`~tokenlake.deploy.local.LocalCluster`,
:class:`~tokenlake.deploy.ray.RayCluster`) take one, and the service
(:class:`~tokenlake.service.config.ServeConfig`) carries one, so the pool's
settings cross each layer as a single value instead of a list of a dozen and a half
parameters repeated at every hop. A bad value is a
:class:`~tokenlake.core.errors.ConfigError` naming the field, raised when the object is
built, before any buffer or process exists.

What is not here belongs to one launcher or to the moment of starting: the injected
clock, ``LocalCluster``'s ``query_threads``, ``orphan_grace_s`` and ``state_file``,
``RayCluster``'s :class:`~tokenlake.deploy.ray.RayOptions`, and whether FlashInfer is
installed on this machine (checked by the launcher: a config may be built on one
machine and launched on another).

Importing this module loads no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenlake.core.config import is_device, is_int, positive_int
from tokenlake.core.control import KV_DTYPES, KV_LAYOUTS, check_bf16_products, check_kv_dtype
from tokenlake.core.errors import ConfigError
from tokenlake.core.specs import ModelSpec

#: The most arguments the old form takes by position after the instance count.
_POSITIONAL = ("model", "pool_bytes", "segment_tokens", "max_rows")


@dataclass(frozen=True)
class ClusterConfig:
    """The settings of a pool that any launcher lays out and starts.

    Attributes:
        instances: instances (each gets one query and one transfer engine).
        model: model spec (heads, head dim, layers size the buffers).
        pool_bytes: slab bytes per instance; slots = ``pool_bytes //``
            :attr:`segment_bytes` (at least one segment must fit).
        segment_tokens: ``C``, tokens per segment (64 suits small CPU models; see
            :func:`tokenlake.core.cost_model.default_segment_tokens`).
        max_rows: rows of each instance's q/out/kv buffers (tokens per sub-batch).
        seed: seed of the control plane (replica choice).
        timeout_s: wait limit of the driver and of clients for an engine's answer
            (seconds); peer_timeout_s: engine-to-engine limit (seconds).
        start_timeout_s: limit of the start-up, seconds; ``None``: the launcher's
            default (``LocalCluster``: 60 s, or 900 s for a GPU pool, whose query engines
            compile FlashInfer's kernels on a machine's first use; ``RayCluster``: 120 s,
            worker start-up and the torch import included).
        host: what the engines bind: an address (loopback by default), an interface
            name, or ``"node"`` (Ray: the node's address).
        insecure: no CURVE (docs/security.md): every socket of the cluster then accepts
            anyone who reaches it, and a ``host`` beyond loopback is logged as a warning.
            By default the cluster generates its keys and every engine, client and peer
            connection is encrypted and authenticated.
        kv_layout: whose KV the pool holds (``tokenlake.core.control.KV_LAYOUTS``; part
            of the namespace, so the layouts never match each other).
        page_tokens: granularity of prefix hits inside a segment
            (:class:`~tokenlake.core.config.PoolConfig`; ``None``: its default, 16 where
            16 divides ``C``); must divide ``segment_tokens``.
        kv_dtype: the element type of the pool's K/V (``"float32"``, ``"bfloat16"``,
            ``"float16"``): slabs, puts, replicas and migrations carry it; queries still
            send float32 q rows and get float32 partials (docs/design.md "KV dtype").
        device: where the buffers live: ``"cpu"`` (POSIX shared memory), ``"cuda"``
            (CUDA IPC, instance ``i`` on the ``i % n``-th of the ``n`` visible GPUs) or
            ``"cuda:N"`` (all on GPU N); half ``kv_dtype`` only; FlashInfer's batched
            kernels where it imports, torch's otherwise (docs/design.md "GPU path").
        share_slabs: every engine maps the other instances' slabs, where the launcher
            runs them all on one machine and the pool is on the CPU (``LocalCluster``:
            on by default; ``RayCluster`` never does, its instances may be on several
            nodes). The control plane then plans for it (``PoolConfig.shared_memory``).
        tier_bytes: what each instance's tier below its slab may hold (whole
            segments); 0: no tier. Segments are written through to it and, evicted
            from the slabs, stay there until read back (docs/design.md "Disk tier").
        tier_path: a directory for the instances' tiers on a local disk (one
            subdirectory each, ``instance-<i>``; they outlive the pool; on Ray, the
            directory of whichever node runs the instance); ``None``: the tiers are in
            the transfer engines' host memory (pinned on a GPU pool) and go with them.
        tier_write_bw: bytes a second each disk tier's writer may write (0: as fast
            as the disk takes them); what comes faster waits staged, and beyond the
            staging memory has no copy (docs/design.md "Disk tier").
        bf16_products: a bfloat16 pool's query engines, on CPUs with AVX-512 BF16 and no
            AMX, attend many grouped rows with bfloat16 products: q in this many bfloat16
            parts (1 or 2), the probabilities rounded (docs/design.md §4 "Attention
            backends", the dot path); 0: exact products. A process that attends in place (a compute
            engine) sets its own: ``native.use_bf16_products``.
    """

    instances: int
    model: ModelSpec
    pool_bytes: int
    segment_tokens: int = 64
    max_rows: int = 1024
    seed: int = 0
    timeout_s: float = 5.0
    peer_timeout_s: float = 2.0
    start_timeout_s: float | None = None
    host: str = "127.0.0.1"
    insecure: bool = False
    kv_layout: str = "tokenlake"
    page_tokens: int | None = None
    kv_dtype: str = "float32"
    device: str = "cpu"
    share_slabs: bool = True
    tier_path: str | None = None
    tier_bytes: int = 0
    tier_write_bw: int = 1 << 30
    bf16_products: int = 0

    def __post_init__(self) -> None:
        if not is_int(self.instances) or self.instances < 1:
            raise ConfigError(f"need at least one instance (instances={self.instances!r})")
        if not isinstance(self.model, ModelSpec):
            raise ConfigError(f"model must be a ModelSpec, got {type(self.model).__name__}")
        for name in ("segment_tokens", "max_rows"):
            positive_int(name, getattr(self, name))
        if self.page_tokens is not None:
            positive_int("page_tokens", self.page_tokens)
            if self.segment_tokens % self.page_tokens:
                raise ConfigError(f"page_tokens={self.page_tokens} must divide "
                                  f"segment_tokens={self.segment_tokens}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ConfigError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        check_kv_dtype(self.kv_dtype)
        check_bf16_products(self.bf16_products)
        if not is_int(self.pool_bytes) or self.pool_bytes < self.segment_bytes:
            raise ConfigError(f"pool_bytes={self.pool_bytes} holds no {self.segment_bytes}-byte segment")
        self._check_times()
        self._check_tier()
        if not isinstance(self.host, str) or not self.host or any(c.isspace() or c == "/" for c in self.host):
            raise ConfigError(f"host must be an address, an interface name or 'node', got {self.host!r}")
        if not is_device(self.device):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device != "cpu" and self.kv_dtype == "float32":
            raise ConfigError(f"device={self.device!r} needs a half kv_dtype: a GPU pool holds float16 or "
                              "bfloat16 K/V, not float32")
        for name in ("insecure", "share_slabs"):  # a 0 or 1 is taken, as bool() took it before
            value = getattr(self, name)
            if not isinstance(value, int) or value not in (0, 1):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
            object.__setattr__(self, name, bool(value))

    def _check_tier(self) -> None:
        if not is_int(self.tier_bytes) or self.tier_bytes < 0:
            raise ConfigError(f"tier_bytes must be an int >= 0, got {self.tier_bytes!r}")
        if self.tier_path is not None and (not isinstance(self.tier_path, str) or not self.tier_path):
            raise ConfigError(f"tier_path must be a directory path, got {self.tier_path!r}")
        if not is_int(self.tier_write_bw) or self.tier_write_bw < 0:
            raise ConfigError(f"tier_write_bw must be an int >= 0 (bytes a second), got {self.tier_write_bw!r}")
        if self.tier_path is not None and not self.tier_bytes:
            raise ConfigError("tier_path needs tier_bytes (what each instance's tier may hold)")
        if self.tier_bytes and self.tier_bytes < self.segment_bytes:
            raise ConfigError(f"tier_bytes={self.tier_bytes} holds no {self.segment_bytes}-byte segment")

    def _check_times(self) -> None:
        for name in ("timeout_s", "peer_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "start_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value!r}")

    @property
    def segment_bytes(self) -> int:
        """Bytes of one segment in the pool: K and V of ``segment_tokens`` tokens over all
        layers, in ``kv_dtype`` (not the model spec's own element size)."""
        m = self.model
        return m.num_layers * 2 * m.num_kv_heads * self.segment_tokens * m.head_dim * KV_DTYPES[self.kv_dtype][0]

    @property
    def slots_per_instance(self) -> int:
        """Whole segments each instance's slab holds."""
        return self.pool_bytes // self.segment_bytes

    @classmethod
    def of(cls, config: ClusterConfig | int, *args: Any, **fields: Any) -> ClusterConfig:
        """The launchers' two forms in one place: a ``ClusterConfig`` as it is (nothing
        else may come with it), or the convenience form ``(instances, model, pool_bytes,
        segment_tokens, max_rows, **fields)`` (at most those four by position, any
        field by name) built into one. ``TypeError`` for a mix or an unknown name, as a
        call with wrong arguments."""
        if isinstance(config, ClusterConfig):
            if args or fields:
                extra = ", ".join([*(repr(a) for a in args), *fields])
                raise TypeError(f"a ClusterConfig comes alone, not with {extra} "
                                "(dataclasses.replace(config, ...) changes a field)")
            return config
        if len(args) > len(_POSITIONAL):
            raise TypeError(f"after the instance count at most {', '.join(_POSITIONAL)} go by "
                            f"position; got {len(args)} (name the others)")
        return cls(config, *args, **fields)


def engine_fields(config: ClusterConfig, role: str, inst: int) -> dict:
    """The fields of an engine's ``EngineSpec`` that ``config`` decides: a transfer
    engine's tier (:func:`tokenlake.deploy.tier.tier_spec`), a query engine's bfloat16
    products."""
    from tokenlake.deploy.tier import tier_spec

    fields = tier_spec(config, role, inst)
    if role == "query" and config.bf16_products:
        fields["bf16_products"] = config.bf16_products
    return fields
