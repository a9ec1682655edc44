"""``RayCluster``: the pool's engines as Ray actors, with the client API of ``LocalCluster``.

    import ray
    from tokenlake.deploy.ray import RayCluster, RayOptions

    ray.init(address="auto")
    with RayCluster(4, load_model("smollm2-135m"), pool_bytes=256 << 20,
                    options=RayOptions(host="node", strategy="STRICT_SPREAD")) as cluster:
        plans = cluster.control.gen_plans(batches, dops)
        ...                                   # exactly as with LocalCluster

Layout. One placement group with one bundle per instance (``RayOptions.strategy``:
``PACK`` by default, ``STRICT_SPREAD`` for one instance per node; a GPU per bundle with
``gpus_per_instance=1``). Each bundle holds three actors of its instance, so they share a
node:

* the **host** actor creates the instance's shared buffers (slab, q, out, kv) in that
  node's ``/dev/shm`` and unlinks them when it is closed. The driver cannot do it: shared
  memory is per node. Names carry the host's pid (``tokenlake-<pid>-<hex>-...``), so
  ``tokenlake.dataplane.shm.sweep_stale()`` run on a node removes what a killed host left there;
  the host never maps the buffers, so it stays a small process without torch;
* the **query engine** and **transfer engine** actors each run the unchanged engine loop
  (``EngineLoop.serve`` of ``query_engine/`` and ``transfer_engine/``) in a thread of the
  actor process. The actor process *is* the engine process: ``ray.kill`` of the actor
  is the death of the engine, and an engine loop that ends on its own takes the actor
  down with it (``os._exit``), so "the engine is alive" and "its process is alive" mean
  the same thing, as with ``LocalCluster``'s processes. A child process per actor was
  the alternative; it costs one more interpreter and torch import per engine, and a
  killed actor would leave its child running until the child noticed.

Addresses. Engines bind one ROUTER socket each on ``RayOptions.host`` (an IP address, an
interface name such as ``eth1``, or ``"node"``: the address Ray uses for that node),
within ``RayOptions.port_range`` when given, and report the bound endpoint to the driver,
which hands every engine the endpoints of its peers. The data plane is the same wire
protocol, peer to peer between engines and between a compute engine and its own
engines: tensors never go through Ray's object store. The driver talks to the engines
only through Ray actor calls (stats, segment copies, shutdown, peer updates), which the
actor relays to its engine over a local socket, so the driver needs no route to the
engines' ports.

Clients. A client maps its instance's ``q``/``out``/``kv`` buffers, so it must run on
that instance's node. ``client(i)`` works in the driver when the driver is on that node
(always on one machine). Otherwise run the compute engine as an actor scheduled with
``scheduling_strategy(i)`` and build its client there with :func:`open_client` from
``client_info(i)`` (plain data); see ``docs/deploy-ray.md``.

Compute engines. ``start_compute()`` (or ``RayCluster(..., compute=True)``) does that
for every instance: a :class:`ComputeActor` in the instance's bundle loads the weights
once, opens its instance's client and runs the unchanged
:class:`~tokenlake.model.compute.ComputeEngine` on the sub-batches homed there.
:class:`RayComputeEngine` (``cluster.compute_engine()``) is its driver side, with
``ComputeEngine.run``'s interface: the batches of one iteration go to their home
instances' actors in parallel (DoP 1 only for now). ``Server(cluster, weights)`` uses
it by itself when the actors are started.

Failures. A dead engine is seen by clients as :class:`EngineUnavailable` (the liveness
check compares the engine's pid and start time on the node, no Ray call on the hot
path). ``remove_instance(i)`` (or ``remove_failed()``) takes the instance out of the
data plane and the control plane (its segments leave the tree); ``restart_instance(i)``
starts it again in the same bundle with an empty slab and sends the new endpoints to
its peers (wire ``PEERS`` message), which rejoin it to the pool.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from tokenlake.core.control import pool_control
from tokenlake.core.errors import ConfigError, EngineUnavailable, PlanError, TokenLakeError
from tokenlake.core.specs import ModelSpec
from tokenlake.dataplane.shm import (
    BufferSpec,
    SegmentExists,
    SharedMemoryError,
    cluster_prefix,
    list_segments,
    new_cluster_id,
    shm_dir,
    unlink_segment,
)
from tokenlake.deploy.roles import ENGINE_ROLES, engine_class

log = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
ACTOR_ROLES = ("host", *ENGINE_ROLES)
COMPUTE_ROLE = "compute"  # the optional compute-engine actor of an instance (start_compute)
ALL_ROLES = (*ACTOR_ROLES, COMPUTE_ROLE)
_WANTED = {"query": ("slab", "q", "out_o", "out_lse"), "transfer": ("slab", "kv")}
_CLIENT_BUFFERS = ("q", "out_o", "out_lse", "kv")
_DTYPE, _DTYPE_BYTES = "float32", 4  # as LocalCluster: CPU engines compute in float32
# Shares of a bundle's resources (after engine_share) taken by each actor of an instance.
_CPU_SHARE = {"host": 0.1, "query": 0.45, "transfer": 0.45}
_GPU_SHARE = {"host": 0.0, "query": 0.5, "transfer": 0.5}


@dataclass(frozen=True)
class RayOptions:
    """Where and how :class:`RayCluster` runs on a Ray cluster.

    Attributes:
        strategy: placement-group strategy of the per-instance bundles: ``PACK`` (few
            nodes), ``SPREAD``, ``STRICT_PACK`` (one node) or ``STRICT_SPREAD`` (one
            instance per node).
        cpus_per_instance: CPUs of each instance's bundle.
        gpus_per_instance: GPUs of each instance's bundle (0 or more; 1 in the paper's
            setup). The engine actors get a share of it, so Ray sets their
            ``CUDA_VISIBLE_DEVICES``; buffers are still CPU shared memory (as in
            ``LocalCluster``) until the CUDA path is wired in.
        engine_share: fraction of each bundle the pool's three actors request; the rest
            is left for a compute-engine actor placed with
            :meth:`RayCluster.scheduling_strategy`.
        host: what the engines bind: an IP address, an interface name (``eth1``), or
            ``"node"`` (the node's address as Ray knows it). The loopback default only
            works when every instance is on one node. ``0.0.0.0`` binds every interface
            and advertises the node's address (not recommended: the protocol has no
            authentication).
        port_range: ``(first, last)``: engines bind the first free port in it (open
            these ports between nodes); ``None``: any free port.
        address: passed to ``ray.init`` when Ray is not initialised yet (``"auto"``, a
            ``host:port`` of the head, or ``None`` for a local Ray); the cluster then
            shuts Ray down again in :meth:`RayCluster.close`.
    """

    strategy: str = "PACK"
    cpus_per_instance: float = 1.0
    gpus_per_instance: int = 0
    engine_share: float = 1.0
    host: str = "127.0.0.1"
    port_range: tuple[int, int] | None = None
    address: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not self.cpus_per_instance > 0:
            raise ConfigError(f"cpus_per_instance must be > 0, got {self.cpus_per_instance!r}")
        if not isinstance(self.gpus_per_instance, int) or self.gpus_per_instance < 0:
            raise ConfigError(f"gpus_per_instance must be an int >= 0, got {self.gpus_per_instance!r}")
        if not 0 < self.engine_share <= 1:
            raise ConfigError(f"engine_share must be in (0, 1], got {self.engine_share!r}")
        if self.cpus_per_instance * self.engine_share * min(_CPU_SHARE.values()) < 0.001:
            raise ConfigError("cpus_per_instance * engine_share is too small to split over three actors")
        if not isinstance(self.host, str) or not self.host or any(c.isspace() or c == "/" for c in self.host):
            raise ConfigError(f"host must be an address, an interface name or 'node', got {self.host!r}")
        if self.port_range is not None:
            lo, hi = self.port_range
            object.__setattr__(self, "port_range", (int(lo), int(hi)))
            if not 1 <= lo <= hi <= 65535:
                raise ConfigError(f"port_range must be 1 <= first <= last <= 65535, got {self.port_range}")

    @property
    def loopback(self) -> bool:
        return self.host.startswith("127.") or self.host in ("localhost", "lo", "::1")

    def bundle(self) -> dict[str, float]:
        b = {"CPU": float(self.cpus_per_instance)}
        if self.gpus_per_instance:
            b["GPU"] = float(self.gpus_per_instance)
        return b

    def resources(self, role: str) -> dict[str, float]:
        """``num_cpus`` / ``num_gpus`` of one actor of an instance. The compute actor
        (role ``"compute"``) gets what the engines leave of the bundle, ``1 -
        engine_share`` of it (0 CPUs with the default share of 1: it still runs in the
        bundle, on the instance's node)."""
        if role == COMPUTE_ROLE:  # the rest of the bundle, after the engines' rounded shares
            engines = [self.resources(r) for r in ACTOR_ROLES]
            out = {"num_cpus": _floor4(self.cpus_per_instance - sum(r["num_cpus"] for r in engines))}
            if self.gpus_per_instance:
                gpus = _floor4(self.gpus_per_instance - sum(r.get("num_gpus", 0.0) for r in engines))
                if gpus > 0:
                    out["num_gpus"] = gpus
            return out
        share = self.engine_share
        out = {"num_cpus": round(self.cpus_per_instance * share * _CPU_SHARE[role], 4)}
        if self.gpus_per_instance and _GPU_SHARE[role]:
            out["num_gpus"] = round(self.gpus_per_instance * share * _GPU_SHARE[role], 4)
        return out


def _floor4(x: float) -> float:
    """``x`` rounded down to Ray's resource precision (1e-4), at least 0."""
    return max(0.0, math.floor(x * 10_000 + 1e-6) / 10_000)


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> list[bytes] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (None: no such process; [] without /proc)."""
    if not os.path.isdir("/proc/self"):
        return []
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, IndexError):
        return []


@dataclass(frozen=True)
class ProcessRef:
    """One actor's process: node, pid and kernel start time (so a reused pid is not
    mistaken for it). :meth:`alive` works only on ``node``."""

    node: str
    pid: int
    start: str = ""
    ip: str = ""

    @classmethod
    def this(cls) -> ProcessRef:
        stat = _proc_stat(os.getpid()) or []
        start = stat[19].decode() if len(stat) > 19 else ""
        ctx = ray.get_runtime_context()
        return cls(ctx.get_node_id(), os.getpid(), start, ray.util.get_node_ip_address())

    def alive(self) -> bool:
        stat = _proc_stat(self.pid)
        if stat is None:
            return False
        if not stat:  # no /proc: ask the kernel
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
            return True
        if stat[0] in (b"Z", b"X"):
            return False
        return not self.start or (len(stat) > 19 and stat[19].decode() == self.start)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- actors


def _create_segment(spec: BufferSpec) -> None:
    """Creates one zero-filled shared-memory file without mapping it (the host actor
    never maps its buffers; engines and clients attach by name)."""
    path = os.path.join(shm_dir(), spec.name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError as e:
        raise SegmentExists(f"shared buffer {spec.name!r} already exists") from e
    try:
        try:
            os.posix_fallocate(fd, 0, spec.nbytes)  # reserve the pages now (no SIGBUS later)
        except AttributeError:
            os.ftruncate(fd, spec.nbytes)
    except BaseException as e:
        os.close(fd)
        unlink_segment(spec.name)
        if isinstance(e, OSError):
            raise SharedMemoryError(f"cannot allocate {spec.nbytes} bytes for {spec.name!r}: {e}") from e
        raise
    os.close(fd)


def _unlink_prefix(prefix: str) -> list[str]:
    return [name for name in list_segments(prefix) if unlink_segment(name)]


class InstanceHost:
    """Owner of one instance's shared buffers on its node (runs as a Ray actor)."""

    def __init__(self, instance: int) -> None:
        self.instance = instance
        self.cluster_id = new_cluster_id()  # carries this process's pid: sweep_stale works
        self.prefix = cluster_prefix(self.cluster_id)
        self._names: list[str] = []
        atexit.register(self.close)

    def create(self, shapes: dict[str, list[int]]) -> dict[str, Any]:
        """Creates the buffers; returns their specs, the name prefix and this process."""
        specs = {}
        try:
            for name, shape in shapes.items():
                spec = BufferSpec(f"{self.prefix}{name}-{self.instance}", tuple(shape), _DTYPE)
                _create_segment(spec)
                self._names.append(spec.name)
                specs[name] = spec.to_dict()
        except BaseException:
            self.close()
            raise
        return {"buffers": specs, "prefix": self.prefix, "cluster_id": self.cluster_id,
                "proc": ProcessRef.this().to_dict()}

    def alive(self) -> bool:
        return True

    def close(self) -> int:
        """Unlinks every buffer of this host (idempotent); returns how many it removed."""
        names, self._names = self._names, []
        removed = [n for n in names if unlink_segment(n)]
        return len(removed) + len(_unlink_prefix(self.prefix))

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return f"tokenlake-host-{self.instance}"


