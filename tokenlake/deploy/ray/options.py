""":class:`RayOptions`: where and how a :class:`~tokenlake.deploy.ray.RayCluster` runs on
a Ray cluster (placement strategy, resources per instance, addresses), the actor
roles of an instance, and how options and a :class:`ClusterConfig` agree."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from tokenlake.core.errors import ConfigError
from tokenlake.deploy.config import ClusterConfig
from tokenlake.deploy.roles import ENGINE_ROLES

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: The pool's actors of an instance: the owner of its buffers, then its engines.
ACTOR_ROLES = ("host", *ENGINE_ROLES)
COMPUTE_ROLE = "compute"  # the optional compute-engine actor of an instance (start_compute)
ALL_ROLES = (*ACTOR_ROLES, COMPUTE_ROLE)
# Shares of a bundle's resources (after engine_share) taken by each actor of an instance.
_CPU_SHARE = {"host": 0.1, "query": 0.45, "transfer": 0.45}
_GPU_SHARE = {"host": 0.0, "query": 0.5, "transfer": 0.5}


@dataclass(frozen=True)
class RayOptions:
    """Where and how :class:`~tokenlake.deploy.ray.RayCluster` runs on a Ray cluster.

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
            and advertises the node's address.
        port_range: ``(first, last)``: engines bind the first free port in it (open
            these ports between nodes); ``None``: any free port.
        address: passed to ``ray.init`` when Ray is not initialised yet (``"auto"``, a
            ``host:port`` of the head, or ``None`` for a local Ray); the cluster then
            shuts Ray down again in :meth:`RayCluster.close`.
        place_timeout_s: seconds to wait for Ray to place the bundles once they are known
            to fit the cluster (they wait while other work holds the resources). Bundles
            that can never fit fail at once, whatever this is.
        insecure: no CURVE between the engines, their clients and the driver (by
            default the driver generates the cluster's keys and hands them to the actors
            with their specs; docs/security.md).
        name: the pool's name: its placement group and actors are then named and
            detached (Ray keeps them when the driver dies; a new driver adopts them by
            name, :mod:`~tokenlake.deploy.ray.orphans`); ``None``: anonymous, gone with
            the driver.
        orphan_grace_s: how long a named pool's actors wait, once the driver stopped
            heartbeating, to be adopted before they end and unlink its buffers.
    """

    strategy: str = "PACK"
    cpus_per_instance: float = 1.0
    gpus_per_instance: int = 0
    engine_share: float = 1.0
    host: str = "127.0.0.1"
    port_range: tuple[int, int] | None = None
    address: str | None = None
    place_timeout_s: float = 10.0
    insecure: bool = False
    name: str | None = None
    orphan_grace_s: float = 60.0

    def __post_init__(self) -> None:
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", str(self.name)):
            raise ConfigError(f"name must be 1-64 of [A-Za-z0-9_.-], got {self.name!r}")
        if not self.orphan_grace_s >= 0:
            raise ConfigError(f"orphan_grace_s must be >= 0, got {self.orphan_grace_s!r}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not self.cpus_per_instance > 0:
            raise ConfigError(f"cpus_per_instance must be > 0, got {self.cpus_per_instance!r}")
        if not isinstance(self.gpus_per_instance, int) or self.gpus_per_instance < 0:
            raise ConfigError(f"gpus_per_instance must be an int >= 0, got {self.gpus_per_instance!r}")
        if not self.place_timeout_s > 0:
            raise ConfigError(f"place_timeout_s must be > 0, got {self.place_timeout_s!r}")
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
        """Whether the engines bind a loopback address (one node only)."""
        return self.host.startswith("127.") or self.host in ("localhost", "lo", "::1")

    def bundle(self) -> dict[str, float]:
        """The resources of one instance's placement-group bundle."""
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


def with_options(config: ClusterConfig | int, args: tuple, fields: dict[str, Any],
                  options: RayOptions | None) -> tuple[ClusterConfig, RayOptions]:
    """A Ray pool's :class:`ClusterConfig` and :class:`RayOptions`, agreeing on ``host``
    and ``insecure`` (see :class:`RayCluster`), and refused unless it is the CPU,
    ``tokenlake``-layout pool a Ray launcher serves."""
    if options is not None and not isinstance(config, ClusterConfig):  # the options' own
        fields = {"host": options.host, "insecure": options.insecure, **fields}
    config = ClusterConfig.of(config, *args, **fields)
    if options is None:
        options = RayOptions(host=config.host, insecure=config.insecure)
    if (config.host, config.insecure) != (options.host, options.insecure):
        raise ConfigError(f"host and insecure of a RayCluster are its options': the config has "
                          f"host={config.host!r}, insecure={config.insecure}, the options "
                          f"host={options.host!r}, insecure={options.insecure}")
    if config.device != "cpu":
        raise ConfigError(f"device must be 'cpu' on Ray (its hosts make CPU shared memory), got {config.device!r}")
    if config.kv_layout != "tokenlake":
        raise ConfigError(f"kv_layout must be 'tokenlake' on Ray, got {config.kv_layout!r}")
    return config, options


def _floor4(x: float) -> float:
    """``x`` rounded down to Ray's resource precision (1e-4), at least 0."""
    return max(0.0, math.floor(x * 10_000 + 1e-6) / 10_000)
