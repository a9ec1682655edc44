""":func:`serve`: ``tokenlake serve --ray``, a pool on Ray watched from the shell."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from tokenlake.core.errors import EngineUnavailable
from tokenlake.core.specs import load_model
from tokenlake.dataplane import pool_state
from tokenlake.deploy.ray.cluster import RayCluster
from tokenlake.deploy.ray.options import RayOptions

log = logging.getLogger(__name__)


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
    attach: Callable[[RayCluster], AbstractContextManager[Any]] | None = None,
    page_tokens: int | None = None,
    kv_dtype: str = "float32",
    state_file: str | None = None,
    tier: dict[str, Any] | None = None,
    bf16_products: int = 0,
) -> int:
    """``tokenlake serve --ray``: starts the pool, prints its addresses, watches it
    every ``poll_s`` seconds (failed instances are removed and, with ``restart``, started
    again) until Ctrl-C or SIGTERM (handled when called in the main thread) or ``stop``
    is set, then shuts everything down (a KeyboardInterrupt during start-up stops the
    cluster and propagates). ``json_lines``: one JSON object per event (``ready``, ``serving``, ``failed``,
    ``restarted``, ``stopping``, ``stopped``) instead of text. Returns the exit code.

    ``attach``: what else serves the started cluster (``tokenlake serve`` passes the
    control port and HTTP API of :mod:`tokenlake.service`, a layer above this one),
    entered right after the cluster starts and left before it stops. What it yields may
    have ``lock`` (held while failed instances are removed and restarted: the attached
    servers call the control plane from their own threads) and ``info()`` (a dict merged
    into the ``ready`` event; ``address`` and ``http_url`` are also printed as text).

    ``state_file`` (with ``options.name``): a pool of that name that a dead driver left
    waiting on Ray is adopted instead of starting empty (same settings; other settings
    are an ``AdoptionRefused``), docs/deploy-ray.md "When the driver dies".
    ``tier``, ``bf16_products``: ``ClusterConfig``'s ``tier_*`` fields by name, and its own."""

    def emit(event: str, text: str, **data: Any) -> None:
        out(json.dumps({"event": event, **data}) if json_lines else text)

    model = load_model(model_name)
    stop = stop if stop is not None else threading.Event()
    cluster = RayCluster(instances, model, pool_bytes, segment_tokens, max_rows, options=options,
                         page_tokens=page_tokens, kv_dtype=kv_dtype, state_file=state_file,
                         bf16_products=bf16_products, **(tier or {}))
    with contextlib.ExitStack() as attached:
        attached.callback(cluster.close)
        _start_or_adopt(cluster, pool_state.read(state_file) if state_file else None, emit)
        served = attached.enter_context(attach(cluster)) if attach is not None else None
        lock = getattr(served, "lock", None) or contextlib.nullcontext()
        _ready(cluster, served, emit, f"TokenLake pool on Ray: {instances} instances of {model.name}, "
               f"{cluster.slots_per_instance} slots of C={segment_tokens} each ({options.strategy})")
        emit("serving", "serving; Ctrl-C to stop")
        try:
            with _signals_set(stop):
                while not stop.wait(poll_s):
                    with lock:
                        _recover(cluster, restart, emit)
        except KeyboardInterrupt:  # raised some other way (_thread.interrupt_main, say)
            pass
        emit("stopping", "stopping")
    emit("stopped", "stopped: " + ("served ports closed, " if attach is not None else "")
         + "actors gone, shared memory unlinked")
    return 0


def _ready(cluster: RayCluster, served: Any, emit: Callable[..., None], head: str) -> None:
    """The ``ready`` event: ``head``, the pool's instances, and what ``served`` offers."""
    info = served.info() if hasattr(served, "info") else {}
    lines = [head]
    desc = cluster.describe()
    lines += [f"  instance {d['instance']}: node {d['node_ip']} ({d['node_id'][:12]}) "
              f"query {d['endpoints']['query']} transfer {d['endpoints']['transfer']}" for d in desc]
    lines += _served_lines(info)
    emit("ready", "\n".join(lines), **info, instances=desc)


def _start_or_adopt(cluster: RayCluster, state: dict[str, Any] | None, emit: Callable[..., None]) -> None:
    """Adopts the named pool of ``state`` when a dead driver left it waiting (same
    settings: ``AdoptionRefused`` otherwise, the waiting actors left alone), else starts
    ``cluster``; a waiting pool that cannot be adopted is discarded first."""
    if cluster.waiting(state):
        cluster.check_settings(state)
        text = "adopting the pool a dead driver left on Ray ..."
        emit("progress", text, message=text)
        try:
            cluster.adopt(state)
            return
        except EngineUnavailable as exc:
            log.warning("the waiting pool cannot be adopted (%s): it is discarded", exc)
    cluster.discard(state)
    cluster.start()


def _served_lines(info: dict[str, Any]) -> list[str]:
    """The attached servers' addresses, for people."""
    lines = []
    if info.get("address"):
        lines.append(f"  control plane at {info['address']} (tokenlake.connect)")
    if info.get("http_url"):
        lines.append(f"  OpenAI-compatible API at {info['http_url']}/v1 "
                     f"(metrics: {info['http_url']}/metrics)")
    return lines


@contextlib.contextmanager
def _signals_set(stop: threading.Event) -> Iterator[None]:
    """While serving, SIGINT and SIGTERM set ``stop`` instead of raising: a
    KeyboardInterrupt raised inside ``Event.wait`` can leave the event's lock released
    and end the command with "RuntimeError: release unlocked lock" instead of a clean
    stop. The previous handlers come back afterwards. Outside the main thread (where
    handlers cannot be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda *_: stop.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _recover(cluster: RayCluster, restart: bool, emit: Callable[..., None]) -> None:
    """Removes every failed instance (and starts it again with ``restart``), reporting each."""
    for i, lost in cluster.remove_failed().items():
        emit("failed", f"instance {i} failed and was removed ({len(lost)} requests lost)",
             instance=i, lost=list(lost))
        if restart:
            cluster.restart_instance(i)
            (d,) = [d for d in cluster.describe() if d["instance"] == i]
            emit("restarted", f"instance {i} restarted: query {d['endpoints']['query']} "
                 f"transfer {d['endpoints']['transfer']}", instance=d)
