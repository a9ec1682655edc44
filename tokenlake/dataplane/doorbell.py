"""Per-layer hand-offs through shared memory: a compute engine and its instance's query
and transfer engines, on one host, with no message per layer (docs/data-plane.md
"Doorbells").

Every client session (the owner's too) has, beside its ``q``/``out``/``kv`` buffers, a
small shared ``bell`` buffer on each instance. It holds one ring per engine role: the
client writes an entry (plan id, layer, layers), bumps the ring's ``posted`` counter and
rings the engine's doorbell; the engine serves the entry as it would a ``QUERY`` or
``PUT`` message and marks it done (or failed, with the error beside it), then rings the
client. The rings and counters are the truth; a doorbell is only a wake-up:

* a doorbell is a named FIFO beside the buffer (``<bell>.query``, ``<bell>.transfer``,
  made and read by the engine, which polls it with its sockets; ``<bell>.client``, made
  and read by the client). A write of one byte wakes the reader; a lost or extra byte
  costs at most one ``poll_s`` of latency, never a wrong answer, because each side reads
  the counters after waking;
* the client may first spin briefly on the entry's done word (opt-in; x86 only, where a store is
  never seen before the stores that precede it; elsewhere the FIFO read, a system call,
  orders them), then sleeps on its FIFO in ``poll_s`` steps, asking between steps whether
  the engine still runs: a dead engine is ``EngineUnavailable`` as fast as on the socket
  path, and every wait has its deadline.

Plans are still registered, released and checked by message (once per iteration);
sessions keep their isolation, each with its own bell, rings and FIFOs. The engine reads
only the words it needs from the ring and checks each entry as it checks a message.
"""

from __future__ import annotations

import errno
import os
import platform
import select
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgpack

from tokenlake.core.errors import EngineUnavailable, TokenLakeError

if TYPE_CHECKING:
    import torch

#: Bytes of a ``bell`` buffer (uint8, always host memory, also for a GPU pool).
BELL_BYTES = 16384
#: Entries of one ring: a client has at most this many hand-offs of one role in flight.
RING = 64
#: The engine roles with a ring, in area order.
ROLES = ("query", "transfer")
MAGIC = 0x31304C4C45424C54  # b"TLBELL01", little-endian: an engine has opened the bell
_ENTRY = 6  # words: seq, plan, layer, layers, done (seq: served; -seq: failed), spare
_HEADER = 64  # words before the first ring: magic, path length, path (<= 480 bytes)
_AREA = 8 + RING * _ENTRY  # words of one role's ring: posted, expected, spare x 6, entries
_ERRORS = _HEADER + len(ROLES) * _AREA  # word where the roles' error areas start
_ERROR_WORDS = 256  # per role: [seq, length, msgpack of the ERROR frames]
#: Spin on a done word before sleeping on the FIFO (seconds; 0 on CPUs that may reorder
#: stores). Off unless set: a wake-up through the FIFO costs ~40 µs on a 2-core VM, but a
#: spin takes a core that a machine shared with other work may need (with two busy
#: processes beside it, the suite's serving tests ran 12% slower spinning). A wait that
#: took longer than this turns the spin off for that ring until one is short again.
SPIN_S = float(os.environ.get("TOKENLAKE_BELL_SPIN_US", "0")) * 1e-6 \
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86") else 0.0

#: How long an engine told to expect an entry (:meth:`ClientBell.heads_up`) spins for it
#: before it sleeps again (seconds). The spin yields the core at every turn
#: (``sched_yield``): a spin that did not took the core the compute engine's projections
#: need on the 2-core VM (docs/data-plane.md "Doorbells"). Off unless set, as ``SPIN_S``;
#: a client asks for no heads-up while it is 0.
ENGINE_SPIN_S = float(os.environ.get("TOKENLAKE_BELL_ENGINE_SPIN_US", "0")) * 1e-6

assert (_ERRORS + len(ROLES) * _ERROR_WORDS) * 8 <= BELL_BYTES


def _words(buf: torch.Tensor) -> memoryview:
    """The bell buffer as int64 words (a view of the shared memory, no copy)."""
    if buf.is_cuda or buf.numel() < BELL_BYTES:
        raise ValueError(f"a bell is {BELL_BYTES} bytes of host memory")
    return memoryview(buf.numpy()).cast("B").cast("q")


def _make_fifo(path: str) -> int:
    """Makes (or reuses) the FIFO at ``path`` and opens it to read without blocking; the
    fd is opened read-write, so it never reads end-of-file while its writers come and go."""
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        if not stat.S_ISFIFO(os.lstat(path).st_mode):  # a file or a link there is not ours to read
            raise
    return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)


def _drain(fd: int) -> None:
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except BlockingIOError:
        pass