class EngineActor:
    """One query or transfer engine: the engine loop in a thread of this actor process."""

    def __init__(self, role: str, instance: int) -> None:
        # The slow part (torch and the engine module) happens here, while the host
        # actor creates the buffers; start() then only maps them and binds.
        self.role, self.instance, self._cls = role, instance, engine_class(role)
        self.engine = None
        self.endpoint = ""
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ctl = None  # zmq context of the relay socket (actor thread only)

    def start(self, spec_bytes: bytes) -> dict[str, Any]:
        """Maps the instance's buffers (created on this node by its host) and binds the
        engine's socket; returns the endpoint peers connect to."""
        import torch

        from tokenlake.dataplane.engine import EngineSpec

        spec = EngineSpec.from_bytes(spec_bytes)
        if (spec.role, spec.instance) != (self.role, self.instance):
            raise ConfigError(f"spec of the {spec.role} engine {spec.instance} sent to {self!r}")
        if spec.host == "node":
            spec = dataclasses.replace(spec, host=ray.util.get_node_ip_address())
        torch.set_num_threads(spec.torch_threads)
        logging.basicConfig(level=logging.WARNING, format=f"[{spec.role}-{spec.instance}] %(message)s")
        self.spec = spec
        self.engine = self._cls(spec)
        endpoint = self.engine.start()
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        if host in ("0.0.0.0", "*", "[::]"):  # bound everywhere: advertise the node's address
            endpoint = f"tcp://{ray.util.get_node_ip_address()}:{port}"
        self.endpoint = endpoint
        return {"endpoint": endpoint, "proc": ProcessRef.this().to_dict()}

    def connect(self, peers: dict[int, str]) -> bool:
        """Connects to the peers of this role and starts serving."""
        self.engine.connect_peers({int(k): v for k, v in peers.items()})
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tokenlake-{self.role}-{self.instance}")
        self._thread.start()
        return True

    def _run(self) -> None:
        try:
            self.engine.serve()
        except BaseException:
            logging.getLogger(__name__).exception("engine loop failed")
        finally:
            self.engine.close()
        if not self._stopping:  # died or told to stop by someone else: the actor goes too
            logging.getLogger(__name__).error("engine loop ended; the actor exits")
            os._exit(1)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def request(self, frames: list[bytes], timeout_s: float) -> list[bytes] | None:
        """Relays one wire message to this engine over a local socket; returns the reply
        frames, or None when there was none within ``timeout_s``."""
        import zmq

        from tokenlake.dataplane import wire

        if self._ctl is None:
            self._ctl = zmq.Context()
        sock = self._ctl.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            wire.send(sock, frames, timeout_s=timeout_s)
            if not sock.poll(int(timeout_s * 1000)):
                return None
            return [bytes(f) for f in sock.recv_multipart()]
        finally:
            sock.close(0)

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Ends the engine loop (SHUTDOWN) and waits for it; True when it ended."""
        from tokenlake.dataplane import wire

        self._stopping = True
        if self.alive():
            with contextlib.suppress(Exception):
                self.request(wire.encode(wire.Kind.SHUTDOWN, 1), timeout_s)
            self._thread.join(timeout_s)
        if self._ctl is not None:
            self._ctl.term()
            self._ctl = None
        return not self.alive()

    def __repr__(self) -> str:
        return f"tokenlake-{self.role}-{self.instance}"


_HostActor = ray.remote(max_restarts=0)(InstanceHost)
_EngineActorRemote = ray.remote(max_restarts=0)(EngineActor)
_unlink_task = ray.remote(num_cpus=0, max_retries=0)(_unlink_prefix)


# --------------------------------------------------------------------------- clients


def open_client(info: dict[str, Any], ctx=None, timeout_s: float | None = None):
    """An :class:`~tokenlake.dataplane.client.InstanceClient` from :meth:`RayCluster.client_info`.

    Call it on the instance's node: in the driver when it runs there, otherwise in a
    compute-engine actor scheduled with :meth:`RayCluster.scheduling_strategy`. The
    client maps the instance's buffers and connects to its engines; it sees a dead
    engine (its pid gone on this node) as ``EngineUnavailable``. ``ctx`` is the zmq
    context (``zmq.Context.instance()`` by default); close the client when done.
    """
    import zmq

    from tokenlake.dataplane.client import InstanceClient
    from tokenlake.dataplane.shm import SharedTensor

    if ray.is_initialized() and ray.get_runtime_context().get_node_id() != info["node_id"]:
        raise ConfigError(
            f"instance {info['instance']} runs on node {info['node_id']}; its client must run "
            "there too (it maps the instance's shared memory): open it in an actor scheduled "
            "with RayCluster.scheduling_strategy(instance)"
        )
    buffers = {n: SharedTensor.attach(BufferSpec.from_dict(d)).tensor for n, d in info["buffers"].items()}
    procs = {role: ProcessRef(**info["procs"][role]) for role in ENGINE_ROLES}
    instance = info["instance"]

    def dead() -> str | None:
        for role, proc in procs.items():
            if not proc.alive():
                return f"the {role} engine of instance {instance}"
        return None

    client = InstanceClient(instance, dict(info["endpoints"]), buffers, dead,
                            info["timeout_s"] if timeout_s is None else timeout_s)
    client.start(ctx if ctx is not None else zmq.Context.instance())
    return client


# --------------------------------------------------------------------------- compute


def _cause(exc: BaseException) -> BaseException:
    """The TokenLake error an actor raised, out of Ray's wrapper (else ``exc`` itself)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, TokenLakeError) else exc


