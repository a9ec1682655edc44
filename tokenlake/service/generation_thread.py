"""One thread runs the serving iterations; asyncio callers submit requests and stream
their tokens (continuous batching behind an async API).

:class:`GenerationThread` owns a server -- :class:`~tokenlake.generation.loop.Server` on the
pool or the baseline :class:`~tokenlake.generation.reference.ReferenceLoop` --
and calls it from its own thread only: requests and cancellations are posted to an
inbox and applied between iterations, every iteration batches whatever is live at that
moment, and each new token is handed to the asyncio loop of the caller that submitted
the request (``call_soon_threadsafe``). A caller that stops listening (its HTTP client
went away) cancels its request, which frees the request's leases and slots before the
next iteration. A request that fails on its own (the backend's ``on_error``: its
sampling, its token) raises :class:`RequestFailed` to its caller alone; a failed
iteration ends the requests it was serving (:class:`EngineFailed`).

    loop = GenerationThread(server).start()
    stream = await loop.submit(GenerationRequest("r1", prompt_ids, 16))  # BadRequest: refused
    async for event in stream:  # TokenEvent ... the last one has .done
        ...
    loop.close()
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from tokenlake.core.errors import TokenLakeError
from tokenlake.generation.requests import BadRequest, GenerationRequest, RequestResult

log = logging.getLogger(__name__)


class ServingBackend(Protocol):
    """What the loop needs of a server (``GenerationLoop``, ``ReferenceLoop``). The loop sets
    ``on_token`` and ``on_error`` (``(request_id, message)``: that request failed on its
    own, its result has ``finish_reason == "error"``; a backend may never call it)."""

    on_token: Callable[[str, int], None] | None
    on_error: Callable[[str, str], None] | None
    results: dict[str, RequestResult]

    @property
    def busy(self) -> bool: ...

    def submit(self, req: GenerationRequest) -> RequestResult: ...

    def step(self) -> None: ...

    def cancel(self, request_id: str) -> bool: ...

    def pop_result(self, request_id: str) -> RequestResult | None: ...

    def counts(self) -> tuple[int, int]: ...


class EngineFailed(TokenLakeError, RuntimeError):
    """An iteration failed; the requests it was serving were ended."""


class LoopClosed(TokenLakeError, RuntimeError):
    """The loop is stopping or stopped: no new requests."""


class RequestFailed(TokenLakeError, RuntimeError):
    """This request failed on its own (its sampling, its token, its detokenizing); the
    requests served beside it go on."""


_CLOSED = object()  # wakes a stream's reader when the stream is closed


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of a request; the last one has ``done`` and ``finish_reason``
    (``"stop"``, ``"length"``). ``hit_tokens``: prompt tokens the pool served it."""

    token_id: int
    index: int
    done: bool
    finish_reason: str | None
    hit_tokens: int
    prompt_tokens: int


@dataclass
class LoopObserver:
    """Callbacks a service's metrics hang on the loop (all optional; seconds)."""

    first_token: Callable[[float], None] = lambda s: None
    between_tokens: Callable[[float], None] = lambda s: None
    iteration: Callable[[float], None] = lambda s: None
    finished: Callable[[RequestResult], None] = lambda r: None
    #: after each iteration, the instances it gave each phase (backends that say so)
    phases: Callable[[dict[str, int]], None] = lambda p: None