class _Ringer:
    """The writing end of someone else's FIFO, opened when first needed and again after
    its reader went (a restarted engine makes its FIFO anew)."""

    def __init__(self, path: str) -> None:
        self.path, self.fd = path, -1

    def ring(self) -> None:
        for _ in range(2):
            if self.fd < 0:
                try:
                    self.fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                except OSError:  # no reader (ENXIO) or no FIFO: whoever waits polls anyway
                    return
                if not stat.S_ISFIFO(os.fstat(self.fd).st_mode):  # never write into a file
                    self.close()
                    return
            try:
                os.write(self.fd, b"\x01")
                return
            except BlockingIOError:  # full: the reader has wake-ups enough
                return
            except OSError:  # EPIPE: the reader went; a new one may have made it anew
                self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def reader_alive(self) -> bool:
        """False once nobody reads the FIFO (its engine died, or stopped and removed it):
        an open to write finds no reader (ENXIO) or no FIFO. A liveness check that needs
        no handle on the engine's process (a ``tokenlake.connect`` client has none)."""
        try:
            os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
        except OSError as exc:
            return exc.errno not in (errno.ENXIO, errno.ENOENT)
        return True


# ---------------------------------------------------------------------------- engine side


class EngineBell:
    """One session's bell as an engine sees it: its own ring, its FIFO, the client's FIFO."""

    def __init__(self, role: str, buf: torch.Tensor, path: str) -> None:
        self.w = _words(buf)
        self.role, self.path = role, path
        self.area = _HEADER + ROLES.index(role) * _AREA
        self.fd = _make_fifo(f"{path}.{role}")
        self.client = _Ringer(f"{path}.client")
        raw = path.encode()
        if len(raw) > (_HEADER - 2) * 8:
            raise ValueError(f"bell path too long: {path}")
        self.w[1] = len(raw)
        memoryview(buf.numpy())[16:16 + len(raw)] = raw
        self.seen = self.w[self.area]  # what was posted before this engine is not its to serve
        self._counted = self.seen  # the counter at the last ring
        self.w[0] = MAGIC

    def pending(self) -> bool:
        return self.w[self.area] > self.seen

    def await_expected(self) -> bool:
        """If the client said an entry is coming (a heads-up) and it is not posted yet,
        spins up to ``ENGINE_SPIN_S`` for it; True if it came."""
        w, area = self.w, self.area
        if w[area + 1] <= self.seen or not ENGINE_SPIN_S:
            return False
        end = time.perf_counter() + ENGINE_SPIN_S
        while w[area] <= self.seen:
            if time.perf_counter() > end:
                return False
            os.sched_yield()  # a runnable compute thread goes first: the spin takes no core from it
        return True

    def take(self) -> list[tuple[int, int, int, int]]:
        """The entries posted since the last call, in order: ``(seq, plan, layer, layers)``."""
        _drain(self.fd)
        w, out = self.w, []
        posted = w[self.area]
        self.seen = max(self.seen, posted - RING)  # older entries are overwritten: a client that broke the ring
        while self.seen < posted:
            seq = self.seen + 1
            at = self.area + 8 + (seq % RING) * _ENTRY
            if w[at] < seq and seq > self._counted:  # not visible yet (a weakly ordered CPU)
                break  # still missing at the next ring, it was never written: skipped then
            self.seen = seq
            if w[at] == seq:  # (a later seq there: the client reused the entry, it gave this one up)
                out.append((seq, w[at + 1], w[at + 2], w[at + 3]))
        self._counted = posted
        return out

    def finish(self, seq: int, exc: BaseException | None = None) -> None:
        """Marks entry ``seq`` served (``exc`` None) or failed with ``exc``, and wakes the client."""
        at = self.area + 8 + (seq % RING) * _ENTRY
        if self.w[at] != seq:
            return  # the client reused the entry (it gave up waiting): nothing to say
        if exc is not None:
            if not isinstance(exc, TokenLakeError):
                exc = TokenLakeError(f"{type(exc).__name__}: {exc}")
            from tokenlake.dataplane import wire  # (lazily: the layout's users need no torch)

            frames = [bytes(f) for f in wire.error_message(0, exc)]
            raw = msgpack.packb(frames)[: (_ERROR_WORDS - 2) * 8]
            err = _ERRORS + ROLES.index(self.role) * _ERROR_WORDS
            memoryview(self.w.obj)[(err + 2) * 8:(err + 2) * 8 + len(raw)] = raw
            self.w[err + 1] = len(raw)
            self.w[err] = seq
        self.w[at + 4] = -seq if exc is not None else seq
        self.client.ring()

    def close(self, unlink: bool = True) -> None:
        os.close(self.fd)
        self.client.close()
        if unlink:
            try:
                os.unlink(f"{self.path}.{self.role}")
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------------------- client side


