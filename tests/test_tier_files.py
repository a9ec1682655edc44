"""The disk tier's files (``tokenlake/engines/tier_files.py``): bytes kept exactly and
across a reopen, least recently used segments evicted when full, and every file that is
not what was written refused -- truncated, altered, of another layout, or left half
written by a writer killed mid-put (a real process, killed)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import msgpack
import pytest

from tokenlake.core.errors import ConfigError, TierCorrupt
from tokenlake.engines.tier_files import LOCK_NAME, MAGIC, SUFFIX, TierFiles

LAYOUT = {"model": "test", "segment_tokens": 64, "shape": [2, 2, 4, 64, 8], "dtype": "float32"}


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(i: int, n: int = 4096) -> bytes:
    return hashlib.shake_128(f"segment {i}".encode()).digest(n)


OPEN: list[TierFiles] = []


@pytest.fixture(autouse=True)
def _close_tiers():
    yield
    while OPEN:
        OPEN.pop().close()


def tier(path, capacity=1 << 20, layout=LAYOUT, chunk_bytes=1024) -> TierFiles:
    """A tier on ``path`` (four chunks to a 4,096-byte segment); the one opened before
    on it is closed first (a stop)."""
    for t in [t for t in OPEN if t.path == path]:
        t.close()
        OPEN.remove(t)
    OPEN.append(TierFiles(path, capacity, layout, fsync=False, chunk_bytes=chunk_bytes))
    return OPEN[-1]


def test_bytes_come_back_exactly_and_outlive_the_process_that_wrote_them(tmp_path):
    t = tier(tmp_path)
    for i in range(5):
        assert t.put(key(i), payload(i)) == []
    assert all(t.get(key(i)) == payload(i) for i in range(5))
    assert t.put(key(2), payload(20)) == []  # a new copy replaces the old one
    assert t.get(key(2)) == payload(20) and len(t) == 5
    used = t.used_bytes
    again = tier(tmp_path)  # a stop and a start: the files are adopted
    assert len(again) == 5 and again.used_bytes == used and again.refused == []
    assert again.get(key(2)) == payload(20) and again.get(key(4)) == payload(4)
    with pytest.raises(KeyError):
        again.get(key(99))


def test_a_full_tier_evicts_the_least_recently_used(tmp_path):
    one = len(MAGIC) + 400 + 4096  # a file: its header (four digests) is under 400 bytes
    t = tier(tmp_path, capacity=3 * one)
    for i in range(3):
        t.put(key(i), payload(i))
    t.get(key(0))  # 0 used again: 1 is now the least recently used
    assert t.put(key(3), payload(3)) == [key(1)]
    assert key(1) not in t and not (tmp_path / (key(1).hex() + SUFFIX)).exists()
    assert list(t.keys()) == [key(2), key(0), key(3)] and t.evictions == 1
    assert t.used_bytes <= t.capacity_bytes
    assert tier(tmp_path, capacity=3 * one).get(key(0)) == payload(0)
    smaller = tier(tmp_path, capacity=one)  # reopened smaller: the oldest files go
    assert len(smaller) == 1 and smaller.used_bytes <= one
    with pytest.raises(ConfigError, match="does not fit"):
        smaller.put(key(9), payload(9, 2 * one))


def test_a_truncated_file_is_refused_on_opening(tmp_path):
    t = tier(tmp_path)
    t.put(key(0), payload(0))
    t.put(key(1), payload(1))
    path = tmp_path / (key(1).hex() + SUFFIX)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)
    again = tier(tmp_path)
    assert key(1) not in again and not path.exists()
    assert any("truncated" in why for why in again.refused)
    assert again.get(key(0)) == payload(0)


def test_an_altered_file_is_refused_when_read_and_never_returned(tmp_path):
    t = tier(tmp_path)
    t.put(key(0), payload(0))
    path = tmp_path / (key(0).hex() + SUFFIX)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01  # one bit of the segment's bytes, the length unchanged
    path.write_bytes(bytes(raw))
    again = tier(tmp_path)
    assert key(0) in again  # its header and length are right
    with pytest.raises(TierCorrupt, match="digest"):
        again.get(key(0))
    assert key(0) not in again and not path.exists() and again.used_bytes == 0


def test_a_read_into_a_buffer_gives_the_bytes_or_refuses_the_file(tmp_path):
    """``get_into`` (a promotion's read straight into its slot), in chunks smaller than
    the segment, the last one short: the exact bytes; a bit flipped in the last chunk, a
    file cut or padded after it was adopted: TierCorrupt and the file removed; a buffer
    of another length: ValueError, the file kept."""
    t = tier(tmp_path, chunk_bytes=1000)  # five chunks of a 4,096-byte segment
    for i in range(4):
        t.put(key(i), payload(i))
    buf = bytearray(4096)
    t.get_into(key(0), buf)
    assert bytes(buf) == payload(0)
    with pytest.raises(ValueError, match="4096 bytes, the buffer 4095"):
        t.get_into(key(0), bytearray(4095))
    assert key(0) in t
    path = {i: tmp_path / (key(i).hex() + SUFFIX) for i in range(4)}
    raw = bytearray(path[1].read_bytes())
    raw[-3] ^= 0x40
    path[1].write_bytes(bytes(raw))
    with open(path[2], "r+b") as f:
        f.truncate(path[2].stat().st_size - 1)
    with open(path[3], "ab") as f:
        f.write(b"x")
    for i, why in ((1, r"digest \(chunk 4 of 5\)"), (2, "truncated"), (3, "longer")):
        with pytest.raises(TierCorrupt, match=why):
            t.get_into(key(i), bytearray(4096))
        assert key(i) not in t and not path[i].exists()
    assert list(t.keys()) == [key(0)]


def _rewrite(path, edit) -> None:
    """Rewrites a tier file's header through ``edit(header)`` (a dict), bytes unchanged."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[len(MAGIC):len(MAGIC) + 4], "little")
    header = msgpack.unpackb(raw[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    edit(header)
    packed = msgpack.packb(header)
    path.write_bytes(MAGIC + len(packed).to_bytes(4, "little") + packed + raw[len(MAGIC) + 4 + n:])


def test_files_hashed_with_blake2b_before_xxh3_are_still_read_and_an_unknown_digest_is_refused(tmp_path):
    """New files name their digest (``hash``: XXH3-128); a file without the field, its
    chunks hashed with blake2b as earlier versions wrote, is adopted and read (whole and
    layer by layer), and refused when altered; a digest this reader does not know is
    refused on opening."""
    t = tier(tmp_path)
    for i in range(4):
        t.put(key(i), payload(i))
    path = {i: tmp_path / (key(i).hex() + SUFFIX) for i in range(4)}
    assert t.get(key(0)) == payload(0)

    def blake2b_chunks(h, data):
        assert h.pop("hash") == "xxh3-128"
        h["digests"] = [hashlib.blake2b(data[a:a + h["chunk"]], digest_size=16).hexdigest()
                        for a in range(0, len(data), h["chunk"])]

    _rewrite(path[0], lambda h: blake2b_chunks(h, payload(0)))
    _rewrite(path[1], lambda h: blake2b_chunks(h, payload(1)))
    raw = bytearray(path[1].read_bytes())
    raw[-10] ^= 0x80
    path[1].write_bytes(bytes(raw))
    _rewrite(path[2], lambda h: h.update(hash="md5"))
    _rewrite(path[3], lambda h: h.update(hash=["xxh3-128"]))  # not even a name: refused, not a crash
    again = tier(tmp_path)
    assert key(2) not in again and key(3) not in again
    assert len([why for why in again.refused if "does not know" in why]) == 2
    assert again.get(key(0)) == payload(0)
    out, seen = bytearray(4096), []
    assert again.get_layers_into([(key(0), out)], 4, seen.append) == [True]
    assert bytes(out) == payload(0) and seen == [1, 2, 3, 4]
    with pytest.raises(TierCorrupt, match="digest"):
        again.get(key(1))


def test_every_chunk_is_checked_and_a_file_of_one_digest_is_still_read(tmp_path):
    """A bit flipped in a middle chunk is refused like one in the last; a header whose
    digests do not cover the bytes is refused on opening; a file written before chunks
    (one digest of all its bytes, as earlier versions wrote) is adopted and read, and
    refused when altered."""
    t = tier(tmp_path)
    for i in range(4):
        t.put(key(i), payload(i))
    path = {i: tmp_path / (key(i).hex() + SUFFIX) for i in range(4)}
    raw = bytearray(path[0].read_bytes())
    raw[-4096 + 1500] ^= 0x01  # chunk 1 of 4
    path[0].write_bytes(bytes(raw))
    with pytest.raises(TierCorrupt, match=r"chunk 1 of 4"):
        t.get(key(0))
    _rewrite(path[1], lambda h: h["digests"].pop())

    def one_digest(h, data):
        del h["chunk"], h["digests"]
        h["digest"] = hashlib.blake2b(data, digest_size=16).hexdigest()

    _rewrite(path[2], lambda h: one_digest(h, payload(2)))
    _rewrite(path[3], lambda h: one_digest(h, payload(3)))
    raw = bytearray(path[3].read_bytes())
    raw[-10] ^= 0x80
    path[3].write_bytes(bytes(raw))
    again = tier(tmp_path)
    assert key(1) not in again and not path[1].exists()
    assert any("3 digests for 4096 bytes" in why for why in again.refused)
    assert again.get(key(2)) == payload(2)
    buf = bytearray(4096)
    again.get_into(key(2), buf)
    assert bytes(buf) == payload(2)
    with pytest.raises(TierCorrupt, match="digest"):
        again.get(key(3))
    assert list(again.keys()) == [key(2)]


def test_chunks_are_read_as_their_file_says_and_hostile_headers_are_refused(tmp_path, monkeypatch):
    """A file is checked in the chunks its header names, whatever the reader writes (a
    tier opened with another chunk size reads it whole, keeps it); a writer past
    ``MAX_CHUNKS`` makes its chunks larger; headers with digests but no chunk, a chunk
    that is not an integer, or more digests than allowed are refused on opening, and the
    other files are adopted."""
    import tokenlake.engines.tier_files as tier_files
    import tokenlake.engines.tier_format as tier_format

    t = tier(tmp_path, chunk_bytes=1000)
    for i in range(5):
        t.put(key(i), payload(i))
    monkeypatch.setattr(tier_files, "MAX_CHUNKS", 3)  # the writer's
    t.put(key(5), payload(5))  # 4,096 bytes in at most 3 chunks: 1,366 bytes each
    path = {i: tmp_path / (key(i).hex() + SUFFIX) for i in range(6)}
    monkeypatch.setattr(tier_format, "MAX_CHUNKS", 100)  # the reader's
    _rewrite(path[1], lambda h: h.pop("chunk"))
    _rewrite(path[2], lambda h: h.update(chunk=True))
    _rewrite(path[3], lambda h: h.update(chunk=1, digests=["00" * 16] * 4096))  # 4,096 > 100
    _rewrite(path[4], lambda h: h.update(digest="00" * 16, chunk="1000"))
    again = tier(tmp_path, chunk_bytes=2048)
    assert sorted(again.keys()) == sorted([key(0), key(5)]), again.refused
    assert again.get(key(0)) == payload(0) and again.get(key(5)) == payload(5)
    assert len([why for why in again.refused if "digests" in why or "wrong type" in why]) == 4


def test_garbage_and_foreign_layouts_are_not_adopted(tmp_path):
    tier(tmp_path).put(key(0), payload(0))
    (tmp_path / (key(5).hex() + SUFFIX)).write_bytes(b"not a tier file at all")
    (tmp_path / "notes.txt").write_text("left alone")
    other = tier(tmp_path, layout={**LAYOUT, "dtype": "bfloat16"})
    assert len(other) == 0 and (tmp_path / (key(0).hex() + SUFFIX)).exists()  # kept for its own layout
    assert not (tmp_path / (key(5).hex() + SUFFIX)).exists()
    assert (tmp_path / "notes.txt").exists()
    assert tier(tmp_path).get(key(0)) == payload(0)


WRITER = textwrap.dedent("""
    import hashlib, os, sys, time
    from tokenlake.engines.tier_files import TierFiles
    t = TierFiles(sys.argv[1], 1 << 30, {"w": 1}, fsync=False)
    big = hashlib.shake_128(b"big").digest(8 << 20)
    for i in range(3):
        t.put(hashlib.blake2b(str(i).encode(), digest_size=16).digest(), big[i:])
    def stalled(src, dst):  # the fourth put is killed between writing its file and the rename
        print("writing", flush=True)
        time.sleep(60)
    os.replace = stalled
    t.put(hashlib.blake2b(b"3", digest_size=16).digest(), big[3:])
""")


def test_a_writer_killed_mid_put_leaves_nothing_that_is_read_as_a_segment(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    big = hashlib.shake_128(b"big").digest(8 << 20)
    t = TierFiles(tmp_path, 1 << 30, {"w": 1}, fsync=False)
    assert len(t) == 3 and any("partial write" in why for why in t.refused)  # the finished puts
    for i in range(3):
        assert t.get(hashlib.blake2b(str(i).encode(), digest_size=16).digest()) == big[i:]
    assert not [p for p in tmp_path.iterdir() if p.suffix != SUFFIX and p.name != LOCK_NAME]  # no partial file
    t.close()


def test_one_process_owns_a_tier_directory_at_a_time(tmp_path):
    first = tier(tmp_path)
    first.put(key(0), payload(0))
    code = f"from tokenlake.engines.tier_files import TierFiles; TierFiles({str(tmp_path)!r}, 1 << 20, {{}})"
    busy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert busy.returncode != 0 and "in use by another process" in busy.stderr
    first.close()
    free = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert free.returncode == 0, free.stderr


def test_a_file_whose_name_is_not_its_key_in_canonical_form_is_not_adopted(tmp_path):
    t = tier(tmp_path)
    t.put(key(0), payload(0))
    good = tmp_path / (key(0).hex() + SUFFIX)
    (tmp_path / (key(0).hex().upper() + SUFFIX)).write_bytes(good.read_bytes())  # the same key, twice
    again = tier(tmp_path)
    assert list(again.keys()) == [key(0)] and again.used_bytes == good.stat().st_size
    assert any("not its key" in why for why in again.refused)


def test_a_put_that_fails_keeps_the_old_copy_and_its_accounting(tmp_path, monkeypatch):
    t = tier(tmp_path)
    t.put(key(0), payload(0))
    used = t.used_bytes

    def broken(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError, match="No space"):
        t.put(key(0), payload(1))
    monkeypatch.undo()
    assert t.get(key(0)) == payload(0) and t.used_bytes == used
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([key(0).hex() + SUFFIX, LOCK_NAME])


def test_a_closed_tier_refuses_its_use(tmp_path):
    t = tier(tmp_path)
    t.put(key(0), payload(0))
    t.close()
    for use in (lambda: t.put(key(1), payload(1)), lambda: t.get(key(0)), lambda: t.remove(key(0))):
        with pytest.raises(ConfigError, match="closed"):
            use()


def test_a_host_memory_tier_keeps_copies_until_dropped_and_refuses_beyond_its_rows():
    import torch

    from tokenlake.engines.tier_store import HostTier

    tier = HostTier(3 * 64 + 10, 64)  # three rows of 64 bytes
    slots = [torch.full((64,), i, dtype=torch.uint8) for i in range(5)]
    for i in range(3):
        assert tier.stage(bytes([i]), slots[i], [i])
    assert not tier.stage(b"\x03", slots[3]), "a fourth copy has no row"
    assert not tier.stage(b"\x04", slots[4][:32]), "a view that is not one slot"
    out = torch.zeros(64, dtype=torch.uint8)
    assert tier.read_into(b"\x00", out) and torch.equal(out, slots[0])
    assert [k for k, _ in tier.listing()] == [b"\x01", b"\x02", b"\x00"]  # least recently used first
    assert tier.stage(b"\x01", slots[4])  # written again: its row, the new bytes
    assert tier.read_into(b"\x01", out) and torch.equal(out, slots[4])
    tier.drop(b"\x02")
    assert not tier.read_into(b"\x02", out) and torch.equal(out, slots[4]), "a miss leaves out alone"
    assert tier.stage(b"\x03", slots[3])  # the dropped copy's row
    assert tier.read_into(b"\x00", out) and torch.equal(out, slots[0]), "no row was shared"
    assert dict(tier.listing())[b"\x00"] == [0]
    tier.close()


def test_a_copy_for_a_gpu_slot_wraps_the_files_bytes_without_copying_them(monkeypatch):
    """``_copy_in`` towards a slot off the CPU (here a ``meta`` tensor standing in for a
    GPU's): the bytearray a file was read into is handed to torch as it is; staged bytes
    (immutable) are copied once; a length that differs is refused."""
    import torch

    import tokenlake.engines.tier_store as tier_store

    seen = []
    real = torch.frombuffer
    monkeypatch.setattr(tier_store.torch, "frombuffer", lambda buf, **kw: seen.append(buf) or real(buf, **kw))
    out = torch.empty(4096, dtype=torch.uint8, device="meta")
    data = bytearray(payload(0))
    tier_store._copy_in(data, out)
    tier_store._copy_in(payload(1), out)
    assert seen[0] is data and isinstance(seen[1], bytearray) and bytes(seen[1]) == payload(1)
    with pytest.raises(ValueError, match="4095 bytes for a slot of 4096"):
        tier_store._copy_in(bytearray(4095), out)


def test_closing_waits_for_a_read_in_progress_and_refuses_what_comes_after(tmp_path):
    """A read that holds the tier when it is closed ends with its bytes (the hash
    threads are not shut under it); a read after the close is refused as closed."""
    import threading

    t = tier(tmp_path)
    t.put(key(0), payload(0))
    inside, go, got = threading.Event(), threading.Event(), []
    hash_chunks = t._hash

    def held(*args):
        if not inside.is_set():
            inside.set()
            assert go.wait(30)
        return hash_chunks(*args)

    t._hash = held
    reader = threading.Thread(target=lambda: got.append(t.get(key(0))))
    reader.start()
    assert inside.wait(30)
    closer = threading.Thread(target=t.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "the close did not wait for the read"
    go.set()
    reader.join(30)
    closer.join(30)
    assert got == [payload(0)]
    with pytest.raises(ConfigError, match="closed"):
        t.get(key(0))