class RequestStream:
    """The events of one request, in order; iterate with ``async for``. Leaving the
    iteration early (or closing the stream) cancels the request."""

    def __init__(self, owner: GenerationThread, request_id: str, prompt_tokens: int,
                 aloop: asyncio.AbstractEventLoop) -> None:
        self.request_id, self.prompt_tokens = request_id, prompt_tokens
        self._owner, self._aloop = owner, aloop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.accepted: asyncio.Future = aloop.create_future()
        self.finished = False
        self.submitted_s = time.perf_counter()
        self.last_s: float | None = None
        self.hit_tokens = 0  # prompt tokens the pool served (known with the first token)

    def _deliver(self, item) -> bool:
        """Engine thread -> the caller's loop; False when that loop is closed (the
        caller is gone: the owner cancels the request)."""
        try:
            self._aloop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    def _settle(self, error: BaseException | None) -> None:
        def settle() -> None:
            if not self.accepted.done():
                if error is None:
                    self.accepted.set_result(True)
                else:
                    self.accepted.set_exception(error)
        try:
            self._aloop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's loop is closed: nobody waits for the answer
            pass

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        async for batch in self.batches():
            for event in batch:
                yield event

    async def batches(self) -> AsyncIterator[list[TokenEvent]]:
        """The events in order, as lists of those that had arrived when the reader
        asked (one at least): a reader that does some work per wake-up, such as a hop to
        a worker thread, does it once for all of them. Leaving early cancels the request;
        a failure is raised after the events before it."""
        try:
            while not self.finished:
                items = [await self._queue.get()]
                while not self._queue.empty():
                    items.append(self._queue.get_nowait())
                batch: list[TokenEvent] = []
                for item in items:
                    if item is _CLOSED:  # closed while this reader waited: no more events
                        self.finished = True
                        break
                    if isinstance(item, BaseException):
                        self.finished = True
                        if batch:
                            yield batch
                        raise item
                    self.finished, self.hit_tokens = item.done, item.hit_tokens
                    batch.append(item)
                    if item.done:
                        break
                if batch:
                    yield batch
        finally:
            self.close()

    def close(self) -> None:
        """Cancels the request unless it finished (idempotent); a reader waiting for its
        next event stops waiting (the iteration ends). Call it on the caller's loop."""
        if not self.finished:
            self.finished = True
            self._owner.cancel(self.request_id)
            self._queue.put_nowait(_CLOSED)


