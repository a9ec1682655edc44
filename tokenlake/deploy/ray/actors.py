"""The actors that run an instance's engines: :class:`EngineActor` (a query or transfer
engine) and :class:`ComputeActor` (a compute engine). Both run in the instance's
placement-group bundle, so on the node of its buffers.

An engine actor runs the unchanged engine loop (``EngineLoop.serve`` of
:mod:`tokenlake.engines.query` or :mod:`tokenlake.engines.transfer`) in a thread of the actor process. The actor
process *is* the engine process: ``ray.kill`` of the actor is the death of the engine,
and an engine loop that ends on its own takes the actor down with it (``os._exit``), so
"the engine is alive" and "its process is alive" mean the same thing, as with
``LocalCluster``'s processes. (A child process per actor was the alternative; it costs
one more interpreter and torch import per engine, and a killed actor would leave its
child running until the child noticed.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import zmq

from tokenlake.core.errors import ConfigError, EngineUnavailable, PlanError
from tokenlake.dataplane.auth import connect_secure
from tokenlake.dataplane.sockets import send
from tokenlake.deploy.ray.client import open_client
from tokenlake.deploy.ray.liveness import ProcessRef
from tokenlake.deploy.ray.orphans import Grace
from tokenlake.deploy.roles import engine_class
from tokenlake.engines.openmp import OPENMP_ENV  # no torch


@dataclass(frozen=True)
class EngineStarted:
    """An engine actor's answer to :meth:`EngineActor.start`.

    Attributes:
        endpoint: the ``tcp://host:port`` its peers and its clients connect to.
        proc: the actor's (the engine's) process.
    """

    endpoint: str
    proc: ProcessRef


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
        self._ctl: zmq.Context | None = None  # context of the relay socket (actor thread only)
        self._grace = Grace()  # the driver's heartbeats (orphans.py)

    def start(self, spec_bytes: bytes) -> EngineStarted:
        """Maps the instance's buffers (created on this node by its host) and binds the
        engine's socket; returns the endpoint peers connect to."""

        from tokenlake.engines.loop import EngineSpec  # imports torch (see above)

        spec = EngineSpec.from_bytes(spec_bytes)
        if (spec.role, spec.instance) != (self.role, self.instance):
            raise ConfigError(f"spec of the {spec.role} engine {spec.instance} sent to {self!r}")
        if spec.host == "node":
            spec = dataclasses.replace(spec, host=ray.util.get_node_ip_address())
        spec.apply_to_process()
        logging.basicConfig(level=logging.WARNING, format=f"[{spec.role}-{spec.instance}] %(message)s")
        self.spec = spec
        self.engine = self._cls(spec)
        self._grace.beat()  # the driver's heartbeats count from here
        if spec.orphan_grace_s > 0:  # its loop outlives a silent driver (engine_owner.py)
            self.engine.owner_alive = self._grace.alive
        endpoint = self.engine.start()
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        if host in ("0.0.0.0", "*", "[::]"):  # bound everywhere: advertise the node's address
            endpoint = f"tcp://{ray.util.get_node_ip_address()}:{port}"
        self.endpoint = endpoint
        return EngineStarted(endpoint, ProcessRef.this())

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

    @ray.method(concurrency_group="beat")
    def beat(self) -> None:
        self._grace.beat()

    def adopt(self, driver: str, driver_pid: int, grant_key: bytes | None) -> EngineStarted:
        """A new driver takes over: the engine hears ``ADOPT`` with the driver's grant
        key (its loop stops waiting out its grace, and drops what the old driver left;
        refused, ``NotAuthorized``, while the old driver's heartbeats arrive); returns
        where it serves."""
        from tokenlake.dataplane import messages, wire
        from tokenlake.dataplane.messages import Ack, Adopt

        if not self.alive():
            raise EngineUnavailable(f"{self!r} is not serving")
        answer = self.request(Adopt(driver_pid, grant_key).encode(1), self.spec.peer_timeout_s + 5.0)
        if answer is None:
            raise EngineUnavailable(f"{self!r} did not answer ADOPT")
        messages.expect(wire.decode(answer), Ack)  # the engine's own check comes first
        self._grace.adopt(driver)
        return EngineStarted(self.endpoint, ProcessRef.this())

    def request(self, frames: list[bytes], timeout_s: float) -> list[bytes] | None:
        """Relays one wire message (its frames, as the driver encoded it) to this engine
        over a local socket; returns the reply frames, or None when there was none
        within ``timeout_s``. The frames are passed on unread: the driver decodes the
        reply."""
        if self._ctl is None:
            self._ctl = zmq.Context()
        sock = self._ctl.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        connect_secure(sock, self.engine.keys, as_owner=True)  # Ray's boundary vouches for the caller
        sock.connect(self.endpoint)
        try:
            send(sock, frames, timeout_s=timeout_s)
            if not sock.poll(int(timeout_s * 1000)):
                return None
            return [bytes(f) for f in sock.recv_multipart()]
        finally:
            sock.close(0)

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Ends the engine loop (SHUTDOWN) and waits for it; True when it ended."""
        from tokenlake.dataplane.messages import Shutdown  # imports torch, as the engine did

        self._stopping = True
        if self.alive():
            with contextlib.suppress(Exception):
                self.request(Shutdown().encode(1), timeout_s)
            self._thread.join(timeout_s)
        if self._ctl is not None:
            self._ctl.term()
            self._ctl = None
        return not self.alive()

    def __repr__(self) -> str:
        return f"tokenlake-{self.role}-{self.instance}"


class _OwnInstance:
    """The "cluster" a compute actor's :class:`~tokenlake.engines.compute.ComputeEngine` sees:
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
    unchanged :class:`~tokenlake.engines.compute.ComputeEngine`; the KV moves through shared
    memory and the engines' sockets, only plans, token ids and logits go through Ray."""

    def __init__(self, instance: int, weights_loader: Callable[[], Any] | None = None,
                 threads: int = 1) -> None:
        # Idle OpenMP workers that spin starve the engines on small machines (the CLI
        # sets the same, and the short spin that bridges a decode step's kernel calls); it
        # only takes effect before torch loads OpenMP.
        for name, value in OPENMP_ENV.items():
            os.environ.setdefault(name, value)
        import torch  # after the line above, which must come first

        if weights_loader is None:  # the model layer: torch and the weights package
            from tokenlake.model.llama.weights import load_weights as weights_loader
        torch.set_num_threads(max(1, int(threads)))
        from tokenlake.deploy.ray.exchange import Mailboxes  # torch: loaded above

        self.instance = instance
        self.weights = weights_loader()
        self.client = None
        self.engine = None
        self.mail = Mailboxes(instance)

    def open(self, info: dict[str, Any]) -> ProcessRef:
        """(Re)opens the instance's client from :meth:`RayCluster.client_info`; checks
        that the weights fit the pool's buffers. Returns this actor's process."""
        from tokenlake.engines.compute import ComputeEngine  # the model layer: torch

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
        return ProcessRef.this()

    def run(self, plans, batches, peers=None) -> tuple[list[str], Any, dict[str, int]]:
        """One iteration's sub-batches homed here (``plans`` holds theirs only, with the
        iteration's ``groups``; ``batches`` maps their batch numbers to batches);
        returns when their puts are stored: request ids, their last-row logits as one
        [requests, vocab] float32 numpy array, and the pool hit per request. ``peers``
        are the compute actors of later sub-batches of this actor's DoP > 1 batches
        (``{instance: handle}``), which get the K/V rows they need from here."""
        import torch  # loaded in __init__ already

        if self.engine is None:
            raise EngineUnavailable(f"the compute actor of instance {self.instance} has no client")
        exchange = self.mail.start(plans.iteration, plans.groups, peers or {})
        try:
            out = self.engine.run(plans, batches, exchange)
        finally:
            self.mail.finish(plans.iteration)
        ids = list(out.logits)
        logits = torch.stack([out.logits[r] for r in ids]).numpy() if ids else None
        return ids, logits, dict(out.prefix_tokens)

    @ray.method(concurrency_group="exchange")
    def kv_in(self, iteration: int, batch: int, part: int, layer: int, request_id: str, k, v) -> None:
        """K/V rows of layer ``layer`` pushed by the actor of sub-batch ``(batch, part)``
        (runs beside :meth:`run`, in its own concurrency group)."""
        self.mail.deliver(iteration, batch, part, layer, request_id, k, v)

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


#: ``beat`` has a concurrency group of its own: an engine busy relaying still hears its driver.
EngineActorRemote = ray.remote(max_restarts=0, concurrency_groups={"beat": 1})(EngineActor)
#: ``kv_in`` has a concurrency group of its own: rows for a sub-batch arrive while its
#: ``run`` waits for them; every other method runs one at a time, as before.
ComputeActorRemote = ray.remote(max_restarts=0, concurrency_groups={"exchange": 1})(ComputeActor)
