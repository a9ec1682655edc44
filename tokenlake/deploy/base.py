"""What both launchers share: the buffer layout of an instance, the control plane, and
what the driver asks of the engines (segment copies, stats).

:class:`~tokenlake.deploy.local.LocalCluster` (engines as processes of this machine) and
:class:`~tokenlake.deploy.ray.RayCluster` (engines as Ray actors) differ only in how
engines are started, reached and stopped. An instance's buffers and their shapes, how
a replication or a migration runs and how the control plane follows it: written once.

Importing this module loads no torch (the Ray driver and its host actors import it):
the wire messages, which do, are imported where a message is built.
"""

from __future__ import annotations

import abc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from tokenlake.core.control import pool_control
from tokenlake.core.errors import ConfigError, EngineUnavailable
from tokenlake.core.specs import ModelSpec
from tokenlake.dataplane.doorbell import BELL_BYTES
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.deploy.config import ClusterConfig
from tokenlake.deploy.roles import ENGINE_ROLES

if TYPE_CHECKING:
    from typing import Self

    from tokenlake.core.replication import Replication
    from tokenlake.dataplane.messages import Pong, WireMessage

log = logging.getLogger(__name__)

#: The reply class a request expects (a :class:`~tokenlake.dataplane.messages.WireMessage`).
Reply = TypeVar("Reply", bound="WireMessage")

#: dtype of the buffers the compute and query engines exchange rows and partial results
#: in (q, out_o, out_lse): attention math is float32; slab and kv hold the ``kv_dtype``.
BUFFER_DTYPE = "float32"
#: The buffers each engine role maps (its instance's slab, and its compute engine's
#: home buffers: q rows and partial outputs for a query engine, new KV for a transfer one).
ENGINE_BUFFERS: dict[str, tuple[str, ...]] = {
    "query": ("slab", "q", "out_o", "out_lse", "bell"),
    "transfer": ("slab", "kv", "bell"),
}
#: The buffers an instance's client (its compute engine) maps.
CLIENT_BUFFERS = ("q", "out_o", "out_lse", "kv", "bell")