class GenerationThread:
    """Runs ``server``'s iterations on a thread (see the module docstring).

    Args:
        server: the backend; the loop installs its ``on_token``.
        observer: timing callbacks (metrics).
        heal: called on the engine thread, between iterations, after a failed iteration
            and when :meth:`request_heal` asks (an engine died); returns True when it
            repaired something (the local pool replaces dead instances and preempts the
            requests that lost KV there). After a failed iteration that ``heal`` repaired,
            the live requests go on (up to :attr:`max_retries` failures in a row);
            otherwise they end with an error.
    """

    #: failed iterations in a row that heal may repair before the live requests are ended
    max_retries = 3

    def __init__(self, server: ServingBackend, observer: LoopObserver | None = None,
                 heal: Callable[[], bool] | None = None) -> None:
        self.server = server
        self.heal = heal  # repairs after a failure (e.g. replaces dead engines)
        self._failed_in_a_row = 0
        self.recoveries = 0  # times heal repaired something (metrics and tests read it)
        self.observer = observer or LoopObserver()
        server.on_token = self._on_token
        server.on_error = self._on_error
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._closing = False
        self._thread: threading.Thread | None = None
        self.posted = 0  # requests posted, not yet applied
        self.queue_length = 0  # requests waiting for admission (metrics read it)
        self.running = 0  # requests admitted and not done

    def start(self) -> GenerationThread:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenlake-engine",
                                            daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Ends every live request (``LoopClosed``) and stops the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------ callers' side
    async def submit(self, req: GenerationRequest) -> RequestStream:
        """Queues ``req``; returns its stream once the server accepted it. Raises
        :class:`BadRequest` (refused: nothing else changed) or :class:`LoopClosed`."""
        stream = RequestStream(self, req.request_id, len(req.prompt_ids),
                               asyncio.get_running_loop())
        self._post("submit", (req, stream))
        await stream.accepted
        return stream

    def cancel(self, request_id: str) -> None:
        """Ends a live request before the next iteration (no-op once it is done)."""
        self._post("cancel", request_id)

    def request_heal(self) -> None:
        """Asks the engine thread to run ``heal`` before its next iteration (any thread;
        the local pool's watcher calls it when an engine dies)."""
        self._post("heal", None)

    def _post(self, what: str, item: object) -> None:
        with self._cv:
            if self._closing:
                if what == "submit":
                    raise LoopClosed("the server is shutting down")
                return
            self._inbox.append((what, item))
            self.posted += what == "submit"
            self._cv.notify()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug: say so, and leave no caller waiting
            log.exception("the engine thread failed")
            with self._cv:
                self._closing = True
                inbox, self._inbox = self._inbox, []
            for what, item in inbox:
                if what == "submit":
                    item[1]._settle(LoopClosed(f"the engine thread failed: {e}"))
            for stream in self._streams.values():
                stream._deliver(EngineFailed(f"the engine thread failed: {e}"))
            self._streams.clear()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._closing or self.server.busy):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                closing = self._closing
            for what, item in inbox:
                self._apply(what, item)
            if closing:
                self._end_all(LoopClosed("the server is shutting down"))
                return
            if self.server.busy:
                self._iterate()
            waiting, self.running = self.server.counts()
            self.queue_length = waiting + self.posted

    def _apply(self, what: str, item) -> None:
        if what == "heal":
            self._heal()
            return
        if what == "cancel":
            stream = self._streams.pop(item, None)
            if stream is not None and self.server.cancel(item):
                self._finished(item)
            return
        req, stream = item
        with self._cv:
            self.posted -= 1
        try:
            self.server.submit(req)
        except BadRequest as e:
            stream._settle(e)
            return
        except Exception as e:  # the backend's fault, not the request's: keep serving
            log.exception("could not queue request %s", req.request_id)
            stream._settle(EngineFailed(f"could not queue the request: {type(e).__name__}: {e}"))
            return
        self._streams[req.request_id] = stream
        stream._settle(None)

    def _iterate(self) -> None:
        start = time.perf_counter()
        try:
            self.server.step()
        except Exception as e:  # the iteration's plans were aborted, the server unchanged
            self._failed_in_a_row += 1
            if self._failed_in_a_row <= self.max_retries and self._heal():
                log.warning("iteration failed (%s: %s); repaired, its %d requests go on",
                            type(e).__name__, e, len(self._streams))
                return
            log.error("iteration failed, ending %d requests: %s: %s",
                      len(self._streams), type(e).__name__, e)
            self._end_all(EngineFailed(f"iteration failed: {type(e).__name__}: {e}"))
            self._failed_in_a_row = 0
            return
        self._failed_in_a_row = 0
        self.observer.iteration(time.perf_counter() - start)
        phases = getattr(self.server, "phase_instances", None)
        if phases is not None:
            self.observer.phases(phases)

    def _heal(self) -> bool:
        if self.heal is None:
            return False
        try:
            repaired = bool(self.heal())
        except Exception:  # the next requests will tell
            log.exception("could not recover from the failure")
            return False
        self.recoveries += repaired
        return repaired

    def _end_all(self, error: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.server.cancel(rid)
                res = self.server.results.get(rid)
                if res is not None:
                    res.finish_reason = "error"
                self._finished(rid)
            except Exception:  # keep ending the others; the thread must not die
                log.exception("could not end request %s", rid)
            stream._settle(error)
            stream._deliver(error)
        self._streams.clear()

    def _on_token(self, request_id: str, token: int) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        res = self.server.results[request_id]
        now = time.perf_counter()
        if stream.last_s is None:
            self.observer.first_token(now - stream.submitted_s)
        else:
            self.observer.between_tokens(now - stream.last_s)
        stream.last_s = now
        event = TokenEvent(token, len(res.output_ids) - 1, res.done, res.finish_reason,
                           res.hit_tokens, stream.prompt_tokens)
        done = res.done
        if done:  # the bookkeeping first: a caller woken by its last token finds it done
            del self._streams[request_id]
            self._finished(request_id)
        if not stream._deliver(event) and not done:
            self.cancel(request_id)  # applied between iterations, not inside this one

    def _on_error(self, request_id: str, message: str) -> None:
        """``request_id`` failed on its own (the backend retired it): its caller gets
        :class:`RequestFailed`; the other requests are untouched."""
        log.warning("request %s failed: %s", request_id, message)
        stream = self._streams.pop(request_id, None)
        self._finished(request_id)  # before its caller wakes (as for a last token)
        if stream is not None:
            stream._deliver(RequestFailed(f"the request failed: {message}"))

    def _finished(self, request_id: str) -> None:
        res = self.server.pop_result(request_id)
        if res is not None:
            self.observer.finished(res)

    # ------------------------------------------------------------ metrics
    @property
    def live(self) -> int:
        return len(self._streams)
