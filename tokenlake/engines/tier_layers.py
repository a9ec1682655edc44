"""A disk tier's reads layer by layer (a mixin of
:class:`~tokenlake.engines.tier_files.TierFiles`): several segments' files read into
their slots a layer at a time, each layer checked against its digest before the caller
hears of it, so that attention over the segments can begin while later layers are still
on their way (docs/design.md "Disk tier")."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenlake.engines.tier_format import digest_of, read_ahead, read_header

log = logging.getLogger(__name__)

#: Files a layered read keeps open at once (a longer document is read in groups).
MAX_OPEN = 64


@dataclass
class _Open:
    """A file of :meth:`LayeredReads.get_layers_into`, open: the index of its segment
    among the reads, its key and path, the file, the buffer, where its bytes begin,
    its digests and their algo."""

    i: int
    key: bytes
    path: Path
    f: Any
    view: memoryview
    offset: int
    digests: list
    algo: str


class LayeredReads:
    """:meth:`get_layers_into`, for a :class:`~tokenlake.engines.tier_files.TierFiles`
    (which provides ``_mutex``, ``_sizes``, ``_file``, ``_hash``, ``_discard``,
    ``_read_body`` and ``_check_open``)."""

    def get_layers_into(self, outs: Sequence[tuple[bytes, Any]], layers: int,
                        on_layer: Callable[[int], None]) -> list[bool]:
        """Reads several segments into their buffers (``(key, writable buffer)``, as
        :meth:`get_into`) a layer at a time: chunk ``l`` of every file (a file of
        ``layers`` chunks holds a layer in each), each checked against its digest, then
        ``on_layer(l + 1)``, then the next. ``on_layer`` is called at every layer, with
        the layers of *every* segment in and checked so far: it says no more once a
        segment has failed (missing, corrupt, truncated: refused and removed as by
        :meth:`get_into`, its buffer not to be used), while the others are read to the
        end. At most :data:`MAX_OPEN` files are open at once: a group of them is read
        whole before the next (and reports 0 layers, all being not yet in) and only
        the last group's layers are reported. A file chunked otherwise (or written with
        one digest) is read whole first. Returns, per segment, whether it came back
        intact."""
        ok = [True] * len(outs)
        starts = range(0, len(outs), MAX_OPEN)
        told = 0  # the layers of every segment in, as last reported

        def tell(layers_in: int | None) -> None:
            nonlocal told
            told = told if layers_in is None else layers_in
            on_layer(told)

        with self._mutex:
            self._check_open()
            for at in starts:
                self._read_group(outs, range(at, min(at + MAX_OPEN, len(outs))), layers, ok, tell,
                                 counts=at == starts[-1])
            for i, (key, _out) in enumerate(outs):
                if ok[i]:
                    self._sizes.move_to_end(key)
        return ok

    def _read_group(self, outs, group: range, layers: int, ok: list[bool], tell: Callable[[int | None], None],
                    counts: bool) -> None:
        """:meth:`get_layers_into` of the segments ``group`` of ``outs`` (their files
        open together; ``ok`` updated): after each layer (and, at the last, once a file
        longer than its header says is refused) ``tell(l + 1)`` where ``counts`` (the
        last group) and every segment is intact so far, else ``tell(None)``."""
        opened: list[_Open] = []  # the files read a layer at a time
        try:
            for i in group:
                key, out = outs[i]
                ok[i], one = self._open_layered(key, memoryview(out).cast("B"), layers)
                if one is not None:
                    opened.append(_Open(i, key, *one))
            for o in opened:
                read_ahead(o.f, o.offset, o.view.nbytes)
            for layer in range(layers):
                hashed: list = []
                try:
                    for o in opened:
                        chunk = o.view.nbytes // layers
                        at = layer * chunk
                        ok[o.i] = ok[o.i] and self._read_layer(o.key, o.path, o.f, o.view[at:at + chunk])
                        hashed.append(self._hash(o.view, [at], chunk, o.algo)[0] if ok[o.i] else None)
                finally:  # none still reads a buffer once this returns
                    concurrent.futures.wait([h for h in hashed if h is not None])
                for o, h in zip(opened, hashed):
                    if h is not None and h.result() != o.digests[layer]:
                        ok[o.i] = self._refused(o.key, o.path, f"its bytes do not match their digest (layer {layer})")
                    elif layer == layers - 1 and ok[o.i] and o.f.read(1):
                        ok[o.i] = self._refused(o.key, o.path, "longer than its header says")
                tell(layer + 1 if counts and all(ok) else None)
        finally:
            for o in opened:
                o.f.close()

    def _open_layered(self, key: bytes, view: memoryview, layers: int):
        """For :meth:`get_layers_into` (under the mutex): ``(True, (path, open file,
        view, offset of its bytes, digests, their algo))`` of a file read a layer at a
        time, ``(True, None)`` once one chunked otherwise is read whole, ``(False, None)``
        if it failed."""
        if key not in self._sizes:
            log.warning("tier read of %s failed: not held", key.hex())
            return False, None
        path = self._file(key)
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
        except FileNotFoundError:
            return self._refused(key, path, "missing"), None
        try:
            header, offset = read_header(f)
            if header["key"] != key.hex():
                raise ValueError("not this segment")
        except ValueError as exc:
            f.close()
            return self._refused(key, path, str(exc)), None
        except OSError as exc:  # the disk's failure, not the file's: it is kept
            f.close()
            log.warning("tier read of %s failed: %s", key.hex(), exc)
            return False, None
        if header["nbytes"] != view.nbytes:
            f.close()
            log.warning("tier read of %s failed: %d bytes for a buffer of %d", key.hex(),
                        header["nbytes"], view.nbytes)
            return False, None
        digests = header.get("digests")
        if digests is not None and layers > 0 and view.nbytes % layers == 0 and len(digests) == layers \
                and header["chunk"] == view.nbytes // layers:
            return True, (path, f, view, offset, digests, digest_of(header))
        with f:  # another chunking: whole, as get_into reads it
            try:
                self._read_body(f, offset, view, header)
            except ValueError as exc:
                return self._refused(key, path, str(exc)), None
        return True, None

    def _read_layer(self, key: bytes, path: Path, f, view: memoryview) -> bool:
        """The next ``view.nbytes`` of an open file into ``view``; False once refused."""
        done = 0
        while done < view.nbytes:
            try:
                n = f.readinto(view[done:])
            except OSError as exc:  # the disk's failure, not the file's: it is kept
                log.warning("tier read of %s failed: %s", key.hex(), exc)
                return False
            if not n:
                return self._refused(key, path, "truncated")
            done += n
        return True

    def _refused(self, key: bytes, path: Path, why: str) -> bool:
        """A file found not to be what was written, during a read: forgotten, removed,
        logged; False."""
        self._discard(key, path)
        log.warning("tier file %s refused: %s", path.name, why)
        return False