class _OwnInstance:
    """The "cluster" a compute actor's :class:`~tokenlake.model.compute.ComputeEngine` sees:
    the actor's own instance only. A sub-batch homed elsewhere is a ``PlanError`` (its
    client would map another instance's buffers, possibly on another node)."""

    def __init__(self, client) -> None:
        self._client = client

    def client(self, home: int):
        if home != self._client.instance:
            raise PlanError(f"a sub-batch homed on instance {home} was sent to the compute "
                            f"actor of instance {self._client.instance}")
        return self._client


class ComputeActor:
    """The compute engine of one instance, run as a Ray actor in the instance's bundle
    (so on the node of its buffers): the weights, loaded once, and the instance's
    client. :meth:`run` computes the sub-batches homed on this instance with the
    unchanged :class:`~tokenlake.model.compute.ComputeEngine`; the KV moves through shared
    memory and the engines' sockets, only plans, token ids and logits go through Ray."""

    def __init__(self, instance: int, weights_loader: Callable[[], Any] | None = None,
                 threads: int = 1) -> None:
        # Idle OpenMP workers that spin starve the engines on small machines (cli.py
        # sets the same); it only takes effect before torch loads OpenMP.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import torch

        if weights_loader is None:
            from tokenlake.model.llama.weights import load_weights as weights_loader
        torch.set_num_threads(max(1, int(threads)))
        self.instance = instance
        self.weights = weights_loader()
        self.client = None
        self.engine = None

    def open(self, info: dict[str, Any]) -> dict[str, Any]:
        """(Re)opens the instance's client from :meth:`RayCluster.client_info`; checks
        that the weights fit the pool's buffers. Returns this actor's process."""
        from tokenlake.model.compute import ComputeEngine

        if info["instance"] != self.instance:
            raise ConfigError(f"client_info of instance {info['instance']} sent to {self!r}")
        cfg = self.weights.config
        kv, q = info["buffers"]["kv"]["shape"], info["buffers"]["q"]["shape"]
        got = (kv[0], kv[2], kv[3], kv[4], q[1], q[2])
        want = (cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim, cfg.num_q_heads, cfg.head_dim)
        if tuple(got) != want:
            raise ConfigError(f"the weights (layers, 2, kv_heads, head_dim, q_heads, head_dim) = {want} "
                              f"do not fit instance {self.instance}'s buffers {tuple(got)}: "
                              "start the cluster with the weights' model spec")
        self.stop()
        self.client = open_client(info)
        self.engine = ComputeEngine(self.weights, _OwnInstance(self.client))
        return {"proc": ProcessRef.this().to_dict()}

    def run(self, plans, batches) -> tuple[list[str], Any, dict[str, int]]:
        """One iteration's sub-batches homed here (``plans`` number ``batches`` from 0);
        returns when their puts are stored: request ids, their last-row logits as one
        [requests, vocab] float32 numpy array, and the pool hit per request."""
        import torch

        if self.engine is None:
            raise EngineUnavailable(f"the compute actor of instance {self.instance} has no client")
        out = self.engine.run(plans, batches)
        ids = list(out.logits)
        logits = torch.stack([out.logits[r] for r in ids]).numpy() if ids else None
        return ids, logits, dict(out.prefix_tokens)

    def alive(self) -> bool:
        return True

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Closes the client (the actor is killed by the cluster afterwards)."""
        if self.client is not None:
            self.client.close()
        self.client = self.engine = None
        return True

    def __repr__(self) -> str:
        return f"tokenlake-compute-{self.instance}"


_ComputeActorRemote = ray.remote(max_restarts=0)(ComputeActor)


class RayComputeEngine:
    """Driver side of the compute actors, with the interface of
    :class:`~tokenlake.model.compute.ComputeEngine` (``run(plans, batches) ->
    IterationOutput``), so :class:`~tokenlake.serving.Server` can use either.

    Each batch goes to the compute actor of its home instance (several batches with the
    same home run there one after the other); the actors of one iteration run in
    parallel, and :meth:`run` returns when all of them are done (every put stored).

    Limits: a batch with DoP > 1 (sub-batches on several homes) is refused with a
    ``PlanError`` before anything runs: its sub-batches form one sequence-parallel
    computation, which the actors cannot split yet. Schedule with prefill DoP 1 (the
    ``Server``'s default policy does). A dead or missing compute actor is an
    ``EngineUnavailable``; so is an iteration not finished within ``timeout_s``.

    ``batches_run[i]`` counts the batches computed by instance i's actor.
    ``parallel = True`` tells the ``Server`` that batches on different instances
    compute at the same time (one batch per instance and iteration).
    """

    parallel = True

    def __init__(self, cluster: RayCluster, timeout_s: float | None = 300.0) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.batches_run: dict[int, int] = {}

    def run(self, plans, batches):
        import torch

        from tokenlake.core.plans import Plans
        from tokenlake.model.compute import IterationOutput

        homes: dict[int, set[int]] = {}
        for qp in plans.query_plans:
            homes.setdefault(qp.batch, set()).add(qp.home)
        if set(homes) != set(range(len(batches))):
            raise PlanError(f"the plans cover batches {sorted(homes)}, not the {len(batches)} given")
        for b, hs in sorted(homes.items()):
            if len(hs) > 1:
                raise PlanError(
                    f"batch {b} is spread over instances {sorted(hs)} (DoP {len(hs)}); the Ray "
                    "compute actors compute a batch on its home instance only: schedule with "
                    "DoP 1 (e.g. GoodputScheduler(max_prefill_dop=1), the Server's default)")
        if not batches:
            return IterationOutput({}, {})
        by_home: dict[int, list[int]] = {}
        for b in range(len(batches)):
            by_home.setdefault(next(iter(homes[b])), []).append(b)
        actors = {home: self.cluster.compute_actor(home) for home in by_home}  # before sending
        refs = {}
        for home, bs in by_home.items():
            local = {b: k for k, b in enumerate(bs)}  # the actor sees its batches as 0..k-1
            sub = Plans(plans.iteration,
                        tuple(dataclasses.replace(p, batch=local[p.batch]) for p in plans.query_plans
                              if p.batch in local),
                        tuple(dataclasses.replace(p, batch=local[p.batch]) for p in plans.transfer_plans
                              if p.batch in local),
                        tuple(plans.groups[b] for b in bs))
            refs[home] = actors[home].run.remote(sub, [batches[b] for b in bs])
        # Wait for every actor, also after a failure: the caller aborts the plans next.
        ready = set(ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeout_s)[0])
        logits, prefix, error = {}, {}, None
        for home, ref in refs.items():
            try:
                if ref not in ready:
                    raise EngineUnavailable(f"the compute actor of instance {home} did not finish "
                                            f"the iteration within {self.timeout_s:.0f} s")
                ids, rows, spans = ray.get(ref)
            except RayActorError:
                error = error or EngineUnavailable(f"the compute actor of instance {home} is not running")
                continue
            except (RayError, TokenLakeError) as exc:
                error = error or _cause(exc)
                continue
            if ids:
                table = torch.tensor(rows)  # a copy: Ray's array is read-only shared memory
                logits.update((rid, table[k]) for k, rid in enumerate(ids))
            prefix.update(spans)
            self.batches_run[home] = self.batches_run.get(home, 0) + len(by_home[home])
        if error is not None:
            raise error
        return IterationOutput(logits, prefix)


# --------------------------------------------------------------------------- cluster


class RayCluster:
    """N instances' query and transfer engines as Ray actors, plus the control plane.

    The same API as :class:`tokenlake.deploy.local.LocalCluster` (``control``, ``client``,
    ``slab``, ``replicate``, ``migrate``, ``engine_stats``, ``alive``, ``kill``,
    ``close``, context manager), plus the lifecycle of instances
    (``failed_instances``, ``remove_instance``, ``remove_failed``,
    ``restart_instance``) and what a multi-node deployment needs (``client_info``,
    ``scheduling_strategy``, ``describe``). Roles of :meth:`alive` and :meth:`kill` are
    ``"query"``, ``"transfer"``, ``"host"`` and, once started, ``"compute"``.

    Compute engines: :meth:`start_compute` (or ``compute=True``) starts one
    :class:`ComputeActor` per instance in its bundle; :meth:`compute_engine` is the
    driver-side :class:`RayComputeEngine` that ``Server`` uses (it picks it by itself).
    They are stopped with their instance and restarted with it.

    Args: as ``LocalCluster`` (``host`` is in ``options``), plus ``options``
    (:class:`RayOptions`). ``start_timeout_s`` bounds placing the bundles and starting
    the actors (worker start-up and the torch import included). ``compute``: start the
    compute actors in :meth:`start` (``True``: with the default weights; a callable:
    their weights loader, see :meth:`start_compute`).
    """

    def __init__(
        self,
        n_instances: int,
        model: ModelSpec,
        pool_bytes: int,
        segment_tokens: int = 64,
        max_rows: int = 1024,
        clock: Callable[[], float] = time.monotonic,
        seed: int = 0,
        timeout_s: float = 5.0,
        peer_timeout_s: float = 2.0,
        start_timeout_s: float = 120.0,
        options: RayOptions | None = None,
        compute: bool | Callable[[], Any] = False,
    ) -> None:
        self.control = pool_control(n_instances, model, pool_bytes, segment_tokens, _DTYPE_BYTES, clock, seed)
        self.options = options if options is not None else RayOptions()
        self.n_instances, self.model, self.max_rows = n_instances, model, max_rows
        self.segment_tokens = segment_tokens
        self.slots_per_instance = self.control.config.slots_per_instance
        self.timeout_s, self.peer_timeout_s = timeout_s, peer_timeout_s
        self.start_timeout_s, self.host = start_timeout_s, self.options.host
        self._pg = None
        self._owns_ray = False
        self._node = ""  # the driver's node id
        self._running: set[int] = set()
        self._actors: dict[tuple[str, int], Any] = {}  # (role, instance) -> actor handle
        self._procs: dict[tuple[str, int], ProcessRef] = {}
        self._endpoints: dict[tuple[str, int], str] = {}
        self._hosts: dict[int, dict[str, Any]] = {}  # instance -> host info (buffers, prefix)
        self._clients: dict[int, Any] = {}
        self._slabs: dict[int, Any] = {}
        self._ctx = None
        self._compute_at_start = compute
        self._compute: dict[str, Any] | None = None  # start_compute's settings once started

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> RayCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Places the bundles, starts 3N actors, exchanges addresses; waits until ready."""
        import zmq

        if not ray.is_initialized():
            ray.init(address=self.options.address)
            self._owns_ray = True
        self._node = ray.get_runtime_context().get_node_id()
        atexit.register(self.close)
        try:
            self._pg = placement_group([self.options.bundle() for _ in range(self.n_instances)],
                                       strategy=self.options.strategy)
            ready, _ = ray.wait([self._pg.ready()], timeout=self.start_timeout_s)
            if not ready:
                raise EngineUnavailable(
                    f"Ray could not place {self.n_instances} bundles of {self.options.bundle()} "
                    f"({self.options.strategy}) within {self.start_timeout_s:.0f} s: not enough "
                    "resources or nodes (see `ray status`)")
            if self._compute_at_start:  # created with the engines: they load while the pool starts
                loader = None if self._compute_at_start is True else self._compute_at_start
                self._compute = self._compute_settings(loader, None)
            self._start_instances(list(range(self.n_instances)))
        except BaseException:
            self.close()
            raise
        self._ctx = zmq.Context()

    def close(self) -> None:
        """Stops every engine, unlinks every shared buffer on every node, kills every
        actor, removes the placement group (and shuts Ray down if it started it)."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._slabs.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if ray.is_initialized():
            instances = sorted({i for _, i in self._actors} | self._running)
            if instances:
                self._teardown(instances, tell_peers=False)
            if self._pg is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(self._pg)
        else:  # Ray went first (its shutdown killed the actors): unlink what is on this node
            for i, info in self._hosts.items():
                if self._procs[("host", i)].node == self._node:
                    _unlink_prefix(info["prefix"])
            self._hosts.clear()
            self._actors.clear()
            self._procs.clear()
            self._endpoints.clear()
            self._running.clear()
        self._pg = None
        self._compute = None
        atexit.unregister(self.close)
        if self._owns_ray:
            self._owns_ray = False
            ray.shutdown()

    def _in_bundle(self, instance: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=instance)

    def _start_instances(self, instances: list[int]) -> None:
        """Starts the host and engines of ``instances`` and joins them to the running ones."""
        from tokenlake.dataplane import wire
        from tokenlake.dataplane.engine import EngineSpec

        m, rows = self.model, self.max_rows
        shapes = {
            "slab": [self.slots_per_instance, m.num_layers, 2, m.num_kv_heads, self.segment_tokens, m.head_dim],
            "q": [rows, m.num_q_heads, m.head_dim],
            "out_o": [rows, m.num_q_heads, m.head_dim],
            "out_lse": [rows, m.num_q_heads],
            "kv": [m.num_layers, rows, 2, m.num_kv_heads, m.head_dim],
        }
        hosts, engines = {}, {}
        for i in instances:  # all at once: the engines import torch while hosts create buffers
            hosts[i] = _HostActor.options(scheduling_strategy=self._in_bundle(i),
                                          **self.options.resources("host")).remote(i)
            self._actors[("host", i)] = hosts[i]
            for role in ENGINE_ROLES:
                actor = _EngineActorRemote.options(scheduling_strategy=self._in_bundle(i),
                                                   **self.options.resources(role)).remote(role, i)
                self._actors[(role, i)] = engines[(role, i)] = actor
        if self._compute is not None:
            self._create_compute(instances)
        for i, info in self._get({i: h.create.remote(shapes) for i, h in hosts.items()}, "host start-up").items():
            self._hosts[i] = info
            self._procs[("host", i)] = ProcessRef(**info["proc"])
        nodes = {self._procs[("host", i)].node for i in set(instances) | self._running}
        if len(nodes) > 1 and self.options.loopback:
            raise ConfigError(
                f"the instances are on {len(nodes)} nodes but the engines would bind "
                f"{self.options.host}: bind an address the nodes can reach (host='node', an "
                "interface name or an IP; see docs/deploy-ray.md)")
        starts = {}
        for (role, i), actor in engines.items():
            info = self._hosts[i]
            spec = EngineSpec(role, i, info["cluster_id"], {n: info["buffers"][n] for n in _WANTED[role]},
                              host=self.options.host, peer_timeout_s=self.peer_timeout_s,
                              port_range=self.options.port_range)
            starts[(role, i)] = actor.start.remote(spec.to_bytes())
        for key, info in self._get(starts, "engine start-up").items():
            self._endpoints[key] = info["endpoint"]
            self._procs[key] = ProcessRef(**info["proc"])
        others = sorted(self._running)
        self._running |= set(instances)
        table = {role: {j: self._endpoints[(role, j)] for j in self._running} for role in ENGINE_ROLES}
        self._get({k: a.connect.remote(table[k[0]]) for k, a in engines.items()}, "engine connect")
        for role in ENGINE_ROLES:  # the running engines learn the new addresses
            body = {"peers": [[i, table[role][i]] for i in instances]}
            self._relay_all([(role, j) for j in others], wire.Kind.PEERS, body, strict=True)
        if self._compute is not None:
            self._open_compute(instances)

    def _get(self, refs: dict, what: str, timeout_s: float | None = None) -> dict:
        keys = list(refs)
        timeout_s = self.start_timeout_s if timeout_s is None else timeout_s
        try:
            values = ray.get([refs[k] for k in keys], timeout=timeout_s)
        except GetTimeoutError:
            raise EngineUnavailable(f"{what}: no answer within {timeout_s:.0f} s") from None
        except RayError as exc:
            raise EngineUnavailable(f"{what} failed: {exc}") from exc
        return dict(zip(keys, values))

    def _teardown(self, instances: list[int], tell_peers: bool) -> None:
        """Stops and removes the actors of ``instances``; unlinks their buffers."""
        from tokenlake.dataplane import wire

        gone = set(instances)
        for i in instances:
            client = self._clients.pop(i, None)
            if client is not None:
                client.close()
            self._slabs.pop(i, None)
        self._running -= gone
        if tell_peers and self._running:
            for role in ENGINE_ROLES:  # drop the sockets (and what they queued) first
                body = {"peers": [[i, None] for i in instances]}
                self._relay_all([(role, j) for j in sorted(self._running)], wire.Kind.PEERS, body, strict=False)
        keys = [k for k in self._actors if k[1] in gone]
        stops = [self._actors[k].stop.remote(2.0) for k in keys if k[0] != "host"]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=5.0)
        closes = {i: self._actors[("host", i)].close.remote() for i in instances if ("host", i) in self._actors}
        ready = ray.wait(list(closes.values()), num_returns=len(closes), timeout=5.0)[0] if closes else []
        unlinked = set()
        for i, ref in closes.items():
            if ref in ready:
                with contextlib.suppress(RayError):
                    ray.get(ref)
                    unlinked.add(i)
        for k in keys:
            with contextlib.suppress(Exception):
                ray.kill(self._actors[k], no_restart=True)
        deadline = time.monotonic() + 10.0
        for k in keys:  # processes on this node: wait until they are really gone
            proc = self._procs.get(k)
            while proc is not None and proc.node == self._node and proc.alive() and time.monotonic() < deadline:
                time.sleep(0.02)
        for i in instances:
            info = self._hosts.pop(i, None)
            if info is not None and i not in unlinked:  # the host died: unlink for it
                self._unlink_on(self._procs[("host", i)].node, info["prefix"])
        for k in keys:
            self._actors.pop(k, None)
            self._procs.pop(k, None)
            self._endpoints.pop(k, None)

    def _unlink_on(self, node: str, prefix: str) -> None:
        if node == self._node:
            _unlink_prefix(prefix)
            return
        try:
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            ray.get(_unlink_task.options(scheduling_strategy=strategy).remote(prefix), timeout=30.0)
        except RayError as exc:
            log.warning("could not unlink %s* on node %s (%s); run tokenlake.dataplane.shm.sweep_stale() there",
                        prefix, node, exc)

    # ---------------------------------------------------------------- usage
    @property
    def instances(self) -> tuple[int, ...]:
        """The running instances."""
        return tuple(sorted(self._running))

    def client(self, instance: int):
        """The data-plane client of ``instance`` (created on first use; the driver must
        be on the instance's node). After :meth:`restart_instance` ask for it again."""
        if self._ctx is None:
            raise ConfigError("the cluster is not running; use it as a context manager")
        if instance not in self._clients:
            self._clients[instance] = open_client(self.client_info(instance), self._ctx, self.timeout_s)
        return self._clients[instance]

    def client_info(self, instance: int) -> dict[str, Any]:
        """What :func:`open_client` needs, as plain data (endpoints, buffer specs, the
        engines' processes); valid until the instance is removed or restarted."""
        self._check_running(instance)
        info = self._hosts[instance]
        return {
            "instance": instance,
            "node_id": self._procs[("host", instance)].node,
            "endpoints": {role: self._endpoints[(role, instance)] for role in ENGINE_ROLES},
            "buffers": {n: info["buffers"][n] for n in _CLIENT_BUFFERS},
            "procs": {role: self._procs[(role, instance)].to_dict() for role in ENGINE_ROLES},
            "timeout_s": self.timeout_s,
        }

    def scheduling_strategy(self, instance: int) -> PlacementGroupSchedulingStrategy:
        """Ray scheduling strategy of ``instance``'s bundle: give it to the compute-engine
        actor of that instance (it then shares the node, and the GPU when there is one)."""
        self._check_running(instance)
        return self._in_bundle(instance)

    # -------------------------------------------------------------- compute
    def start_compute(self, weights_loader: Callable[[], Any] | None = None,
                      threads: int | None = None) -> None:
        """Starts a :class:`ComputeActor` in every running instance's bundle (on its
        node) and waits until each has loaded its weights and opened its client.

        ``weights_loader``: a picklable function called once in each actor that returns
        the :class:`~tokenlake.model.llama.weights.LlamaWeights` (default
        ``tokenlake.model.llama.weights.load_weights``, SmolLM2-135M; the cluster's model spec
        must match them). Each actor asks for ``RayOptions.resources("compute")`` (what
        ``engine_share`` leaves of the bundle) and runs torch with ``threads`` threads
        (default: its whole CPUs, at least 1). :meth:`restart_instance` starts the
        instance's compute actor again; :meth:`close` and :meth:`remove_instance` stop it.
        """
        if self._pg is None:
            raise ConfigError("the cluster is not running")
        if self._compute is not None:
            raise ConfigError("the compute actors are already started")
        self._compute = self._compute_settings(weights_loader, threads)
        try:
            self._start_compute(list(self.instances))
        except BaseException:
            self._stop_compute(list(self.instances))
            self._compute = None
            raise

    def restart_compute(self, instance: int) -> None:
        """Replaces the compute actor of a running instance (after it died, say); the
        pool's engines and slab are untouched."""
        self._check_running(instance)
        if self._compute is None:
            raise ConfigError("the compute actors were not started (start_compute)")
        self._stop_compute([instance])
        self._start_compute([instance])

    def compute_actor(self, instance: int):
        """The Ray actor handle of ``instance``'s :class:`ComputeActor`."""
        actor = self._actors.get((COMPUTE_ROLE, instance))
        if actor is None or instance not in self._running:
            raise EngineUnavailable(f"instance {instance} has no compute actor (the instance is not "
                                    "running, or start_compute was not called)")
        return actor

    def compute_engine(self, timeout_s: float | None = 300.0) -> RayComputeEngine | None:
        """A :class:`RayComputeEngine` over the compute actors, or None when they were not
        started (``Server`` then computes in the driver with :meth:`client`)."""
        return RayComputeEngine(self, timeout_s) if self._compute is not None else None

    def _compute_settings(self, loader: Callable[[], Any] | None, threads: int | None) -> dict[str, Any]:
        resources = self.options.resources(COMPUTE_ROLE)
        if threads is None:
            threads = max(1, int(resources["num_cpus"]))
        return {"loader": loader, "threads": int(threads), "resources": resources}

    def _start_compute(self, instances: list[int]) -> None:
        self._create_compute(instances)
        self._open_compute(instances)

    def _create_compute(self, instances: list[int]) -> None:
        """Creates the actors (each loads torch and the weights now, asynchronously)."""
        cfg = self._compute
        for i in instances:
            self._actors[(COMPUTE_ROLE, i)] = _ComputeActorRemote.options(
                scheduling_strategy=self._in_bundle(i), **cfg["resources"]
            ).remote(i, cfg["loader"], cfg["threads"])

    def _open_compute(self, instances: list[int]) -> None:
        """Hands each created actor its instance's client_info; waits until all are ready."""
        refs = {i: self._actors[(COMPUTE_ROLE, i)].open.remote(self.client_info(i)) for i in instances}
        try:
            ready = ray.get(list(refs.values()), timeout=self.start_timeout_s)
        except GetTimeoutError:
            raise EngineUnavailable(
                f"compute start-up: no answer within {self.start_timeout_s:.0f} s (does the bundle have "
                f"{self.options.resources(COMPUTE_ROLE)} left for the compute actor? see `ray status`)") from None
        except RayActorError as exc:
            raise EngineUnavailable(f"compute start-up failed: {exc}") from exc
        except RayError as exc:
            raise _cause(exc) from exc
        for i, info in zip(refs, ready):
            self._procs[(COMPUTE_ROLE, i)] = ProcessRef(**info["proc"])

    def _stop_compute(self, instances: list[int]) -> None:
        keys = [(COMPUTE_ROLE, i) for i in instances if (COMPUTE_ROLE, i) in self._actors]
        stops = [self._actors[k].stop.remote() for k in keys]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=5.0)
        for k in keys:
            with contextlib.suppress(Exception):
                ray.kill(self._actors[k], no_restart=True)
        deadline = time.monotonic() + 10.0
        for k in keys:
            proc = self._procs.get(k)
            while proc is not None and proc.node == self._node and proc.alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            self._actors.pop(k, None)
            self._procs.pop(k, None)

    def node_id(self, instance: int) -> str:
        self._check_running(instance)
        return self._procs[("host", instance)].node

    def buffer_prefix(self, instance: int) -> str:
        """Name prefix of the instance's shared buffers on its node."""
        self._check_running(instance)
        return self._hosts[instance]["prefix"]

    @property
    def placement_group(self):
        """The placement group of the instances' bundles (None once closed)."""
        return self._pg

    def processes(self) -> dict[tuple[str, int], ProcessRef]:
        """Every actor's process (role is ``host``, ``query``, ``transfer`` or ``compute``)."""
        return dict(self._procs)

    def describe(self) -> list[dict[str, Any]]:
        """Per running instance: node, address, endpoints, buffer names and pids."""
        out = []
        for i in self.instances:
            host = self._procs[("host", i)]
            out.append({
                "instance": i, "node_id": host.node, "node_ip": host.ip,
                "endpoints": {role: self._endpoints[(role, i)] for role in ENGINE_ROLES},
                "buffers": sorted(b["name"] for b in self._hosts[i]["buffers"].values()),
                "pids": {role: self._procs[(role, i)].pid for role in ALL_ROLES if (role, i) in self._procs},
            })
        return out

    def slab(self, instance: int):
        """The driver's view of an instance's slab (driver on that node only)."""
        from tokenlake.dataplane.shm import SharedTensor

        self._check_running(instance)
        if instance not in self._slabs:
            if self.node_id(instance) != self._node:
                raise ConfigError(f"instance {instance}'s slab is on another node")
            spec = BufferSpec.from_dict(self._hosts[instance]["buffers"]["slab"])
            self._slabs[instance] = SharedTensor.attach(spec).tensor
        return self._slabs[instance]

    def alive(self, role: str, instance: int) -> bool:
        if role not in ALL_ROLES:
            raise ConfigError(f"role must be one of {ALL_ROLES}, got {role!r}")
        proc, actor = self._procs.get((role, instance)), self._actors.get((role, instance))
        if proc is None or actor is None:
            return False
        if proc.node == self._node:
            return proc.alive()
        try:
            return bool(ray.get(actor.alive.remote(), timeout=self.timeout_s))
        except RayActorError:
            return False
        except GetTimeoutError:
            return True  # busy, not known to be dead

    def kill(self, role: str, instance: int) -> None:
        """Kills one actor (fault injection): ``ray.kill``, then waits until it is gone."""
        if role not in ALL_ROLES:
            raise ConfigError(f"role must be one of {ALL_ROLES}, got {role!r}")
        self._check_running(instance)
        if (role, instance) not in self._actors:
            raise ConfigError(f"instance {instance} has no {role} actor")
        ray.kill(self._actors[(role, instance)], no_restart=True)
        deadline = time.monotonic() + 10.0
        while self.alive(role, instance):
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"the {role} actor of instance {instance} did not die")
            time.sleep(0.02)

    def failed_instances(self) -> list[int]:
        """Running instances with a dead query or transfer engine. (A dead host alone
        does not fail its instance: the engines keep their mappings, and its buffers are
        unlinked by the driver when the instance is removed or the pool closes. Nor does
        a dead compute actor: the slab still serves the pool; see :meth:`restart_compute`.)"""
        return [i for i in self.instances if not all(self.alive(r, i) for r in ENGINE_ROLES)]

    def remove_instance(self, instance: int) -> tuple[str, ...]:
        """Takes an instance out: its peers forget it, its actors stop, its buffers are
        unlinked, and the control plane drops its segments (the ids of requests that
        lost part of their prefix are returned: finish and recompute them; abort plans
        that were in flight)."""
        self._check_running(instance)
        self._teardown([instance], tell_peers=True)
        if instance in self.control.pool.instances:  # unless the caller removed it already
            return self.control.remove_instance(instance)
        return ()

    def remove_failed(self) -> dict[int, tuple[str, ...]]:
        """:meth:`remove_instance` for every failed instance: {instance: lost requests}."""
        return {i: self.remove_instance(i) for i in self.failed_instances()}

    def restart_instance(self, instance: int) -> tuple[str, ...]:
        """Brings an instance back in its bundle with an empty slab: new actors (its
        compute actor too, when started), new buffers, new endpoints sent to its peers;
        it rejoins the control plane's ring.
        A running instance is removed first (its lost requests are returned)."""
        if not 0 <= instance < self.n_instances:
            raise ConfigError(f"instance must be in [0, {self.n_instances}), got {instance}")
        if self._pg is None:
            raise ConfigError("the cluster is not running")
        lost = self.remove_instance(instance) if instance in self._running else ()
        if instance in self.control.pool.instances:
            lost += self.control.remove_instance(instance)
        try:
            self._start_instances([instance])
        except BaseException:
            self._teardown([instance], tell_peers=True)
            raise
        self.control.add_instance(instance)  # an empty instance joins the ring
        return lost

    def _check_running(self, instance: int) -> None:
        if instance not in self._running:
            raise ConfigError(f"instance {instance} is not running")

    # -------------------------------------------------------------- requests
    def _relay(self, key: tuple[str, int], kind, body: dict | None = None):
        """One request to one engine through its actor, and the typed-checked reply."""
        from tokenlake.dataplane import wire

        actor = self._actors.get(key)
        if actor is None:
            raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]} is not running")
        frames = [bytes(f) for f in wire.encode(kind, 1, body)]
        try:
            reply = ray.get(actor.request.remote(frames, self.timeout_s), timeout=self.timeout_s + 10.0)
        except RayActorError:
            raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]} is not running") from None
        except GetTimeoutError:
            raise EngineUnavailable(f"the {key[0]} actor of instance {key[1]} did not answer") from None
        if reply is None:
            raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]} did not answer "
                                    f"within {self.timeout_s:.1f} s")
        return wire.raise_if_error(wire.decode(reply))

    def _relay_all(self, keys: list[tuple[str, int]], kind, body: dict, strict: bool) -> dict:
        """The same request to several engines at once; ``strict``: any failure raises."""
        from tokenlake.dataplane import wire

        frames = [bytes(f) for f in wire.encode(kind, 1, body)]
        refs = {k: self._actors[k].request.remote(frames, self.timeout_s) for k in keys if k in self._actors}
        out = {}
        for key, ref in refs.items():
            try:
                reply = ray.get(ref, timeout=self.timeout_s + 10.0)
                if reply is None:
                    raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]} did not answer")
                out[key] = wire.raise_if_error(wire.decode(reply))
            except (RayError, EngineUnavailable) as exc:
                if strict:
                    raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]}: {exc}") from exc
                log.warning("the %s engine of instance %d: %s", key[0], key[1], exc)
        return out

    def engine_stats(self) -> dict[tuple[str, int], dict]:
        """Pings every live engine; returns its stats (see ``EngineLoop.stats``)."""
        from tokenlake.dataplane import wire

        keys = [(r, i) for i in self.instances for r in ENGINE_ROLES if self.alive(r, i)]
        return {k: m.body for k, m in self._relay_all(keys, wire.Kind.PING, {}, strict=False).items()}

    def migrate(self, key: bytes, target: int) -> None:
        """Moves a segment to ``target`` (one contiguous copy, then the source replica is
        dropped), as :meth:`LocalCluster.migrate`."""
        rep = self.control.start_replication(key, target)
        self.replicate([rep])
        self.control.drop_replica(key, rep.source.instance)

    def replicate(self, reps) -> None:
        """Copies each replication's segment TE to TE and commits it; a failed copy is
        rolled back in the control plane and re-raised."""
        from tokenlake.dataplane import wire

        for rep in reps:
            body = {"slot": rep.source.slot, "target": rep.target.instance, "target_slot": rep.target.slot}
            try:
                self._relay(("transfer", rep.source.instance), wire.Kind.COPY_SEGMENT, body)
            except BaseException:
                self.control.pool.abort_replication(rep)
                raise
            self.control.finish_replication(rep)


