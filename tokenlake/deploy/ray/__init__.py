"""The pool deployed on a Ray cluster: engines and compute engines as actors in
per-instance placement-group bundles (``docs/deploy-ray.md``).

Modules, by concern:

* :mod:`~tokenlake.deploy.ray.options`: :class:`RayOptions` (placement, resources, addresses);
* :mod:`~tokenlake.deploy.ray.liveness`: :class:`ProcessRef`, an actor's process checked on its node;
* :mod:`~tokenlake.deploy.ray.host`: the host actor, owner of an instance's shared buffers on its node;
* :mod:`~tokenlake.deploy.ray.actors`: the engine actor and :class:`ComputeActor`;
* :mod:`~tokenlake.deploy.ray.client`: :func:`open_client`, an instance's client on its node;
* :mod:`~tokenlake.deploy.ray.relay`: the driver's actor table and the requests it relays to engines;
* :mod:`~tokenlake.deploy.ray.fit`: whether the bundles can fit the cluster, checked before placing them;
* :mod:`~tokenlake.deploy.ray.bundles`: the placement group, and starting and tearing down instances;
* :mod:`~tokenlake.deploy.ray.compute`: :class:`RayComputeEngine` and the compute actors' start and stop;
* :mod:`~tokenlake.deploy.ray.cluster`: :class:`RayCluster`, the public API;
* :mod:`~tokenlake.deploy.ray.serve`: :func:`serve` (``tokenlake serve --ray``).

Inside this package ``import ray`` is the Ray library (imports are absolute). Importing
it loads no torch: the actors load it when they start.
"""

from tokenlake.deploy.config import ClusterConfig
from tokenlake.deploy.ray.actors import ComputeActor
from tokenlake.deploy.ray.client import open_client
from tokenlake.deploy.ray.cluster import RayCluster
from tokenlake.deploy.ray.compute import RayComputeEngine
from tokenlake.deploy.ray.liveness import ProcessRef
from tokenlake.deploy.ray.options import RayOptions
from tokenlake.deploy.ray.serve import serve

__all__ = ["ClusterConfig", "ComputeActor", "ProcessRef", "RayCluster", "RayComputeEngine", "RayOptions",
           "open_client", "serve"]
