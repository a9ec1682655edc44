"""An engine and its owner: noticing that the control process died, waiting to be
adopted by a new one, and giving up (docs/design.md §4 "Restart").

:class:`OwnerWatch` is the part of :class:`~tokenlake.engines.loop.EngineLoop`
that watches the launcher (``EngineSpec.owner_pid``, and the parent process). Once it
is gone (``kill -9``, an OOM kill, a crash):

* with ``orphan_grace_s`` 0 the loop ends and the engine unlinks its cluster's buffers
  (nobody else will);
* otherwise every plan of every session is dropped (their iterations died with the
  owner's control plane; a new one starts afresh), client sessions are closed, and the
  engine keeps its slab mapped and its port bound, waiting up to ``orphan_grace_s`` for
  an ``ADOPT`` from a process holding the owner's keys. Adopted, it watches the new
  owner; not adopted in time, it ends as above and removes the pool's state file.
"""

from __future__ import annotations

import logging
import os
import time

from tokenlake.core.errors import NotAuthorized
from tokenlake.dataplane.messages import Adopt
from tokenlake.dataplane.shm_files import pid_alive
from tokenlake.engines.sessions import OWNER_SESSION

log = logging.getLogger(__name__)


class OwnerWatch:
    """The owner watch of an engine (a mixin of ``EngineLoop``, which provides ``spec``,
    ``sessions``, ``drop_session`` and the session bookkeeping)."""

    def _init_owner(self) -> None:
        self._parent: int | None = os.getppid()
        self.owner_pid: int | None = self.spec.owner_pid
        self.orphaned = False  # the owner died and nobody adopted: run_engine unlinks
        self.waiting_since: float | None = None  # time.monotonic() the owner was found gone
        self.adoptions = 0
        #: where the owner is no local process (a Ray driver): whether it is alive (its
        #: heartbeats arrive), set by the actor that runs this engine
        self.owner_alive = None
        self._owner_checked = 0.0  # time.monotonic() of the last look

    def owner_gone(self) -> bool:
        """Called every tick: True when the loop should end (the owner is gone and no
        grace is left). Looked at once a tick at most (not after every message)."""
        now = time.monotonic()
        if now - self._owner_checked < self.tick_s:
            return False
        self._owner_checked = now
        if self.waiting_since is not None:
            return self._grace_over()
        if self.owner_alive is not None:
            if self.owner_alive():
                return False
            why = "the driver stopped heartbeating"
        elif self.owner_pid is not None:  # the owner's pid decides (not the forkserver's)
            if pid_alive(self.owner_pid):
                return False
            why = f"owner process {self.owner_pid} is gone"
        elif self._parent is not None and os.getppid() != self._parent:
            why = "parent process is gone"
        else:
            return False
        if (self.owner_pid is None and self.owner_alive is None) or self.spec.orphan_grace_s <= 0:
            log.warning("%s; %s engine %d stops", why, self.spec.role, self.spec.instance)
            self.orphaned = self.owner_pid is not None  # its buffers are nobody's now
            return True  # (a Ray engine's buffers are its host actor's to unlink)
        log.warning("%s; %s engine %d keeps its slab and waits %.0f s to be adopted", why,
                    self.spec.role, self.spec.instance, self.spec.orphan_grace_s)
        self._orphan()
        return False

    def _grace_over(self) -> bool:
        """While waiting to be adopted: True once the grace is over. A Ray driver whose
        heartbeats come back (it was stalled, not dead) ends the wait: what it had in
        flight here is gone, and its next requests fail as a dead engine's would."""
        if self.owner_alive is not None and self.owner_alive():
            log.warning("the driver is heard again: %s engine %d serves it", self.spec.role,
                        self.spec.instance)
            self.waiting_since = None
            return False
        if time.monotonic() - self.waiting_since < self.spec.orphan_grace_s:
            return False
        log.warning("not adopted within %.0f s: %s engine %d stops and unlinks its "
                    "cluster's buffers", self.spec.orphan_grace_s, self.spec.role, self.spec.instance)
        self.orphaned = self.owner_alive is None
        return True

    def _orphan(self) -> None:
        """The owner died: what it and its clients had in flight here goes."""
        self.waiting_since = time.monotonic()
        self._parent = None  # a reparented engine's parent is no one's business now
        for token in list(self.sessions):
            self.drop_session(token)
            if token != OWNER_SESSION:
                self.close_bell(token)
                for m in self._session_maps.pop(token, []):
                    m.close()
                del self.sessions[token]
        self._closing.clear()
        self._retired.clear()
        self._pending.clear()

    def _adopt(self, message: Adopt) -> None:
        """A new control process takes over (owner keys checked by the caller). An
        engine that had not noticed its owner's death yet drops what it left first."""
        if self.waiting_since is None:
            if message.owner_pid == self.owner_pid:
                return  # adopted by this very owner already
            if self.owner_alive is not None and self.owner_alive():
                raise NotAuthorized("the pool's driver is alive (its heartbeats arrive): it "
                                    "cannot be adopted")
            if self.owner_alive is None and self.owner_pid is not None and pid_alive(self.owner_pid):
                raise NotAuthorized(f"the pool's owner (pid {self.owner_pid}) is alive: it "
                                    "cannot be adopted")
            self._orphan()
        self.owner_pid = message.owner_pid  # (a Ray engine watches its heartbeats instead)
        if message.grant_key is not None:  # the dead owner's grants are worthless from now on
            if len(message.grant_key) < 16:
                raise NotAuthorized("a grant key has at least 16 bytes")
            self.grant_key = message.grant_key
        self.waiting_since = None
        self.adoptions += 1
        log.warning("%s engine %d adopted by process %d", self.spec.role, self.spec.instance,
                    message.owner_pid)