# --------------------------------------------------------------------------- serve


def serve(
    instances: int,
    model_name: str,
    pool_bytes: int,
    options: RayOptions,
    segment_tokens: int = 64,
    max_rows: int = 1024,
    restart: bool = True,
    poll_s: float = 1.0,
    out: Callable[[str], None] = print,
    json_lines: bool = False,
    stop: threading.Event | None = None,
) -> int:
    """``tokenlake serve --ray``: starts the pool, prints its addresses, watches it
    (failed instances are removed and, with ``restart``, started again) until Ctrl-C
    (KeyboardInterrupt) or ``stop`` is set, then shuts everything down."""
    import json

    from tokenlake.core.specs import load_model

    def emit(event: str, text: str, **data) -> None:
        out(json.dumps({"event": event, **data}) if json_lines else text)

    model = load_model(model_name)
    stop = stop if stop is not None else threading.Event()
    with RayCluster(instances, model, pool_bytes, segment_tokens, max_rows, options=options) as cluster:
        desc = cluster.describe()
        lines = [f"TokenLake pool on Ray: {instances} instances of {model.name}, "
                 f"{cluster.slots_per_instance} slots of C={segment_tokens} each ({options.strategy})"]
        for d in desc:
            lines.append(f"  instance {d['instance']}: node {d['node_ip']} ({d['node_id'][:12]}) "
                         f"query {d['endpoints']['query']} transfer {d['endpoints']['transfer']}")
        emit("ready", "\n".join(lines), instances=desc)
        emit("serving", "serving; Ctrl-C to stop")
        try:
            while not stop.wait(poll_s):
                for i, lost in cluster.remove_failed().items():
                    emit("failed", f"instance {i} failed and was removed ({len(lost)} requests lost)",
                         instance=i, lost=list(lost))
                    if restart:
                        cluster.restart_instance(i)
                        (d,) = [d for d in cluster.describe() if d["instance"] == i]
                        emit("restarted", f"instance {i} restarted: query {d['endpoints']['query']} "
                             f"transfer {d['endpoints']['transfer']}", instance=d)
        except KeyboardInterrupt:
            pass
        emit("stopping", "stopping")
    emit("stopped", "stopped: actors gone, shared memory unlinked")
    return 0