class ClientBell:
    """A client's end of its session's bell on one instance (:meth:`attach`)."""

    def __init__(self, buf: torch.Tensor, path: str) -> None:
        self.buf, self.w, self.path = buf, _words(buf), path
        self.fd = _make_fifo(f"{path}.client")
        self.engines = {role: _Ringer(f"{path}.{role}") for role in ROLES}
        self.poll = select.poll()
        self.poll.register(self.fd, select.POLLIN)
        self.spin = {role: SPIN_S > 0 for role in ROLES}  # the last wait of the ring was short

    @classmethod
    def attach(cls, buf: torch.Tensor | None) -> ClientBell | None:
        """The bell in ``buf`` once both engines opened it; None if there is no bell
        (the socket path is used then)."""
        if buf is None or buf.is_cuda or buf.numel() < BELL_BYTES:
            return None
        w = _words(buf)
        if w[0] != MAGIC or not all(os.path.exists(f"{_path(buf)}.{r}") for r in ROLES):
            return None
        return cls(buf, _path(buf))

    def post(self, role: str, plan: int, layer: int, layers: int = 1) -> int:
        """Writes an entry into ``role``'s ring and rings its engine; returns its seq.
        The caller waits for the entry a ring ago to be done first (:meth:`slot_free`)."""
        w, area = self.w, _HEADER + ROLES.index(role) * _AREA
        seq = w[area] + 1
        at = area + 8 + (seq % RING) * _ENTRY
        w[at + 4] = 0
        w[at + 1], w[at + 2], w[at + 3] = plan, layer, layers
        w[at] = seq  # the entry, then the counter: the engine reads them in that order
        w[area] = seq
        self.engines[role].ring()
        return seq

    def heads_up(self, role: str) -> None:
        """Tells ``role``'s engine an entry is coming soon (the compute engine is about to
        compute the layer's q): it wakes now and spins for it, so the wake-up overlaps
        the caller's work instead of following it."""
        area = _HEADER + ROLES.index(role) * _AREA
        self.w[area + 1] = self.w[area] + 1
        self.engines[role].ring()

    def next_seq(self, role: str) -> int:
        return self.w[_HEADER + ROLES.index(role) * _AREA] + 1

    def state(self, role: str, seq: int) -> int:
        """1 served, -1 failed, 0 not yet. An entry a ring ago whose place holds a later
        one was served: it was waited for before its place was taken (:meth:`post`'s
        caller raised its error then)."""
        at = _HEADER + ROLES.index(role) * _AREA + 8 + (seq % RING) * _ENTRY
        done = self.w[at + 4]
        if done == seq:
            return 1
        return -1 if done == -seq else 1 if self.w[at] > seq else 0

    def wait(self, role: str, seq: int, deadline: float, poll_s: float,
             alive: Callable[[], str | None], instance: int) -> None:
        """Returns once entry ``seq`` is served; raises the engine's error if it failed,
        ``EngineUnavailable`` past ``deadline`` or once the engine is found dead."""
        st = self.state(role, seq)
        if st:
            return self._raise(role, seq) if st < 0 else None
        start = time.perf_counter()
        if self.spin[role]:
            end = start + SPIN_S
            while not st and time.perf_counter() < end:
                st = self.state(role, seq)
        while not st:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(f"no reply from instance {instance}'s {role} engine within the timeout")
            woke = self.poll.poll(int(min(left, poll_s) * 1000) + 1)
            if woke:
                _drain(self.fd)
            st = self.state(role, seq)
            if not st and not woke:
                dead = alive()  # quiet for poll_s: is anyone there?
                if dead is None and not self.engines[role].reader_alive():
                    dead = f"the {role} engine of instance {instance}"  # its doorbell has no reader
                if dead is not None:
                    raise EngineUnavailable(f"{dead} is not running")
        self.spin[role] = SPIN_S > 0 and time.perf_counter() - start <= SPIN_S
        if st < 0:
            self._raise(role, seq)

    def _raise(self, role: str, seq: int) -> None:
        err = _ERRORS + ROLES.index(role) * _ERROR_WORDS
        if self.w[err] == seq:
            n = self.w[err + 1]
            raw = bytes(memoryview(self.w.obj)[(err + 2) * 8:(err + 2) * 8 + n])
            from tokenlake.dataplane import wire

            try:
                wire.raise_if_error(wire.decode(msgpack.unpackb(raw)))
            except TokenLakeError:
                raise
            except Exception:  # noqa: BLE001 - a garbled error area: say so below
                pass
        raise TokenLakeError(f"the {role} engine refused hand-off {seq} (its error was overwritten)")

    def close(self) -> None:
        for ringer in self.engines.values():
            ringer.close()
        self.poll.unregister(self.fd)
        os.close(self.fd)
        try:
            os.unlink(f"{self.path}.client")
        except FileNotFoundError:
            pass


def _path(buf: torch.Tensor) -> str:
    w = _words(buf)
    n = w[1]
    if not 0 < n <= (_HEADER - 2) * 8:
        return ""
    return bytes(memoryview(buf.numpy())[16:16 + n]).decode(errors="replace")


def fifo_paths(bell_path: str) -> list[str]:
    """The FIFOs of a bell whose buffer file is ``bell_path`` (for cleanup)."""
    return [f"{bell_path}.{r}" for r in (*ROLES, "client")]
