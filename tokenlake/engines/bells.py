"""The doorbells an engine serves: per session, a ring of per-layer hand-offs in shared
memory (:mod:`tokenlake.dataplane.doorbell`), read when the session's FIFO rings.

:class:`EngineBells` is the part of :class:`~tokenlake.engines.loop.EngineLoop` that
opens a session's bell with its buffers (the owner's at start, a client session's on
``OPEN_SESSION``), closes it with them, registers the FIFOs in the loop's poller, and
serves each entry as the message it stands for (:meth:`handle_bell`: a ``QUERY`` for a
query engine, a ``PUT`` for a transfer engine), in the session's order: before a
request of a session is served from the socket, what the session posted on its bell
first is taken. Other fds the loop polls (work done on a thread beside it: a disk tier's
reads) are served through :meth:`EngineBells.add_waker`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from tokenlake.dataplane.doorbell import EngineBell
from tokenlake.dataplane.shm_files import BufferSpec, shm_dir
from tokenlake.engines.sessions import Caller

log = logging.getLogger(__name__)

#: How an engine answers one hand-off: ``answer(None)`` served, ``answer(exc)`` failed.
Answer = Callable[[BaseException | None], None]


class EngineBells:
    """Doorbells of an engine's sessions (a mixin of ``EngineLoop``, which provides
    ``spec``, ``slab`` (once mapped) and ``_peers_changed``)."""

    def _init_bells(self) -> None:
        self.bells: dict[bytes, EngineBell] = {}  # session token -> its bell here
        self._bell_fds: dict[int, bytes] = {}  # FIFO fd -> session token
        self._wakers: dict[int, Callable[[], None]] = {}  # other fds the loop polls -> what serves them
        self.bell_handoffs = 0  # entries served (read by tests and PING)

    def add_waker(self, fd: int, serve: Callable[[], None]) -> None:
        """Has the loop call ``serve()`` whenever ``fd`` is readable (work done beside it)."""
        self._wakers[fd] = serve
        self._peers_changed = True

    def polled_fds(self) -> list[int]:
        """The raw fds the loop polls: the bells' FIFOs and the wakers'."""
        return [*self._bell_fds, *self._wakers]

    def serve_fd(self, fd: int) -> None:
        """Serves a readable fd of :meth:`polled_fds`."""
        if fd in self._wakers:
            self._wakers[fd]()
        else:
            self.serve_bell(self._bell_fds[fd])

    def open_bell(self, token: bytes, tensor: torch.Tensor | None, spec: BufferSpec | None) -> None:
        """Opens session ``token``'s bell (its ``bell`` buffer, if the layout has one)."""
        if tensor is None or spec is None or spec.is_cuda:
            return
        self.close_bell(token)
        bell = EngineBell(self.spec.role, tensor, os.path.join(shm_dir(), spec.name))
        self.bells[token] = bell
        self._bell_fds[bell.fd] = token
        self._peers_changed = True  # the poller is built again with the FIFO in it

    def close_bell(self, token: bytes, unlink: bool = True) -> None:
        bell = self.bells.pop(token, None)
        if bell is not None:
            self._bell_fds.pop(bell.fd, None)
            bell.close(unlink)
            self._peers_changed = True

    def close_bells(self) -> None:
        for token in list(self.bells):
            self.close_bell(token)

    def serve_bell(self, token: bytes) -> None:
        """Serves every entry session ``token`` posted since its bell was last read."""
        bell = self.bells.get(token)
        if bell is None:
            return
        caller = Caller(None, token)
        entries = bell.take()
        if not entries and bell.await_expected():  # a heads-up: the entry came while spinning
            entries = bell.take()
        for seq, plan, layer, layers in entries:
            answer = self._answer_bell(bell, seq)
            try:
                self.handle_bell(caller, plan, layer, layers, answer)
            except Exception as exc:  # a bad entry fails alone, as a bad message does
                answer(exc)

    def serve_bell_first(self, token: bytes | None) -> None:
        """Before a socket request of session ``token``: what it posted earlier goes first."""
        bell = self.bells.get(token) if token is not None else None
        if bell is not None and bell.pending():
            self.serve_bell(token)

    def _answer_bell(self, bell: EngineBell, seq: int) -> Answer:
        def answer(exc: BaseException | None) -> None:
            slab = getattr(self, "slab", None)
            if exc is None and slab is not None and slab.is_cuda:  # done means the GPU's work too
                torch.cuda.current_stream(slab.device).synchronize()
            if exc is not None:
                log.debug("%s engine %d: hand-off %d failed: %s", self.spec.role, self.spec.instance, seq, exc)
            self.bell_handoffs += 1
            if self.bells.get(self._bell_fds.get(bell.fd, b"?")) is bell:  # still open
                bell.finish(seq, exc)
        return answer

    def handle_bell(self, caller: Caller, plan: int, layer: int, layers: int, answer: Answer) -> None:  # pragma: no cover
        """Serves one hand-off of ``caller``'s session (subclasses); ``answer`` once."""
        raise NotImplementedError