@dataclass(frozen=True)
class BufferLayout:
    """The shared buffers of one instance: names and shapes, C-contiguous; ``slab`` and
    ``kv`` in ``kv_dtype`` (a key of :data:`~tokenlake.core.control.KV_DTYPES`), the
    rest ``BUFFER_DTYPE`` (float32). ``R`` is ``max_rows``, the tokens of one sub-batch.

    ========= =============================================== ==========================
    name      shape                                           holds
    ========= =============================================== ==========================
    slab      [slots, layers, 2, kv_heads, C, head_dim]        the instance's segments (K, V)
    q         [R, q_heads, head_dim]                          query rows of a sub-batch
    out_o     [R, q_heads, head_dim]                          its partial attention output
    out_lse   [R, q_heads]                                    natural-log LSE of ``out_o``
    kv        [layers, R, 2, kv_heads, head_dim]              new K and V to put
    records   [slots, record bytes] (uint8; CPU pools only)   what each slot holds (a restart
                                                              adopts it: deploy/records.py)
    bell      [BELL_BYTES] (uint8; host memory)               per-layer hand-offs of q, out
                                                              and kv (dataplane/doorbell.py)
    ========= =============================================== ==========================
    """

    model: ModelSpec
    slots: int  # segments per slab
    segment_tokens: int  # C
    max_rows: int  # R
    kv_dtype: str = "float32"
    device: str = "cpu"  # "cuda" / "cuda:N": every buffer on the GPU, shared by CUDA IPC
    gpus: int = 1  # "cuda" over several GPUs: instance i's buffers on cuda:(i % gpus)

    def dtype(self, name: str) -> str:
        """The element type of buffer ``name``."""
        if name in ("records", "bell"):
            return "uint8"
        return self.kv_dtype if name in ("slab", "kv") else BUFFER_DTYPE

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` in creation order (slab first)."""
        from tokenlake.deploy.records import record_bytes

        m, rows = self.model, self.max_rows
        shapes = {
            "slab": (self.slots, m.num_layers, 2, m.num_kv_heads, self.segment_tokens, m.head_dim),
            "q": (rows, m.num_q_heads, m.head_dim),
            "out_o": (rows, m.num_q_heads, m.head_dim),
            "out_lse": (rows, m.num_q_heads),
            "kv": (m.num_layers, rows, 2, m.num_kv_heads, m.head_dim),
            "bell": (BELL_BYTES,),
        }
        if self.device == "cpu":  # a CUDA pool dies with its creator: nothing to adopt
            shapes["records"] = (self.slots, record_bytes(self.segment_tokens))
        return shapes

    def specs(self, prefix: str, instance: int) -> dict[str, BufferSpec]:
        """``{name: spec}`` of ``instance``'s buffers, named ``<prefix><name>-<instance>``
        (``prefix`` is a cluster prefix of :func:`tokenlake.dataplane.shm_files.cluster_prefix`)."""
        return {name: BufferSpec(f"{prefix}{name}-{instance}", shape, self.dtype(name),
                                 self.device_of(name, instance)) for name, shape in self.shapes().items()}

    def device_of(self, name: str, instance: int = 0) -> str:
        """Where ``instance``'s buffer ``name`` lives: the pool's device (its instance's
        GPU where the pool spreads over ``gpus``), but a bell is host memory."""
        if name == "bell":
            return "cpu"
        return f"cuda:{instance % self.gpus}" if self.gpus > 1 else self.device

    def session_specs(self, prefix: str, session: int, instance: int) -> dict[str, BufferSpec]:
        """``{name: spec}`` of a client session's own buffers on ``instance`` (the
        :data:`CLIENT_BUFFERS`, shaped as the instance's), named
        ``<prefix>s<session>-<name>-<instance>``: under the cluster's prefix, so whatever
        unlinks the cluster's buffers unlinks them too."""
        shapes = self.shapes()
        return {name: BufferSpec(f"{prefix}s{session}-{name}-{instance}", shapes[name], self.dtype(name),
                                 self.device_of(name, instance)) for name in CLIENT_BUFFERS}


class ClusterBase(abc.ABC):
    """The driver of N instances' engines: the control plane, the buffer layout, and the
    requests the driver sends to engines. Subclasses start, reach and stop the engines.

    Args:
        config: the pool's settings (:class:`~tokenlake.deploy.config.ClusterConfig`,
            validated when built), kept as :attr:`config`; what the launchers and their
            users read of it is also an attribute (``n_instances``, ``model``,
            ``pool_bytes``, ``segment_tokens``, ``max_rows``, ``kv_dtype``,
            ``kv_layout``, ``timeout_s``, ``peer_timeout_s``, ``start_timeout_s``,
            ``host``, ``insecure``, and ``share_slabs`` as honoured).
        clock: the control plane's injected clock (seconds).

    A launcher says what it can do: ``shares_slabs`` (a class attribute: it runs every
    instance on one machine, so ``config.share_slabs`` is honoured on a CPU pool) and
    :meth:`default_start_timeout_s` (the limit of a start-up when
    ``config.start_timeout_s`` is ``None``). Unless ``config.insecure``, the cluster
    generates its CURVE keys (:attr:`keys`); a ``host`` beyond loopback without them is
    logged as a warning.
    """

    #: whether this launcher can map every slab in every engine (one machine)
    shares_slabs: ClassVar[bool] = False

    def __init__(self, config: ClusterConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        from tokenlake.dataplane.auth import ClusterKeys  # zmq only, no torch

        if not isinstance(config, ClusterConfig):
            raise TypeError(f"config must be a ClusterConfig, got {type(config).__name__}")
        gpus = 1
        if config.device != "cpu":  # this machine's, not the config's
            from tokenlake.deploy.gpu import gpu_setup, gpus_for

            gpus = min(gpus_for(config.device), config.instances)
            log.info("GPU pool on %s%s: %s", config.device, f" ({gpus} GPUs)" * (gpus > 1), gpu_setup()["summary"])
        #: the pool's settings, as given
        self.config = config
        #: whether the engines map each other's slabs: asked, offered and a CPU pool
        self.share_slabs = config.share_slabs and self.shares_slabs and config.device == "cpu"
        self.control = pool_control(config.instances, config.model, config.pool_bytes, config.segment_tokens,
                                    config.kv_dtype, clock, config.seed, config.kv_layout, config.page_tokens,
                                    self.share_slabs, config.tier_bytes)
        if config.tier_bytes:
            from tokenlake.deploy.tier import TierDriver

            self.control.tier_data_plane = TierDriver(self)
        self.n_instances, self.model, self.max_rows = config.instances, config.model, config.max_rows
        self.segment_tokens, self.kv_dtype, self.kv_layout = config.segment_tokens, config.kv_dtype, config.kv_layout
        self.pool_bytes = config.pool_bytes
        self.slots_per_instance = self.control.config.slots_per_instance
        self.layout = BufferLayout(config.model, self.slots_per_instance, config.segment_tokens,
                                   config.max_rows, config.kv_dtype, config.device, gpus)
        from tokenlake.deploy.records import RecordTables  # numpy, no torch

        #: each instance's slot records, written as the tree changes (tables attached by
        #: the launcher that can map them): what a restart adopts (docs/design.md §5)
        self.records = RecordTables(config.segment_tokens, self.control.pool.hasher.root, clock)
        self.control.pool.tree.journal = self.records
        self.timeout_s, self.peer_timeout_s = config.timeout_s, config.peer_timeout_s
        start_timeout_s = config.start_timeout_s
        self.start_timeout_s = self.default_start_timeout_s(config) if start_timeout_s is None else start_timeout_s
        self.host, self.insecure = config.host, config.insecure
        #: the cluster's CURVE keys (all of them: this process is the owner); None if insecure
        self.keys: ClusterKeys | None = None if config.insecure else ClusterKeys.generate()
        #: what the control server signs client sessions' plans and leases with (the
        #: engines check them: tokenlake.dataplane.grants); never given to members
        self.grant_key: bytes = os.urandom(32)
        self._ctx: Any = None  # the driver's zmq context: set by start(), cleared by close()
        # (session token, instance) -> (session number, its buffers' spec dicts): the
        # client sessions whose buffers this launcher made (re-opened on a restarted instance)
        self._sessions: dict[tuple[bytes, int], tuple[int, dict[str, dict]]] = {}

    @classmethod
    def default_start_timeout_s(cls, config: ClusterConfig) -> float:
        """The start-up limit when ``config.start_timeout_s`` is ``None``: 60 s, or 900 s
        for a GPU pool, whose query engines compile FlashInfer's kernels on a machine's
        first use."""
        return 60.0 if config.device == "cpu" else 900.0

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def start(self) -> None:
        """Creates the buffers and starts the engines; returns when they serve."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops every engine and unlinks every shared buffer (idempotent)."""

    def _stop_tier_fencing(self) -> None:
        """Stops the tier driver's fencing thread (before the sockets it uses close)."""
        close = getattr(self.control.tier_data_plane, "close", None)
        if close is not None:
            close()

    def adopt_tiers(self) -> int:
        """Gives the control plane what the instances' disk tiers already hold (a pool
        started again on its tier directory); returns the segments adopted."""
        driver = self.control.tier_data_plane
        if driver is None:
            return 0
        n = driver.adopt(range(self.n_instances))
        if n:
            log.info("adopted %d segments from the disk tiers", n)
        return n

    # ------------------------------------------------------------ engines
    @abc.abstractmethod
    def client(self, instance: int) -> Any:
        """The data-plane client (:class:`~tokenlake.dataplane.client.InstanceClient`)
        of ``instance``."""

    @abc.abstractmethod
    def slab(self, instance: int) -> Any:
        """The driver's view (a torch tensor) of an instance's slab."""

    @abc.abstractmethod
    def alive(self, role: str, instance: int) -> bool:
        """Whether the ``role`` engine of ``instance`` is running."""

    @abc.abstractmethod
    def kill(self, role: str, instance: int) -> None:
        """Kills one engine (fault injection); returns once it is gone."""

    @abc.abstractmethod
    def _live_engines(self) -> list[tuple[str, int]]:
        """``(role, instance)`` of every engine that is running now."""

    @abc.abstractmethod
    def _request(self, key: tuple[str, int], message: WireMessage, reply: type[Reply]) -> Reply:
        """Sends ``message`` to the engine ``key`` and returns its answer as a ``reply``
        (:func:`tokenlake.dataplane.messages.expect`: an ``ERROR`` raises its typed
        exception, another kind ``WireError``); ``EngineUnavailable`` when it does not
        answer within ``timeout_s``."""

    def _tier_request(self, key: tuple[str, int], message: WireMessage, reply: type[Reply],
                      channel: str = "reads") -> Reply:
        """A tier read or fence (``channel``): :meth:`_request`, or on sockets of its own
        per channel where a launcher has them."""
        return self._request(key, message, reply)

    def _request_all(self, keys: list[tuple[str, int]], message: WireMessage,
                     reply: type[Reply]) -> dict[tuple[str, int], Reply]:
        """The same request to several engines: ``{key: reply}``. Here one after the
        other, the first failure raised; a launcher may send them at once."""
        return {key: self._request(key, message, reply) for key in keys}

    def _request_each(self, keys: list[tuple[str, int]], message: WireMessage,
                      reply: type[Reply]) -> dict[tuple[str, int], Reply | BaseException]:
        """The same request to several engines: ``{key: reply or its failure}`` (nothing
        raised). Here one after the other; a launcher may send them at once."""
        out: dict[tuple[str, int], Reply | BaseException] = {}
        for key in keys:
            try:
                out[key] = self._request(key, message, reply)
            except Exception as exc:  # noqa: BLE001 - the caller decides
                out[key] = exc
        return out

    def _check_started(self) -> None:
        """Raises ``ConfigError`` unless :meth:`start` has run and :meth:`close` has not."""
        if self._ctx is None:
            raise ConfigError("the cluster is not running; use it as a context manager")

    # ------------------------------------------------------------ client sessions
    @abc.abstractmethod
    def _make_session_buffers(self, session: int, instance: int) -> dict[str, BufferSpec]:
        """Creates a session's :data:`CLIENT_BUFFERS` on ``instance``'s machine
        (:meth:`BufferLayout.session_specs`); returns their specs."""

    @abc.abstractmethod
    def _drop_session_buffers(self, session: int, instance: int) -> None:
        """Unlinks what :meth:`_make_session_buffers` made (idempotent)."""

    @abc.abstractmethod
    def _engine_endpoints(self, instance: int) -> dict[str, str]:
        """``{role: endpoint}`` of ``instance``'s engines."""

    def open_session(self, token: bytes, session: int, instance: int) -> dict[str, Any]:
        """Gives client session ``session`` (token ``token``, the routing id of its
        sockets) its own buffers on ``instance`` and registers them with the instance's
        engines (``OPEN_SESSION``); returns what the session's client needs, as
        :meth:`client_info` does for the owner's: ``{"instance", "endpoints", "buffers",
        "timeout_s", "keys", "slab"}`` with the member's CURVE keys and
        :meth:`mappable_slab`. Idempotent per instance."""
        self._check_started()
        if instance not in self.control.instances:
            raise ConfigError(f"no instance {instance} in the pool")
        dead = [role for role in ENGINE_BUFFERS if not self.alive(role, instance)]
        if dead:  # do not wait out a timeout for an engine known to be gone
            raise EngineUnavailable(f"the {dead[0]} engine of instance {instance} is not running")
        known = self._sessions.get((token, instance))
        if known is None:
            specs = self._make_session_buffers(session, instance)
            try:
                self._open_on_engines(token, instance, specs)
            except BaseException:
                self._drop_session_buffers(session, instance)
                raise
            known = self._sessions[(token, instance)] = (session, {n: s.to_dict() for n, s in specs.items()})
        return {"instance": instance, "endpoints": self._engine_endpoints(instance),
                "buffers": dict(known[1]), "timeout_s": self.timeout_s,
                "keys": None if self.keys is None else self.keys.member_view().to_dict(),
                "slab": self.mappable_slab(instance)}

    def mappable_slab(self, instance: int) -> dict | None:
        """The spec (plain data) of ``instance``'s slab when a client on the pool's
        machine can map it (POSIX shared memory) and read its leased slots in place
        instead of asking the transfer engine (vLLM's load mode); ``None`` where it
        cannot. None by default: Ray's instances may be on another node than the client
        (:class:`~tokenlake.deploy.local.LocalCluster` offers its CPU slabs)."""
        return None

    def _open_on_engines(self, token: bytes, instance: int, specs: dict[str, BufferSpec]) -> None:
        from tokenlake.dataplane.messages import Ack, OpenSession

        for role, names in ENGINE_BUFFERS.items():
            mine = {n: specs[n] for n in names if n != "slab"}
            self._request((role, instance), OpenSession(token, mine), Ack)

    def close_session(self, token: bytes) -> None:
        """Ends a client session on every instance it has buffers on: its engines drop
        its plans and answer once nothing it started is still running there
        (``CLOSE_SESSION``), then its buffers are unlinked. An engine that does not
        answer (dead) is skipped: its replacement never knew the session."""
        from tokenlake.dataplane.messages import Ack, CloseSession

        for (tok, instance), (session, _specs) in list(self._sessions.items()):
            if tok != token:
                continue
            for role in ENGINE_BUFFERS:
                try:
                    self._request((role, instance), CloseSession(token), Ack)
                except Exception as exc:  # noqa: BLE001 - a dead or removed engine holds nothing
                    log.warning("closing a session on the %s engine of instance %d: %s", role, instance, exc)
            self._drop_session_buffers(session, instance)
            del self._sessions[(tok, instance)]

    def retire(self, token: bytes, instances, grant_ids: tuple[int, ...]) -> None:
        """Spends grants of client session ``token`` on the engines of ``instances``
        (``RETIRE``): their plans go, and the engines refuse those grants from now on;
        returns once they answered (an engine that does not, dead, is skipped)."""
        from tokenlake.dataplane.messages import Ack, Retire

        keys = [(role, inst) for inst in instances if (token, inst) in self._sessions for role in ENGINE_ROLES]
        for key, answer in self._request_each(keys, Retire(token, tuple(grant_ids)), Ack).items():
            if isinstance(answer, BaseException):  # a dead engine holds no plan
                log.warning("retiring grants on the %s engine of instance %d: %s", *key, answer)

    def _reopen_sessions(self, instance: int) -> None:
        """Registers the sessions that had buffers on ``instance`` with its new engines
        (after a restart: the buffers outlived the old engines)."""
        for (token, inst), (_session, specs) in list(self._sessions.items()):
            if inst == instance:
                self._open_on_engines(token, instance, {n: BufferSpec.from_dict(d) for n, d in specs.items()})

    # ------------------------------------------------------------ the driver's requests
    def engine_stats(self) -> dict[tuple[str, int], Pong]:
        """Pings every live engine; returns its answer (``EngineLoop.stats``: role,
        instance, bytes copied, requests served, busy seconds)."""
        from tokenlake.dataplane.messages import Ping, Pong  # imports torch: only once asked

        return self._request_all(self._live_engines(), Ping(), Pong)

    def migrate(self, key: bytes, target: int) -> None:
        """Moves a segment to ``target``: one contiguous copy, then the source replica is
        dropped and its slot freed (a freed slot needs no data operation)."""
        rep = self.control.start_replication(key, target)
        self.replicate([rep])
        self.control.drop_replica(key, rep.source.instance)

    def replicate(self, reps: list[Replication]) -> None:
        """Copies each replication's segment (one contiguous slab block, transfer engine
        to transfer engine) and commits it; a failed copy is rolled back in the control
        plane and re-raised."""
        from tokenlake.dataplane.messages import CopyDone, CopySegment  # imports torch (see above)

        for rep in reps:
            copy = CopySegment(rep.source.slot, rep.target.instance, rep.target.slot)
            try:
                self._request(("transfer", rep.source.instance), copy, CopyDone)
            except BaseException:
                self.control.abort_replication(rep)
                raise
            self.control.finish_replication(rep)
