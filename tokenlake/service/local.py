"""A pool served on this machine: a :class:`~tokenlake.deploy.local.LocalCluster` and its
:class:`~tokenlake.service.server.ControlServer`, up until told to stop.

What ``tokenlake serve`` without ``--ray`` is to run; other processes attach with
``tokenlake.connect(server.address)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tokenlake.core.specs import ModelSpec
from tokenlake.deploy.local import LocalCluster
from tokenlake.service.server import DEFAULT_CONTROL_PORT, ControlServer


def serve_local(
    model: ModelSpec,
    instances: int,
    pool_bytes: int,
    segment_tokens: int = 64,
    max_rows: int = 1024,
    *,
    host: str = "127.0.0.1",
    control_port: int = DEFAULT_CONTROL_PORT,
    engine_host: str = "127.0.0.1",
    stop: threading.Event | None = None,
    on_ready: Callable[[ControlServer], None] = lambda server: None,
) -> None:
    """Starts ``instances`` local instances of ``pool_bytes`` slab bytes each and serves
    their control plane on ``host:control_port`` (0: any free port) until ``stop`` is set
    or Ctrl-C (``KeyboardInterrupt``) arrives while serving; then stops the server and
    the engines and unlinks every shared buffer (also when starting fails).

    ``on_ready`` is called once the pool serves, with the running server (its
    ``address`` is what clients connect to). ``engine_host`` is what the engines bind.

    Raises:
        ConfigError: sizes that do not fit, or the control port cannot be bound.
        EngineUnavailable: an engine did not start.
    """
    stop = stop if stop is not None else threading.Event()
    cluster = LocalCluster(instances, model, pool_bytes, segment_tokens=segment_tokens,
                           max_rows=max_rows, host=engine_host)
    with cluster, ControlServer(cluster, host=host, port=control_port) as server:
        on_ready(server)
        try:
            stop.wait()
        except KeyboardInterrupt:  # the normal way to stop a served pool
            pass
