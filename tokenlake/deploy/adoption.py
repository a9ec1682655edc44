"""A local pool that outlives its control process (docs/design.md §4 "Restart").

:class:`Adoptable` is the part of :class:`~tokenlake.deploy.local.LocalCluster` that
writes the pool's state file (:mod:`tokenlake.dataplane.pool_state`) while it runs, and
that, in a new process, adopts the engines a dead one left waiting: it checks the
settings, maps the same buffers, sends every engine ``ADOPT`` with the stored owner
keys, and rebuilds the control plane from the slots' records
(:mod:`tokenlake.core.restore`). :class:`AdoptedProcess` stands for an engine process
this one did not start (a pidfd on Linux), where the launcher expects a
``multiprocessing.Process``.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from typing import Any

from tokenlake.core.errors import AdoptionRefused, EngineUnavailable, TokenLakeError
from tokenlake.core.restore import RestoreReport, restore
from tokenlake.dataplane import pool_state
from tokenlake.dataplane.shm_files import (
    BufferSpec,
    cluster_prefix,
    list_buffers,
    mapped_buffers,
    pid_alive,
    unlink_buffer,
    unlink_prefix,
)

log = logging.getLogger(__name__)

#: settings a state file written before they existed did not name, as they were then
_ADDED_SETTINGS = {"tier_bytes": 0, "tier_path": None, "bf16_products": 0}


def check_settings(mine: dict[str, Any], state: dict[str, Any]) -> None:
    """``AdoptionRefused`` naming each setting of ``mine`` that differs from the waiting
    pool's (``state["settings"]``)."""
    theirs = {**_ADDED_SETTINGS, **state.get("settings", {})}
    diff = [f"{k} {theirs.get(k)!r} (now {v!r})" for k, v in mine.items() if theirs.get(k) != v]
    if diff:
        raise AdoptionRefused(
            f"the pool waiting to be adopted (cluster {state.get('cluster_id')}) was built "
            f"with {', '.join(diff)}: start with its settings, or let its engines end "
            "after their grace")


def refuse_if_served(state: dict[str, Any], state_file) -> None:
    """``AdoptionRefused`` while the process that wrote ``state`` still runs."""
    if pool_state.owner_alive(state):
        raise AdoptionRefused(f"the pool of {state_file} is still served by process "
                              f"{state['owner_pid']}")


def rebuild(cluster, instances) -> RestoreReport:
    """Rebuilds ``cluster``'s control plane from the records of ``instances`` (those
    whose record tables it maps), refused records cleared."""
    records, torn = [], 0
    for inst in instances:
        mine, bad = cluster.records.read(inst)
        records += mine
        torn += len(bad)
    t0 = time.perf_counter()
    report = restore(cluster.control.pool, records,
                     on_refused=lambda rec, why: cluster.records.cleared(rec.instance, rec.slot))
    log.warning("adopted the pool: %d segments restored in %.3f s (%d records refused, %d torn)",
                report.segments, time.perf_counter() - t0, len(report.refused), torn)
    return report


