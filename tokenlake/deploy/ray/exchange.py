"""The K/V exchange of sequence-parallel sub-batches between Ray compute actors.

The sub-batches of a DoP > 1 batch run on the compute actors of their home instances,
possibly on different nodes. A sub-batch whose last request continues in later
sub-batches publishes that request's K/V rows of every layer
(:mod:`tokenlake.engines.exchange` says what and why); here the rows also go, by an actor
call per later home, into the mailbox of each later sub-batch's actor, where its
``collect`` finds them. The call is fire-and-forget: a lost one surfaces as the
receiver's timeout, and a dead receiver as the driver's ``EngineUnavailable``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from tokenlake.engines.exchange import LocalExchange


class ActorExchange(LocalExchange):
    """An iteration's mailbox on one compute actor that also pushes what it publishes to
    the actors of the later sub-batches (``peers``: ``{instance: actor handle}``;
    ``groups``: each batch's homes in part order, the plans' ``groups``)."""

    def __init__(self, iteration: int, instance: int, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.iteration, self.instance = iteration, instance
        self.peers: dict[int, Any] = {}
        self.groups: tuple[tuple[int, ...], ...] = ()

    def publish(self, batch: int, part: int, layer: int, request_id: str,
                k: torch.Tensor, v: torch.Tensor) -> None:
        super().publish(batch, part, layer, request_id, k, v)
        later = dict.fromkeys(h for h in self.groups[batch][part + 1 :] if h != self.instance)
        if later:
            kn, vn = k.numpy(), v.numpy()
            for home in later:
                self.peers[home].kv_in.remote(self.iteration, batch, part, layer, request_id, kn, vn)


class Mailboxes:
    """The exchanges of the iterations a compute actor has seen rows for: rows may
    arrive before the actor starts that iteration's run. Older iterations' boxes go
    when a newer iteration starts."""

    def __init__(self, instance: int, timeout_s: float = 60.0) -> None:
        self.instance, self.timeout_s = instance, timeout_s
        self._boxes: dict[int, ActorExchange] = {}
        self._lock = threading.Lock()

    def box(self, iteration: int) -> ActorExchange:
        with self._lock:
            ex = self._boxes.get(iteration)
            if ex is None:
                ex = self._boxes[iteration] = ActorExchange(iteration, self.instance, self.timeout_s)
            return ex

    def deliver(self, iteration: int, batch: int, part: int, layer: int, request_id: str,
                k: np.ndarray, v: np.ndarray) -> None:
        """Files rows pushed by another actor (copied: Ray's arrays are read-only)."""
        LocalExchange.publish(self.box(iteration), batch, part, layer, request_id,
                              torch.from_numpy(np.array(k)), torch.from_numpy(np.array(v)))

    def start(self, iteration: int, groups, peers: dict[int, Any]) -> ActorExchange:
        """The box of ``iteration``, wired to push to ``peers``; drops older boxes."""
        with self._lock:
            for old in [i for i in self._boxes if i < iteration]:
                del self._boxes[old]
        ex = self.box(iteration)
        ex.groups, ex.peers = tuple(map(tuple, groups)), dict(peers)
        return ex

    def finish(self, iteration: int) -> None:
        with self._lock:
            self._boxes.pop(iteration, None)
