"""The pool deployed on a Ray cluster: engines and compute engines as actors in
per-instance placement-group bundles (``docs/deploy-ray.md``).

Inside this package ``import ray`` is the Ray library (imports are absolute).
"""

from tokenlake.deploy.ray.cluster import (
    ComputeActor,
    ProcessRef,
    RayCluster,
    RayComputeEngine,
    RayOptions,
    open_client,
    serve,
)

__all__ = ["ComputeActor", "ProcessRef", "RayCluster", "RayComputeEngine", "RayOptions",
           "open_client", "serve"]
