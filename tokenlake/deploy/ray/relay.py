"""The driver's handles on a Ray cluster's actors and the calls it makes through them.

The driver never touches an engine port: everything it asks of an engine (stats,
``COPY_SEGMENT``, ``PEERS``, ``SHUTDOWN``) is a Ray call to the engine's actor, which
relays the wire message to its engine over a local socket
(:meth:`~tokenlake.deploy.ray.actors.EngineActor.request`). So the driver needs no
route to the engines' ports.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from tokenlake.core.errors import EngineUnavailable, TokenLakeError
from tokenlake.deploy.ray.liveness import ProcessRef, wait_gone

if TYPE_CHECKING:
    from tokenlake.dataplane.messages import WireMessage
    from tokenlake.deploy.base import Reply

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (role, instance)


def actor_error(exc: BaseException) -> BaseException:
    """The TokenLake error an actor raised, out of Ray's wrapper (else ``exc`` itself)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, TokenLakeError) else exc


def gather(refs: dict[Any, Any], what: str, timeout_s: float) -> dict[Any, Any]:
    """``{key: ray.get(ref)}`` for every ref, waiting at most ``timeout_s`` seconds.

    Raises:
        EngineUnavailable: no answer in time, or an actor failed (``what`` names the step).
    """
    keys = list(refs)
    try:
        values = ray.get([refs[k] for k in keys], timeout=timeout_s)
    except GetTimeoutError:
        raise EngineUnavailable(f"{what}: no answer within {timeout_s:.0f} s") from None
    except RayError as exc:
        raise EngineUnavailable(f"{what} failed: {exc}") from exc
    return dict(zip(keys, values))


class ActorTable:
    """Per ``(role, instance)``: the actor's handle, its process and (engines) its
    endpoint; and the calls the driver makes through the actors.

    Attributes:
        actors: Ray actor handles (roles ``host``, ``query``, ``transfer``, ``compute``).
        procs: their processes, once they have reported them.
        endpoints: the engines' bound endpoints (roles ``query`` and ``transfer``).
        timeout_s: how long an engine may take to answer a relayed request (seconds).
    """

    def __init__(self, timeout_s: float) -> None:
        self.actors: dict[Key, Any] = {}
        self.procs: dict[Key, ProcessRef] = {}
        self.endpoints: dict[Key, str] = {}
        self.timeout_s = timeout_s

    def request(self, key: Key, message: WireMessage, reply: type[Reply]) -> Reply:
        """Sends ``message`` to one engine through its actor; returns the answer as a
        ``reply`` (:func:`~tokenlake.dataplane.messages.expect`: an ``ERROR`` raises its
        typed exception, another kind ``WireError``).

        Raises:
            EngineUnavailable: the actor is gone, or the engine did not answer within
                ``timeout_s`` (its actor within 10 s more).
        """
        actor = self.actors.get(key)
        if actor is None:
            raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]} is not running")
        frames = _frames(message)
        try:
            answer = ray.get(actor.request.remote(frames, self.timeout_s), timeout=self.timeout_s + 10.0)
        except RayActorError:
            raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]} is not running") from None
        except GetTimeoutError:
            raise EngineUnavailable(f"the {key[0]} actor of instance {key[1]} did not answer") from None
        if answer is None:
            raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]} did not answer "
                                    f"within {self.timeout_s:.1f} s")
        return _expect(answer, reply)

    def request_all(self, keys: list[Key], message: WireMessage, reply: type[Reply],
                    strict: bool) -> dict[Key, Reply]:
        """The same request to several engines at once: ``{key: answer as a reply}``.
        ``strict``: any failure raises ``EngineUnavailable``; else it is logged and the
        key left out."""
        frames = _frames(message)
        refs = {k: self.actors[k].request.remote(frames, self.timeout_s) for k in keys if k in self.actors}
        out = {}
        for key, ref in refs.items():
            try:
                answer = ray.get(ref, timeout=self.timeout_s + 10.0)
                if answer is None:
                    raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]} did not answer")
                out[key] = _expect(answer, reply)
            except (RayError, EngineUnavailable) as exc:
                if strict:
                    raise EngineUnavailable(f"the {key[0]} engine of instance {key[1]}: {exc}") from exc
                log.warning("the %s engine of instance %d: %s", key[0], key[1], exc)
        return out

    def stop(self, keys: list[Key]) -> None:
        """Asks the actors of ``keys`` to stop (engines end their loop, compute actors
        close their client); waits at most 5 s for all of them."""
        stops = [self.actors[k].stop.remote(2.0) for k in keys if k in self.actors]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=5.0)

    def kill(self, keys: list[Key], node: str) -> None:
        """``ray.kill`` of the actors of ``keys``; waits until those on ``node`` (the
        driver's) are gone (at most 10 s)."""
        for k in keys:
            with contextlib.suppress(Exception):
                ray.kill(self.actors[k], no_restart=True)
        wait_gone((self.procs.get(k) for k in keys), node)

    def clear(self) -> None:
        """Drops every record (the actors are gone with Ray)."""
        self.actors.clear()
        self.procs.clear()
        self.endpoints.clear()

    def forget(self, keys: list[Key]) -> None:
        """Drops every record of ``keys``."""
        for k in keys:
            self.actors.pop(k, None)
            self.procs.pop(k, None)
            self.endpoints.pop(k, None)


def _frames(message: WireMessage) -> list[bytes]:
    """``message``'s frames as bytes (what a Ray call carries); msg id 1, as the actor
    waits for one reply only."""
    return [bytes(f) for f in message.encode(1)]


def _expect(frames: list[bytes], reply: type[Reply]) -> Reply:
    """The engine's answer ``frames`` as a ``reply`` (typed errors raised)."""
    from tokenlake.dataplane import messages, wire  # import torch: loaded once engines answer

    return messages.expect(wire.decode(frames), reply)
