"""What a :class:`~tokenlake.deploy.ray.RayCluster` does to outlive its driver (a
mixin; docs/deploy-ray.md "When the driver dies"): the driver's heartbeats, the slot
records of the instances on its node, the pool's state file, and :meth:`adopt`, which
takes over a named pool a dead driver left (:mod:`~tokenlake.deploy.ray.orphans`)."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import ray

from tokenlake.core.restore import RestoreReport
from tokenlake.dataplane import pool_state
from tokenlake.dataplane.shm import SharedTensor
from tokenlake.dataplane.shm_files import BufferSpec
from tokenlake.deploy.adoption import check_settings, rebuild, refuse_if_served
from tokenlake.deploy.ray.orphans import NAMESPACE, Heartbeat, actor_name

log = logging.getLogger(__name__)


class RayAdoptable:
    """The driver's part of a named pool that outlives it (see the module docstring)."""

    adopted: RestoreReport | None = None
    state_file: str | None = None

    def settings(self) -> dict[str, Any]:
        """The settings a new driver must share to adopt this pool."""
        o = self.options
        return {"model": self.model.name, "instances": self.n_instances, "pool_bytes": self.pool_bytes,
                "segment_tokens": self.segment_tokens, "page_tokens": self.control.config.page_tokens,
                "kv_dtype": self.kv_dtype, "max_rows": self.max_rows, "host": o.host,
                "insecure": o.insecure, "strategy": o.strategy, "cpus_per_instance": o.cpus_per_instance,
                "gpus_per_instance": o.gpus_per_instance, "name": o.name,
                "bf16_products": self.config.bf16_products}

    # ------------------------------------------------------------- heartbeats
    def _start_heartbeat(self) -> None:
        if self._bundles.grace_s and self._heartbeat is None:
            table = self._bundles.table
            self._heartbeat = Heartbeat(lambda: [a for (r, _), a in list(table.actors.items())
                                                 if r != "compute"])
            self._heartbeat.start()

    def _stop_threads(self) -> None:
        """Stops the heartbeat and the tier driver's fencing (before the sockets close)."""
        self._stop_heartbeat()
        self._stop_tier_fencing()

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    # ------------------------------------------------------------- slot records
    def _attach_records(self, instances) -> None:
        """Maps the record tables of ``instances`` whose host is on the driver's node
        (the control plane writes them; an instance on another node keeps none, so a
        new driver restores nothing there)."""
        for i in instances:
            spec = self._bundles.hosts[i].buffers.get("records")
            if spec is None or self._bundles.table.procs[("host", i)].node != self._bundles.node:
                continue
            shared = self._record_maps[i] = SharedTensor.attach(BufferSpec.from_dict(spec))
            self.records.attach(i, shared.tensor)

    def _detach_records(self, instances) -> None:
        for i in instances:
            self.records.detach(i)
            shared = self._record_maps.pop(i, None)
            if shared is not None:
                shared.close()

    # ------------------------------------------------------------- state file
    def write_state(self) -> None:
        """(Re)writes the state file of a named pool (``state_file``)."""
        if self.state_file is None or self.options.name is None or self._bundles.pg is None:
            return
        pool_state.write(self.state_file, {
            "cluster_id": self.options.name, "owner_pid": os.getpid(),
            "owner_start": pool_state.process_start(os.getpid()), "settings": self.settings(),
            "keys": None if self.keys is None else self.keys.to_dict(),
            "leftovers": sorted(self._leftovers), "engines": [],
        })

    def note_leftover(self, path: str) -> None:
        """A file written for this pool: removed with the state file when its actors end."""
        self._leftovers.add(str(path))
        self.write_state()

    # ------------------------------------------------------------- adoption
    def waiting(self, state: dict[str, Any] | None) -> bool:
        """Whether the named pool of ``state`` waits on Ray to be adopted (its driver
        gone, its first host there); ``AdoptionRefused`` while its driver lives."""
        if state is None or self.options.name is None:
            return False
        self._ensure_ray()
        try:
            ray.get_actor(actor_name(self.options.name, "host", 0), namespace=NAMESPACE)
        except ValueError:
            return False  # nothing left of it: a state file to discard
        refuse_if_served(state, self.state_file)
        return True

    def check_settings(self, state: dict[str, Any]) -> None:
        check_settings(self.settings(), state)

    def adopt(self, state: dict[str, Any]) -> RestoreReport:
        """Takes over the waiting named pool of ``state`` instead of :meth:`start` (its
        keys, actors and buffers; the control plane rebuilt from the records of the
        instances on this node). ``AdoptionRefused`` for other settings;
        ``EngineUnavailable`` when an actor is gone (nothing adopted)."""
        from tokenlake.dataplane.auth import ClusterKeys

        self.check_settings(state)
        self._ensure_ray()
        self.keys = None if state["keys"] is None else ClusterKeys.from_dict(state["keys"])
        self._bundles.keys = self.keys  # the grant key stays this driver's own (ADOPT carries it)
        self._leftovers.update(state.get("leftovers", ()))
        import zmq

        try:
            self._bundles.adopt(self.n_instances)
        except BaseException:
            self._bundles.table.clear()
            self._bundles.pg = None
            raise
        self._ctx = zmq.Context()
        self._start_heartbeat()
        self._attach_records(range(self.n_instances))
        self.adopted = rebuild(self, list(self._record_maps))  # the instances on this node
        self.adopt_tiers()  # the copies the transfer engines' tiers still hold
        self.write_state()
        return self.adopted

    def discard(self, state: dict[str, Any] | None) -> None:
        """Ends what is left of the named pool of ``state`` (its actors, its placement
        group, its state file): a restart that will not adopt it."""
        pool = self.options.name
        if state is None or pool is None:
            return
        from ray.util.placement_group import get_placement_group, remove_placement_group

        from tokenlake.deploy.ray.orphans import group_name

        self._ensure_ray()
        for i in range(int(state.get("settings", {}).get("instances", self.n_instances))):
            for role in ("host", "query", "transfer"):
                with contextlib.suppress(ValueError):
                    ray.kill(ray.get_actor(actor_name(pool, role, i), namespace=NAMESPACE), no_restart=True)
        with contextlib.suppress(ValueError):
            remove_placement_group(get_placement_group(group_name(pool)))
        pool_state.forget(self.state_file, state.get("cluster_id", ""))

    def _ensure_ray(self) -> None:
        if not ray.is_initialized():
            log.info("connecting to Ray (address %s)", self.options.address or "local")
            ray.init(address=self.options.address,
                     namespace=NAMESPACE if self.options.name is not None else None)
            self._owns_ray = True

    def _forget_state(self) -> None:
        """Removes the state file if this driver wrote it (a driver that refused or
        failed to adopt leaves the waiting pool's)."""
        if self.options.name is not None:
            with contextlib.suppress(OSError):
                pool_state.forget(self.state_file, self.options.name, os.getpid())