class AdoptedProcess:
    """An engine process started by another (dead) launcher: the ``pid``, ``sentinel``
    (a pidfd, readable once the process ended), ``is_alive``, ``join``, ``kill`` and
    ``exitcode`` (unknown: ``None``) of a ``multiprocessing.Process``."""

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = int(pid)
        try:
            self.sentinel = os.pidfd_open(self.pid)
        except (ProcessLookupError, AttributeError, OSError) as exc:
            raise EngineUnavailable(f"engine process {pid} cannot be watched: {exc}") from None

    def is_alive(self) -> bool:
        return pid_alive(self.pid) and not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def kill(self) -> None:
        try:
            signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class Adoptable:
    """State file and adoption of a :class:`LocalCluster` (a mixin)."""

    #: what the last :meth:`adopt` restored (``None``: this pool started empty)
    adopted: RestoreReport | None = None

    def settings(self) -> dict[str, Any]:
        """The settings a restart must share, by the names an operator knows them."""
        return {"model": self.model.name, "instances": self.n_instances,
                "pool_bytes": self.pool_bytes, "segment_tokens": self.segment_tokens,
                "page_tokens": self.control.config.page_tokens, "kv_dtype": self.kv_dtype,
                "kv_layout": self.kv_layout, "max_rows": self.max_rows, "device": self.layout.device,
                "share_slabs": self.share_slabs, "host": self.host, "insecure": self.insecure,
                "tier_bytes": self.config.tier_bytes, "tier_path": self.config.tier_path,
                "bf16_products": self.config.bf16_products}

    # ---------------------------------------------------------------- the state file
    def write_state(self) -> None:
        """(Re)writes the state file, if this pool has one: after a start, an adoption,
        a restarted instance, or a new leftover."""
        if self.state_file is None or self._ctx is None:
            return
        pool_state.write(self.state_file, {
            "cluster_id": self.cluster_id, "owner_pid": os.getpid(),
            "owner_start": pool_state.process_start(os.getpid()), "settings": self.settings(),
            "keys": None if self.keys is None else self.keys.to_dict(),
            "leftovers": sorted(self._leftovers),
            "engines": [[role, inst, proc.pid, self._endpoints[(role, inst)]]
                        for (role, inst), proc in self._procs.items()],
            "buffers": {str(inst): specs for inst, specs in self._specs.items()},
        })

    def note_leftover(self, path: str) -> None:
        """A file written for this pool (the control port's credentials): removed with
        the state file when the engines give up waiting."""
        self._leftovers.add(str(path))
        self.write_state()

    # ---------------------------------------------------------------- adoption
    def waiting(self, state: dict[str, Any] | None) -> bool:
        """Whether ``state`` names a pool whose engines wait to be adopted (its owner
        dead, an engine alive); ``AdoptionRefused`` while its owner still lives."""
        if state is None or not _engines_of(state):
            return False  # nothing left of it: a state file to discard
        refuse_if_served(state, self.state_file)
        return True

    def check_settings(self, state: dict[str, Any]) -> None:
        """``AdoptionRefused`` naming each setting that differs from the waiting pool's."""
        check_settings(self.settings(), state)

    def adopt(self, state: dict[str, Any]) -> RestoreReport:
        """Takes over the waiting pool of ``state`` instead of :meth:`start`: its buffers,
        engines and CURVE keys become this cluster's (its grant key is this process's
        own, handed to the engines), and the control plane is rebuilt from the slots'
        records. Raises ``AdoptionRefused`` (other settings),
        ``EngineUnavailable`` (an engine is gone or does not answer: nothing is adopted,
        the caller stops the rest with :meth:`discard`)."""
        self.check_settings(state)
        from tokenlake.dataplane.auth import ClusterKeys
        from tokenlake.dataplane.shm import BufferRegistry

        self.cluster_id = state["cluster_id"]
        self.keys = None if state["keys"] is None else ClusterKeys.from_dict(state["keys"])
        # self.grant_key stays this process's fresh one: ADOPT hands it to the engines,
        # and no grant the dead owner signed is taken again
        self._leftovers.update(state.get("leftovers", ()))
        self._registry = BufferRegistry(cluster_prefix(self.cluster_id))
        try:
            self._take_over(state)
            report = rebuild(self, range(self.n_instances))
            self.adopt_tiers()
        except BaseException:
            self._release_adopted()
            raise
        self._watcher.start()
        self.adopted = report
        self.write_state()
        return report

    def _take_over(self, state: dict[str, Any]) -> None:
        import zmq

        from tokenlake.dataplane.messages import Ack, Adopt

        self._specs = {int(i): specs for i, specs in state["buffers"].items()}
        for inst, specs in self._specs.items():
            for name, raw in specs.items():
                made = self._registry.adopt(BufferSpec.from_dict(raw))
                self._buffers[(inst, name)], self._made[(inst, name)] = made.tensor, made.spec
            if (inst, "records") in self._buffers:
                self.records.attach(inst, self._buffers[(inst, "records")])
        with self._watch_lock:
            for role, inst, pid, endpoint in state["engines"]:
                self._procs[(role, int(inst))] = AdoptedProcess(pid)
                self._endpoints[(role, int(inst))] = endpoint
        self._ctx = zmq.Context()
        keys = list(self._endpoints)
        self._request_all(keys, Adopt(os.getpid(), self.grant_key), Ack)
        mine = {spec.name for spec in self._made.values()}  # the dead owner's sessions' go
        for name in list_buffers(self._registry.prefix):
            if name not in mine:
                unlink_buffer(name)

    def _release_adopted(self) -> None:
        """An adoption that failed: forget the engines and buffers without stopping or
        unlinking them (they are still the dead owner's, and wait out their grace)."""
        with self._watch_lock:
            for proc in self._procs.values():
                if isinstance(proc, AdoptedProcess):
                    proc.close()
            self._procs.clear()
        self._endpoints.clear()
        self._buffers.clear()
        self._made.clear()
        for inst in range(self.n_instances):
            self.records.detach(inst)
        if self._registry is not None:
            self._registry._buffers.clear()  # mapped, not ours to unlink
            self._registry = None
        if self._ctx is not None:
            self._driver.close()
            self._close_tier_sockets()
            self._ctx.term()
            self._ctx = None
        from tokenlake.dataplane.auth import ClusterKeys

        # a cold start after this is another pool: none of the dead one's identity
        self.cluster_id, self._leftovers = "", set()
        self.keys = None if self.keys is None else ClusterKeys.generate()

    def discard(self, state: dict[str, Any]) -> None:
        """Ends a waiting pool that will not be adopted (its engines killed, its buffers
        and state file removed): what a restart does when adoption failed."""
        for pid in _engines_of(state):  # never a process that took a dead engine's pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        cid = state.get("cluster_id")
        if isinstance(cid, str):
            try:
                unlink_prefix(cluster_prefix(cid))  # its doorbells too: a killed engine left its FIFO
            except Exception as exc:  # noqa: BLE001 - a malformed state file: nothing of it to unlink
                log.warning("discarding the waiting pool: %s", exc)
            pool_state.forget(self.state_file, cid)


def _engines_of(state: dict[str, Any]) -> list[int]:
    """The pids of ``state``'s engines that still run: live processes that map a buffer
    of its cluster (a pid taken over by another process since does not count)."""
    try:
        prefix = cluster_prefix(state["cluster_id"])
        pids = [int(pid) for _, _, pid, _ in state.get("engines", ())]
    except (KeyError, TypeError, ValueError, TokenLakeError):  # a malformed file
        return []
    return [pid for pid in pids if pid_alive(pid) and mapped_buffers(prefix, [pid])]
