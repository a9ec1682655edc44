"""The pool's slabs mapped in a vLLM worker on the pool's machine: what the load mode
copies pages from and the query mode attends in place, instead of asking the engines.

A CPU instance's slab is POSIX shared memory that the control server names
(``CP_CLIENT_INFO_RESULT.slab``); a client on another machine (or in another
``/dev/shm``) cannot map it, nor one of a GPU pool or a Ray instance, which are not
offered: those go by message. Only slots that the caller's lease or plan holds may be
read, and only while it holds them (docs/security.md "Reading slabs in place").
"""

from __future__ import annotations

import logging
import os

import torch

from tokenlake.dataplane.shm import SharedTensor

log = logging.getLogger(__name__)


class SlabMaps:
    """Instances' slabs, each mapped on first use and kept until :meth:`close`. ``cp``
    gives ``client_info(instance).slab``, or with ``home`` every slab from the home
    instance's ``client_info`` (``slab`` and ``peer_slabs``: no session is opened on the
    other instances for it); ``env``: an environment variable that, set to ``"0"``, maps
    none (every read by message); ``what`` names the use in the log."""

    def __init__(self, cp, env: str, what: str, home: int | None = None) -> None:
        self.cp, self.env, self.what, self.home = cp, env, what, home
        self._maps: dict[int, SharedTensor | None] = {}  # instance -> its slab mapped, or None

    def get(self, instance: int) -> torch.Tensor | None:
        """``instance``'s slab mapped in this process, or ``None`` (not offered, not
        mappable here, or turned off). A failure to ask the control server is raised and
        asked again next time."""
        if instance not in self._maps:
            self._maps[instance] = self._map(instance)
        shared = self._maps[instance]
        return None if shared is None else shared.tensor

    def _map(self, instance: int) -> SharedTensor | None:
        if os.environ.get(self.env, "1") == "0":
            return None
        if self.home is None or instance == self.home:
            spec = self.cp.client_info(instance).slab
        else:  # another instance's, from the home's answer (no session opened there)
            spec = dict(self.cp.client_info(self.home).peer_slabs).get(instance)
        if spec is None or spec.is_cuda:
            return None
        try:
            shared = SharedTensor.attach(spec)
        except Exception as e:
            log.info("instance %d's slab is not mappable here (%s): %s by message", instance, e, self.what)
            return None
        log.info("instance %d's slab mapped (%s): %s in place", instance, spec.name, self.what)
        return shared

    def close(self) -> None:
        """Unmaps the slabs (the pool still owns them)."""
        for shared in self._maps.values():
            if shared is not None:
                shared.close()
        self._maps.clear()
