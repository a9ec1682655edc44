""":class:`ServeConfig`: what :func:`~tokenlake.service.serve.serve_local` serves, as one
frozen, validated object.

It holds the pool's :class:`~tokenlake.deploy.config.ClusterConfig` (the launcher's
settings) and what the service adds on top: the address and ports of the control and
HTTP servers, which engine answers the HTTP API and how the model computes, where the
control port's credentials go, the HTTP front door's limits, and how long the engines
wait to be adopted after this process dies. Bad values are a
:class:`~tokenlake.core.errors.ConfigError` naming the field, raised when the object is
built, before anything loads or starts.

Where the values come from is not this module's business: ``tokenlake serve`` builds one
from its file, environment and flags (:mod:`tokenlake.tools.config`, a layer above, which
this one never imports); a test or a program builds one directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenlake.core.errors import ConfigError
from tokenlake.deploy.config import ClusterConfig
from tokenlake.service.limits import HttpLimits
from tokenlake.service.server import DEFAULT_CONTROL_PORT

DEFAULT_HTTP_PORT = 8000
#: What answers the HTTP API: the model through the pool, or the baseline without one.
ENGINES = ("pool", "reference")
#: How a local pool's model computes (:func:`~tokenlake.service.serve.pool_service`).
COMPUTE = ("one", "per-instance")


@dataclass(frozen=True)
class ServeConfig:
    """What a local service serves.

    Attributes:
        cluster: the pool (instances, model, sizes, the engines' bind address in
            ``cluster.host``, CURVE unless ``cluster.insecure``, KV layout and dtype).
            With ``engine="reference"`` only its ``model`` and ``kv_dtype`` count.
        host: address of the control and HTTP ports.
        control_port: the control port (typed wire messages, ``tokenlake.connect``);
            0: any free port (then no restart can find the pool: it is not kept for
            adoption).
        http_port: the OpenAI-compatible API's port; 0: any free port.
        engine: ``"pool"`` (the model through the pool) or ``"reference"`` (the same
            model on the reference engine: no pool, no prefix cache, no control port).
        compute: the model's compute on the pool: ``"one"`` engine for every instance
            (continuous batching) or ``"per-instance"`` (the goodput DP).
        credentials: file the control port's credentials are written to, mode 0600
            (``None``: where ``tokenlake.connect`` looks for this port).
        limits: what the HTTP front door accepts.
        orphan_grace_s: seconds the engines keep the cache when this process dies,
            waiting for a service with the same settings on the same control port to
            adopt them (0: they stop with it).
    """

    cluster: ClusterConfig
    host: str = "127.0.0.1"
    control_port: int = DEFAULT_CONTROL_PORT
    http_port: int = DEFAULT_HTTP_PORT
    engine: str = "pool"
    compute: str = "one"
    credentials: str | None = None
    limits: HttpLimits = field(default_factory=HttpLimits)
    orphan_grace_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.cluster, ClusterConfig):
            raise ConfigError(f"cluster must be a ClusterConfig, got {type(self.cluster).__name__}")
        if not isinstance(self.host, str) or not self.host or any(c.isspace() or c == "/" for c in self.host):
            raise ConfigError(f"host must be an address, got {self.host!r}")
        for name in ("control_port", "http_port"):
            port = getattr(self, name)
            if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
                raise ConfigError(f"{name} must be a port in 0..65535, got {port!r}")
        if self.control_port == self.http_port != 0:
            raise ConfigError(f"control_port and http_port must differ, both are {self.http_port}")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be 'pool' or 'reference', got {self.engine!r}")
        if self.compute not in COMPUTE:
            raise ConfigError(f"compute must be 'one' or 'per-instance', got {self.compute!r}")
        if not isinstance(self.limits, HttpLimits):
            raise ConfigError(f"limits must be an HttpLimits, got {type(self.limits).__name__}")
        if isinstance(self.orphan_grace_s, bool) or not isinstance(self.orphan_grace_s, (int, float)) \
                or not self.orphan_grace_s >= 0:
            raise ConfigError(f"orphan_grace_s must be >= 0, got {self.orphan_grace_s!r}")

