"""The HTTP front end, running: a serving backend behind an :class:`GenerationThread`, the
FastAPI app and uvicorn on a bound socket, started and stopped as one.

    with HttpFrontend(server, model_info, host="127.0.0.1", port=8000) as front:
        print(front.url)  # http://127.0.0.1:8000

``port=0`` binds any free port (read :attr:`HttpFrontend.url`). Stopping ends every live
request, lets uvicorn finish its connections and stops the engine thread.
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from tokenlake.core.errors import ConfigError
from tokenlake.service.generation_thread import GenerationThread, LoopObserver, ServingBackend
from tokenlake.service.http import ModelInfo, create_app
from tokenlake.service.limits import HttpLimits
from tokenlake.service.metrics import ServiceMetrics

log = logging.getLogger(__name__)


class HttpFrontend:
    """Serves ``backend`` over HTTP on ``host:port`` (see the module docstring).

    Args:
        backend: ``GenerationLoop`` (the pool) or ``ReferenceLoop`` (the baseline).
        model: name, tokenizer and limits of what is served.
        pool_stats: the control plane's ``stats`` (None: no pool; no pool metrics).
        instances: the pool's instances at start (metrics report one gone as down).
        limits: what the HTTP front door accepts (body size and time, prompt tokens,
            stop strings; default :class:`~tokenlake.service.limits.HttpLimits`).
        sessions: returns ``(client sessions open, ended by the server)`` for
            ``/metrics`` (None: no session metrics).
    """

    def __init__(self, backend: ServingBackend, model: ModelInfo, host: str = "127.0.0.1",
                 port: int = 8000, pool_stats=None, instances=(), heal=None,
                 limits: HttpLimits | None = None, sessions=None) -> None:
        self.loop = GenerationThread(backend, heal=heal)
        self.metrics = ServiceMetrics(pool_stats, instances,
                                      lambda: (self.loop.queue_length, self.loop.running), sessions)
        self.loop.observer = LoopObserver(
            first_token=self.metrics.ttft.observe, between_tokens=self.metrics.tbt.observe,
            iteration=self.metrics.iteration.observe, finished=self.metrics.finished,
            phases=self.metrics.phases)
        engine = getattr(backend, "engine", None)
        if hasattr(engine, "on_query"):
            engine.on_query = self.metrics.query.observe
        # one thread builds every request's detokenizer (it starts on first use)
        self._detok = ThreadPoolExecutor(1, thread_name_prefix="tokenlake-detok")
        self.app = create_app(self.loop, model, self.metrics, limits, self._detok)
        self.host, self.port = host, port
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> HttpFrontend:
        """Binds the port, starts the engine thread and uvicorn; returns once serving."""
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say so, and
        # without it a small body after the headers waits ~40 ms for a delayed ACK
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise ConfigError(f"cannot bind the HTTP port {self.host}:{self.port}: {e}") from e
        port = sock.getsockname()[1]
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"http://{host}:{port}"
        self.loop.start()
        config = uvicorn.Config(self.app, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5, lifespan="off")
        self._server = uvicorn.Server(config)
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(sock, started),
                                        name="tokenlake-http", daemon=True)
        self._thread.start()
        started.wait()
        if not self._server.started:
            self.close()
            raise ConfigError(f"the HTTP server did not start on {self.url}")
        log.info("HTTP API served on %s", self.url)
        return self

    def _serve(self, sock: socket.socket, started: threading.Event) -> None:
        server = self._server
        original = server.startup

        async def startup(sockets=None):  # signal the caller once listening (or failed)
            try:
                await original(sockets=sockets)
            finally:
                started.set()

        server.startup = startup
        try:
            server.run(sockets=[sock])
        finally:
            started.set()
            sock.close()

    def close(self) -> None:
        """Ends the live requests, then stops uvicorn (idempotent)."""
        self.loop.close()  # streams end now; uvicorn then has no connection to wait for
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join()
            self._thread = None
        self._detok.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> HttpFrontend:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
