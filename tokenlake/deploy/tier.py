"""The driver's side of the tiers (on disk or in host memory): the control plane's tier work
(:mod:`tokenlake.core.tier`) sent to each instance's transfer engine (``TIER_OPS``,
``TIER_READ``, and ``TIER_LIST`` at start-up: :mod:`tokenlake.dataplane.messages.tier`).

Importing this module loads no torch (the wire messages are imported where sent).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between two fences of a transfer engine that has not answered one.
FENCE_RETRY_S = 5.0

#: Bytes of segments one ``TIER_READ`` reads at most (one segment if larger): about a
#: tenth of a second from a disk, well within the driver's timeout, and the longest a
#: fence, or a drop of a copy being read, waits for a read (the engine's puts do not:
#: it reads beside its loop, ``tokenlake/engines/tier_serving.py``). A layered read
#: (``tier_read``'s ``on_layer``) is one message per instance, whatever its size: it
#: reads layer 0 of every file first, and each layer's report gives it the timeout again.
READ_BYTES = 32 << 20


def tier_spec(config, role: str, inst: int) -> dict[str, Any]:
    """An engine's tier fields of its ``EngineSpec`` under ``config`` (a
    ``ClusterConfig``): a transfer engine's directory and size, or the size of its
    host-memory tier; nothing without a tier."""
    if role != "transfer" or not config.tier_bytes:
        return {}
    if config.tier_path is None:
        return {"tier_bytes": config.tier_bytes}
    # The control plane counts whole segments; the files have a header each besides
    # (key, layout, digest, the segment's place in the tree: its token ids included).
    files = config.tier_bytes // config.segment_bytes + 1
    header = 4096 + 8 * config.segment_tokens
    # absolute: an engine (a Ray actor above all) may run in another working directory
    return {"tier_path": os.path.join(os.path.abspath(config.tier_path), f"instance-{inst}"),
            "tier_bytes": config.tier_bytes + files * header, "tier_write_bw": config.tier_write_bw}


def rejoin(control, instance: int) -> None:
    """``instance``, started again, joins ``control``'s ring; with a tier, what its tier
    held is adopted (a disk tier's directory keeps what it wrote; a host-memory tier
    started again is empty)."""
    control.add_instance(instance)
    if control.tier_data_plane is not None:
        try:
            control.tier_data_plane.adopt([instance])
        except Exception as exc:  # noqa: BLE001 - the instance serves all the same, its copies missed
            log.warning("instance %d: its tier's copies were not adopted: %s", instance, exc)


def check_host_tiers(config, share: float = 0.8) -> None:
    """``ConfigError`` when ``config``'s tiers in host memory (``tier_bytes`` without
    ``tier_path``) and, on a CPU pool, the slabs, every instance on this machine, would
    take more than ``share`` of its memory: refused at once, not an out-of-memory kill
    once the tiers fill."""
    from tokenlake.core.errors import ConfigError

    if not config.tier_bytes or config.tier_path is not None:
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    slabs = config.pool_bytes if config.device == "cpu" else 0
    need = config.instances * (config.tier_bytes + slabs)
    if need > share * total:
        raise ConfigError(
            f"{config.instances} tiers of {config.tier_bytes >> 20} MiB in host memory"
            f"{f' beside slabs of {slabs >> 20} MiB' if slabs else ''} need {need >> 20} MiB, more "
            f"than {share:.0%} of this machine's {total >> 20} MiB: lower tier_bytes, or put the "
            "tiers on a disk (tier_path)")


class TierDriver:
    """:class:`~tokenlake.core.tier.TierDataPlane` of a launcher: requests to its
    transfer engines, one per instance and call.

    **Fencing.** A request that gets no answer may still be carried out later (the
    engine was stalled, not dead), when the control plane may have given its slots to
    other segments. So every request carries the instance's epoch; after a request that
    got no answer the driver raises the epoch and sends an empty ``TIER_OPS`` of the new
    one (the *fence*): once an engine has answered it, it refuses everything older.
    Until then the unanswered request's writes are reported neither staged nor refused
    (their segments stay leased), its reads' slots are held back, and nothing else is
    sent to that engine; :meth:`fenced` tells the control plane when it may free what it
    held back.

    Fences are sent by a thread of the driver (``background``; else by whoever calls
    :meth:`fence_due`), at once and then at most every :data:`FENCE_RETRY_S`, on
    sockets of their own (``_tier_request`` channel ``"fences"``), never under the
    control plane's lock: a stalled engine costs the pool's other calls and the tier
    reads of the other instances nothing."""

    def __init__(self, cluster: Any, background: bool = True) -> None:  # cluster: a ClusterBase
        self.cluster = cluster
        # Reads run on a thread of their own (the serving loop's promotions), fences on
        # another, beside the control plane's calls: the state below is changed under
        # this lock only.
        self._state = threading.Lock()
        self._wake = threading.Condition(self._state)
        self._background = background
        self._fencer: threading.Thread | None = None
        self._closed = False
        # Epochs start at this driver's start in milliseconds: above any an engine it
        # adopts from an earlier driver has seen (those start lower and rise by a few).
        self._base = int(time.time() * 1000)
        self._epoch: dict[int, int] = {}
        self._unfenced: dict[int, float] = {}  # instance -> when to try its fence again
        self._unsettled: dict[int, list[bytes]] = {}  # per instance: writes never answered
        self._lost_drops: dict[int, list[bytes]] = {}  # per instance: drops never sent
        self._fenced: dict[int, int] = {}  # per instance: the highest epoch answered
        self._counters: dict[int, dict[str, float]] = {}  # per instance: from its last TIER_DONE

    def tier_ops(self, ops) -> tuple[list[bytes], list[bytes]]:
        """Runs the tiers' queued work (``{instance: TierOps}`` of
        :mod:`tokenlake.core.tier`) on each instance's transfer engine; returns the
        write-throughs staged and refused (those of an engine that did not answer:
        refused once it is fenced, in neither list before). Under the control plane's
        lock."""
        from tokenlake.dataplane.messages import TierEntry, TierOps  # imports torch

        staged: list[bytes] = []
        refused: list[bytes] = []
        self._forget_gone()
        with self._state:  # drops a fence did not carry (they came while it was sent)
            late = {i: self._lost_drops.pop(i) for i in list(self._lost_drops) if i not in self._unfenced}
        for inst in {**ops, **late}:
            op = ops.get(inst)
            drops = tuple(late.get(inst, ())) + (tuple(op.drops) if op is not None else ())
            writes = () if op is None else tuple(
                (w.slot, TierEntry(w.key, w.parent, w.index, w.tokens)) for w in op.writes)
            epoch = self._epoch_of(inst)
            done = None if epoch is None else self._send(inst, TierOps(drops, writes, epoch))
            with self._state:
                if done is None:  # the fence drops them all: whatever the engine may have
                    # staged, and the drops, not sent or refused once it is fenced
                    self._unsettled.setdefault(inst, []).extend(e.key for _, e in writes)
                    self._lost_drops.setdefault(inst, []).extend(drops)
                    continue
                if self._epoch.get(inst, self._base) > epoch:  # raised meanwhile: it may have
                    self._lost_drops.setdefault(inst, []).extend(drops)  # refused them, again
            staged += done.done
            refused += done.failed
        with self._state:
            for inst in [i for i in self._unsettled if i not in self._unfenced]:
                refused += self._unsettled.pop(inst)
        return staged, refused

    def tier_read(self, promotions, on_layer=None) -> tuple[set[bytes], dict[bytes, int]]:
        """Reads each promotion's copy into its slot (one ``TIER_READ`` per instance and
        :data:`READ_BYTES`, on sockets of their own: the control plane's calls go on
        meanwhile); returns the keys that failed, and those of them whose engine neither
        answered nor was fenced (it may still write their slots), with the epoch each
        was sent at.

        With ``on_layer`` and :meth:`reads_layered`, each instance gets one
        ``TIER_READ`` of all its items, read layer by layer (``layered``), all at once:
        ``on_layer(instance, layers)`` is called (on this thread) each time an engine
        says that the first ``layers`` layers of all its items are in, checked; else
        ``on_layer`` is never called, and only the answers say what came in."""
        from tokenlake.dataplane.messages import TierDone, TierRead  # imports torch

        failed: set[bytes] = set()
        unanswered: dict[bytes, int] = {}
        alive = getattr(self.cluster, "alive", None)
        by_inst: dict[int, list] = {}
        for p in promotions:
            by_inst.setdefault(p.instance, []).append((p.key, p.slot, p.target))
        layered = on_layer is not None and self.reads_layered()
        per = max(1, READ_BYTES // self.cluster.config.segment_bytes)
        sends: list[tuple[int, TierRead]] = []
        for inst, items in by_inst.items():
            # each well within the timeout (a layered read's progress moves its deadline on)
            for at in range(0, len(items), len(items) if layered else per):
                part = tuple(items[at : at + (len(items) if layered else per)])
                failed.update(item[0] for item in part)
                if alive is not None and not alive("transfer", inst):
                    continue  # stopped: it reads nothing, now or later
                epoch = self._epoch_of(inst)
                if epoch is None and self._fence(inst):
                    epoch = self._epoch_of(inst)
                if epoch is None:
                    continue  # not sent: nothing to hold back
                if layered:  # sent below, all at once
                    sends.append((inst, TierRead(part, epoch, layered=True)))
                else:  # one after the other: one that fails stops the instance's next ones
                    self._count_answer(inst, TierRead(part, epoch), failed, unanswered)
        if sends:
            results = self.cluster._tier_stream({("transfer", i): m for i, m in sends}, TierDone,
                                                lambda key, msg: on_layer(key[1], msg.layers))
            for inst, message in sends:
                self._count_answer(inst, message, failed, unanswered, results[("transfer", inst)])
        return failed, unanswered

    def reads_layered(self) -> bool:
        """Whether :meth:`tier_read` with ``on_layer`` reports layers as they come in: on a
        launcher that passes progress messages on (``_tier_stream``), for slots in host
        memory (a GPU slot's copy is read whole, through host memory)."""
        return hasattr(self.cluster, "_tier_stream") and self.cluster.config.device == "cpu"

    def _count_answer(self, inst: int, message, failed: set, unanswered: dict, result=None) -> None:
        """``message`` sent (here, without ``result``) and its answer recorded: its keys
        out of ``failed`` where they came back, into ``unanswered`` where the engine
        neither answered nor was fenced."""
        done = self._send(inst, message, reads=True) if result is None else self._settle(inst, message, result)
        keys = [item[0] for item in message.items]
        if done is not None:
            bad = set(done.failed)
            failed.difference_update(k for k in keys if k not in bad)
        elif self._epoch_of(inst) is None:
            unanswered.update(dict.fromkeys(keys, message.epoch))

    def fenced(self) -> dict[int, int]:
        """Per instance, the highest epoch its engine answered (a fence or any request):
        nothing sent at a lower one can touch a slot any more."""
        with self._state:
            return dict(self._fenced)

    def _epoch_of(self, inst: int) -> int | None:
        """``inst``'s epoch; None while it is not fenced (only a fence goes to it)."""
        with self._state:
            return None if inst in self._unfenced else self._epoch.get(inst, self._base)

    def _answered(self, inst: int, epoch: int, done=None) -> None:
        """``inst``'s engine answered a message of ``epoch`` (with ``done``, a ``TIER_DONE``)."""
        with self._state:
            self._fenced[inst] = max(self._fenced.get(inst, 0), epoch)
            if done is not None and done.counters:  # the newest answer's: they come by three sockets
                seen = self._counters.get(inst, {}).get("answers", -1.0)
                if done.counters.get("answers", 0.0) >= seen:
                    self._counters[inst] = dict(done.counters)

    def counters(self) -> dict[int, dict[str, float]]:
        """Per instance, its transfer engine's tier counters as of its last answer."""
        with self._state:
            return {inst: dict(c) for inst, c in self._counters.items()}

    def _send(self, inst: int, message, reads: bool = False):
        """``message`` to ``inst``'s transfer engine; its ``TIER_DONE``, or None after a
        failure (then a higher epoch is marked to be fenced, and the fencing woken)."""
        from tokenlake.dataplane.messages import TierDone  # imports torch

        try:
            if reads:
                done = self._tier_call(inst, message, TierDone)
            else:
                done = self.cluster._request(("transfer", inst), message, TierDone)
        except Exception as exc:  # noqa: BLE001 - no answer: it may still be carried out
            done = exc
        return self._settle(inst, message, done)

    def _settle(self, inst: int, message, done):
        """``done`` (the ``TIER_DONE`` of ``message``, or the failure to get one) recorded:
        the answer, or None (then a higher epoch is marked to be fenced, and the fencing
        woken)."""
        if not isinstance(done, BaseException):
            self._answered(inst, message.epoch, done)
            return done
        log.warning("tier of instance %d: %s", inst, done)
        with self._state:
            self._epoch[inst] = max(self._epoch.get(inst, self._base), message.epoch) + 1
            self._unfenced[inst] = 0.0
            self._start_fencing()
        return None

    def _tier_call(self, inst: int, message, reply, channel: str = "reads"):
        return self.cluster._tier_request(("transfer", inst), message, reply, channel)

    # ------------------------------------------------------------- fencing
    def fence_due(self) -> None:
        """Sends the fence of every silent instance whose time has come (what the
        fencing thread does; a caller without one calls this)."""
        with self._state:
            now = time.monotonic()
            due = [inst for inst, when in self._unfenced.items() if when <= now]
        for inst in due:
            if self._closed:
                return
            self._fence(inst)

    def close(self) -> None:
        """Stops the fencing thread (before the launcher closes its sockets)."""
        with self._wake:
            self._closed = True
            self._wake.notify_all()
            fencer, self._fencer = self._fencer, None
        if fencer is not None:
            fencer.join()

    def _start_fencing(self) -> None:
        """Wakes the fencing thread, started on first need (under ``_state``)."""
        if not self._background or self._closed:
            return
        if self._fencer is None or not self._fencer.is_alive():
            self._fencer = threading.Thread(target=self._fence_loop, name="tier-fence", daemon=True)
            self._fencer.start()
        self._wake.notify_all()

    def _fence_loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed:
                    now = time.monotonic()
                    if any(when <= now for when in self._unfenced.values()):
                        break
                    soonest = min(self._unfenced.values(), default=None)
                    self._wake.wait(None if soonest is None else soonest - now)
                if self._closed:
                    return
            try:
                self.fence_due()
            except Exception:  # noqa: BLE001 - the fences must go on: try again later
                log.exception("tier fencing failed")
                with self._wake:
                    self._wake.wait(max(FENCE_RETRY_S, 1.0))

    def _fence(self, inst: int) -> bool:
        """Has ``inst``'s engine answer an empty ``TIER_OPS`` of its epoch (at most every
        :data:`FENCE_RETRY_S`); True once it has. A stopped engine is not asked (it is
        fenced when replaced)."""
        from tokenlake.dataplane.messages import TierDone, TierOps  # imports torch

        with self._state:
            when = self._unfenced.get(inst)
            if when is None or time.monotonic() < when:
                return when is None
            epoch = self._epoch[inst]
            self._unfenced[inst] = time.monotonic() + FENCE_RETRY_S  # taken: no second sender
            # the fence also drops what unanswered writes may have staged, and lost drops
            lost = list(self._lost_drops.get(inst, ()))
            drops = tuple(self._unsettled.get(inst, ())) + tuple(lost)
        try:
            alive = getattr(self.cluster, "alive", None)
            if alive is not None and not alive("transfer", inst):
                self._retry_fence(inst, epoch, max(FENCE_RETRY_S, 1.0))  # fenced when replaced
                return False
            done = self._tier_call(inst, TierOps(drops, epoch=epoch), TierDone, "fences")
        except Exception as exc:  # noqa: BLE001 - still silent: try again later
            log.warning("tier of instance %d not fenced yet: %s", inst, exc)
            self._retry_fence(inst, epoch, FENCE_RETRY_S)
            return False
        self._answered(inst, epoch, done)
        with self._state:  # a failure since, of a higher epoch, needs its own fence
            held = self._lost_drops.get(inst)
            if held is not None:  # those it carried; any that came meanwhile stay
                del held[: len(lost)]
            if self._epoch[inst] == epoch:
                self._unfenced.pop(inst, None)
            return inst not in self._unfenced

    def _retry_fence(self, inst: int, epoch: int, after_s: float) -> None:
        """The fence of ``epoch`` was not answered: try again in ``after_s`` (a failure
        since raised the epoch and asked for its own fence: that one stands)."""
        with self._state:
            if inst in self._unfenced and self._epoch[inst] == epoch:
                self._unfenced[inst] = time.monotonic() + after_s

    def _forget_gone(self) -> None:
        """An instance taken out of the pool took its engines and all it held (called
        under the control plane's lock)."""
        live = set(self.cluster.control.instances)
        with self._state:
            for inst in {*self._unfenced, *self._unsettled, *self._lost_drops, *self._counters} - live:
                self._unfenced.pop(inst, None)
                self._unsettled.pop(inst, None)
                self._lost_drops.pop(inst, None)
                self._counters.pop(inst, None)

    def adopt(self, instances) -> int:
        """Asks each of ``instances``' transfer engines what its tier holds and gives it
        to the control plane (:meth:`~tokenlake.core.control.ControlPlane.adopt_tier`):
        what a pool started on a tier directory written before finds there. Returns the
        segments adopted."""
        from tokenlake.dataplane.messages import TierList, TierListing  # imports torch

        listings = {}
        for inst in instances:  # all of them first: a document's segments lie in several
            listing = self.cluster._request(("transfer", inst), TierList(), TierListing)
            listings[inst] = [(e.key, e.parent, e.index, e.tokens) for e in listing.entries]
        return self.cluster.control.adopt_tier(listings)
