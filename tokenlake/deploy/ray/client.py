""":func:`open_client`: an instance's data-plane client, opened on the instance's node.

A client maps its instance's ``q``/``out``/``kv`` buffers, so it must run on that node:
in the driver when the driver runs there (always on one machine), otherwise in an actor
scheduled with :meth:`RayCluster.scheduling_strategy` (the compute actors do this).
"""

from __future__ import annotations

from typing import Any

import ray
import zmq

from tokenlake.core.errors import ConfigError
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.deploy.ray.liveness import ProcessRef
from tokenlake.deploy.roles import ENGINE_ROLES


def open_client(info: dict[str, Any], ctx: zmq.Context | None = None, timeout_s: float | None = None):
    """An :class:`~tokenlake.dataplane.client.InstanceClient` from :meth:`RayCluster.client_info`.

    Call it on the instance's node: in the driver when it runs there, otherwise in a
    compute-engine actor scheduled with :meth:`RayCluster.scheduling_strategy`. The
    client maps the instance's buffers and connects to its engines; it sees a dead
    engine (its pid gone on this node) as ``EngineUnavailable``. ``ctx`` is the zmq
    context (``zmq.Context.instance()`` by default); ``timeout_s`` overrides the
    cluster's wait limit (seconds). Close the client when done.

    Raises:
        ConfigError: called on another node than the instance's.
    """
    from tokenlake.dataplane.auth import ClusterKeys
    from tokenlake.dataplane.client import InstanceClient  # imports torch (the wire)

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

    keys = info.get("keys")
    client = InstanceClient(instance, dict(info["endpoints"]), buffers, dead,
                            info["timeout_s"] if timeout_s is None else timeout_s,
                            keys=None if keys is None else ClusterKeys.from_dict(keys), as_owner=True)
    client.start(ctx if ctx is not None else zmq.Context.instance())
    return client
