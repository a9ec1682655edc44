"""Shared buffers across real processes (docs/design.md §4 "Shared buffers", "Failure").

Children are started with the "spawn" context (a fresh interpreter, as engines are) and
synchronise through pipes with timeouts: no sleeps, no hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys

import pytest
import torch

from tokenlake.core.errors import TokenLakeError
from tokenlake.dataplane import shm_files
from tokenlake.dataplane.shm import BufferRegistry, SharedTensor
from tokenlake.dataplane.shm_files import (
    BufferExists,
    BufferMissing,
    BufferSizeMismatch,
    BufferSpec,
    SharedMemoryError,
    cluster_prefix,
    list_buffers,
    new_cluster_id,
    sweep_stale,
)

TIMEOUT_S = 30.0
CTX = mp.get_context("spawn")


@pytest.fixture
def prefix():
    """A fresh cluster prefix; whatever a test leaves under it is removed (and reported)."""
    p = cluster_prefix(new_cluster_id())
    yield p
    leftovers = list_buffers(p)
    for name in leftovers:
        shm_files.unlink_buffer(name)
    assert leftovers == [], f"test leaked shared buffers: {leftovers}"


def _recv(conn, what: str):
    assert conn.poll(TIMEOUT_S), f"child did not answer in {TIMEOUT_S}s ({what})"
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise AssertionError(f"child failed: {msg[1]}")
    return msg


def _join(proc) -> int:
    proc.join(TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(TIMEOUT_S)
        raise AssertionError("child did not exit in time")
    return proc.exitcode


def _mapped_paths(t: torch.Tensor) -> list[str]:
    """Files mapped at the tensor's data address, from /proc/self/maps."""
    addr = t.data_ptr()
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi and len(fields) == 6:
                paths.append(fields[5].strip())
    return paths


# --------------------------------------------------------------------------- children


def _child_roundtrip(spec_dict, conn) -> None:
    """Attach, write a pattern, let the parent check, then read the parent's pattern."""
    try:
        st = SharedTensor.attach(BufferSpec.from_dict(spec_dict))
        st.tensor.copy_(torch.arange(st.tensor.numel(), dtype=st.tensor.dtype).view_as(st.tensor))
        conn.send("written")
        assert conn.recv() == "your turn"
        conn.send(float(st.tensor.sum()))
        st.close()
    except BaseException as e:  # report instead of dying silently
        conn.send(("error", repr(e)))


def _child_attach_and_hang(spec_dicts, own_name, conn) -> None:
    """Attach every buffer, create one of its own (as an engine would), then wait forever."""
    try:
        views = [SharedTensor.attach(BufferSpec.from_dict(d)) for d in spec_dicts]
        for v in views:
            v.tensor.fill_(7)
        SharedTensor.create(BufferSpec(own_name, (16,), "float32"))  # never unlinked by us
        conn.send("ready")
        conn.recv()  # blocks until killed
    except BaseException as e:
        conn.send(("error", repr(e)))


def _child_cuda(spec_dict, conn) -> None:
    try:
        st = SharedTensor.attach(BufferSpec.from_dict(spec_dict))
        st.tensor.fill_(3)
        torch.cuda.synchronize()
        conn.send("written")
        assert conn.recv() == "your turn"
        conn.send(float(st.tensor.sum()))
        st.close()
    except BaseException as e:
        conn.send(("error", repr(e)))


# --------------------------------------------------------------------------- specs, names


def test_spec_roundtrips_through_plain_data_and_validates():
    spec = BufferSpec("tokenlake-1-ab-q", (2, 3), "bfloat16")
    assert BufferSpec.from_dict(spec.to_dict()) == spec
    assert BufferSpec.from_dict({**spec.to_dict(), "shape": [2, 3]}).shape == (2, 3)
    assert spec.nbytes == 12
    for bad in (
        dict(name="a/b", shape=(1,), dtype="float32"),
        dict(name="..", shape=(1,), dtype="float32"),
        dict(name="x", shape=(0,), dtype="float32"),
        dict(name="x", shape=(), dtype="float32"),
        dict(name="x", shape=(2,), dtype="complex64"),
        dict(name="x", shape=(2,), dtype="float32", device="tpu"),
        dict(name="x", shape=(2,), dtype="float32", ipc_handle=b"h"),
    ):
        with pytest.raises(SharedMemoryError):
            BufferSpec(**bad)
    with pytest.raises(SharedMemoryError, match="malformed"):
        BufferSpec.from_dict({"name": "x"})


def test_cluster_names_carry_the_creator_pid():
    cid = new_cluster_id()
    assert cid.startswith(f"{os.getpid()}-")
    assert cluster_prefix(cid) == f"tokenlake-{cid}-"
    with pytest.raises(SharedMemoryError):
        cluster_prefix("a/b")


# --------------------------------------------------------------------------- CPU sharing


def test_child_and_parent_see_each_others_writes_without_copies(prefix):
    spec = BufferSpec(prefix + "q", (64, 32), "float32")
    owner = SharedTensor.create(spec)
    t = owner.tensor
    ptr = t.data_ptr()
    assert t.shape == (64, 32) and t.dtype == torch.float32 and not t.any()
    if os.path.exists("/proc/self/maps"):  # the tensor *is* the shm file's mapping
        assert os.path.join(shm_files.shm_dir(), spec.name) in _mapped_paths(t)

    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_child_roundtrip, args=(spec.to_dict(), child))
    proc.start()
    try:
        assert _recv(parent, "write") == "written"
        assert torch.equal(t, torch.arange(64 * 32, dtype=torch.float32).view(64, 32))
        assert t.data_ptr() == ptr  # same memory, nothing re-read or copied
        t.fill_(2.0)
        parent.send("your turn")
        assert _recv(parent, "read") == 2.0 * 64 * 32
    finally:
        assert _join(proc) == 0

    assert list_buffers(prefix) == [spec.name]  # a peer's exit does not remove it
    owner.unlink()
    assert list_buffers(prefix) == []
    t.add_(1)  # an unlinked buffer stays mapped for whoever still holds it
    assert float(t[0, 0]) == 3.0
    owner.close()
    owner.close()
    owner.unlink()  # idempotent
    with pytest.raises(SharedMemoryError, match="closed"):
        owner.tensor  # noqa: B018


def test_create_twice_and_bad_attaches_raise_clear_errors(prefix):
    spec = BufferSpec(prefix + "kv", (4, 8), "float32")
    with SharedTensor.create(spec) as owner:
        with pytest.raises(BufferExists) as e:
            SharedTensor.create(spec)
        assert isinstance(e.value, FileExistsError) and isinstance(e.value, TokenLakeError)
        for bigger in ((4, 9), (4, 8, 2)):
            with pytest.raises(BufferSizeMismatch, match="needs"):
                SharedTensor.attach(BufferSpec(spec.name, bigger, "float32"))
        with pytest.raises(BufferSizeMismatch):
            SharedTensor.attach(BufferSpec(spec.name, (4, 8), "float64"))
        assert os.path.getsize(os.path.join(shm_files.shm_dir(), spec.name)) == 128  # not grown
        with SharedTensor.attach(spec) as peer:
            peer.tensor[1, 2] = 5.0
            assert float(owner.tensor[1, 2]) == 5.0
            with pytest.raises(SharedMemoryError, match="owner"):
                peer.unlink()
    assert list_buffers(prefix) == []  # the owner's context manager unlinked it
    with pytest.raises(BufferMissing) as e:
        SharedTensor.attach(spec)
    assert isinstance(e.value, FileNotFoundError)


def test_fallback_directory_without_dev_shm(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_files, "_DEV_SHM", str(tmp_path / "no-such-dir"))
    monkeypatch.setattr(shm_files.tempfile, "gettempdir", lambda: str(tmp_path))
    spec = BufferSpec(cluster_prefix(new_cluster_id()) + "o", (3,), "int32")
    with SharedTensor.create(spec) as st, SharedTensor.attach(spec) as peer:
        st.tensor[:] = torch.tensor([1, 2, 3], dtype=torch.int32)
        assert peer.tensor.tolist() == [1, 2, 3]
        assert (tmp_path / "tokenlake-shm" / spec.name).exists()
    assert list(os.listdir(tmp_path / "tokenlake-shm")) == []


# --------------------------------------------------------------------------- buffers without a tensor


def test_create_buffer_makes_exactly_the_size_unmapped_and_attachable(prefix):
    name = prefix + "host-q"
    file = shm_files.create_buffer(name, 24)
    path = os.path.join(shm_files.shm_dir(), name)
    st = os.stat(path)
    assert file == shm_files.BufferFile(name, path, 24, st.st_ino)
    assert st.st_size == 24 and (st.st_mode & 0o777) == 0o600
    if hasattr(os, "posix_fallocate"):  # the pages are reserved now, not at the first write
        assert st.st_blocks * 512 >= 24
    with open(path, "rb") as f:
        assert f.read() == bytes(24)
    assert file.is_current() and shm_files.stat_buffer(name) == file
    with SharedTensor.attach(BufferSpec(name, (2, 3), "float32")) as peer:  # 2*3*4 bytes
        peer.tensor.fill_(1.5)
    with open(path, "rb") as f:
        assert torch.frombuffer(bytearray(f.read()), dtype=torch.float32).tolist() == [1.5] * 6
    assert shm_files.unlink_prefix(prefix) == [name]
    assert not file.is_current() and list_buffers(prefix) == []


def test_create_buffer_refuses_a_taken_name_and_leaves_it_alone(prefix):
    name = prefix + "taken"
    with SharedTensor.create(BufferSpec(name, (4,), "uint8")) as owner:
        owner.tensor.fill_(9)
        with pytest.raises(BufferExists) as e:
            shm_files.create_buffer(name, 1024)
        assert isinstance(e.value, FileExistsError) and isinstance(e.value, TokenLakeError)
        assert os.path.getsize(os.path.join(shm_files.shm_dir(), name)) == 4
        assert owner.tensor.tolist() == [9, 9, 9, 9]
    assert list_buffers(prefix) == []


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_create_buffer_unlinks_what_it_made_when_reserving_fails(prefix, monkeypatch, error):
    def fail(fd, offset, length):
        raise error

    monkeypatch.setattr(shm_files.os, "posix_fallocate", fail, raising=False)
    expected = SharedMemoryError if isinstance(error, OSError) else KeyboardInterrupt
    with pytest.raises(expected):
        shm_files.create_buffer(prefix + "big", 1 << 20)
    assert list_buffers(prefix) == []


def test_create_buffer_rejects_bad_names_and_sizes_without_creating(prefix):
    for bad_size in (0, -1, 1.5, True):
        with pytest.raises(SharedMemoryError, match="size"):
            shm_files.create_buffer(prefix + "x", bad_size)
    for bad_name in ("a/b", "..", "-x", ""):
        with pytest.raises(SharedMemoryError, match="invalid buffer name"):
            shm_files.create_buffer(bad_name, 8)
    assert list_buffers(prefix) == []


def test_the_file_layer_and_the_specs_import_without_torch():
    """The Ray host actor creates buffers through shm_files and builds specs: neither may
    load torch (nor msgpack, which only the CUDA handle needs)."""
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # any attempt to import torch now fails
        "from tokenlake.dataplane import shm, shm_files\n"
        "p = shm_files.cluster_prefix(shm_files.new_cluster_id())\n"
        "spec = shm.BufferSpec(p + 'q', (2, 3), 'float32')\n"
        "print(shm_files.create_buffer(spec.name, spec.nbytes).nbytes)\n"
        "print(shm_files.unlink_prefix(p) == [spec.name])\n"
        "print(sorted(m for m in ('torch', 'msgpack') if sys.modules.get(m)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["24", "True", "[]"]


# --------------------------------------------------------------------------- cleanup


def test_registry_cleanup_after_a_child_was_sigkilled(prefix):
    registry = BufferRegistry(prefix)
    specs = [BufferSpec(prefix + f"i0-{role}", (128,), "float16") for role in ("q", "kv", "out")]
    bufs = [registry.create(s) for s in specs]
    with pytest.raises(SharedMemoryError, match="outside"):
        registry.create(BufferSpec("tokenlake-other-x", (1,), "float32"))
    parent, child = CTX.Pipe()
    child_own = prefix + "i0-child-scratch"
    proc = CTX.Process(
        target=_child_attach_and_hang, args=([s.to_dict() for s in specs], child_own, child)
    )
    proc.start()
    try:
        assert _recv(parent, "attach") == "ready"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        assert _join(proc) == -signal.SIGKILL
    assert all(float(b.tensor.sum()) == 7 * 128 for b in bufs)  # its writes landed
    assert len(list_buffers(prefix)) == 4

    removed = registry.cleanup()
    assert sorted(removed) == sorted([s.name for s in specs] + [child_own])
    assert list_buffers(prefix) == []
    assert all(b.closed for b in bufs)
    assert registry.cleanup() == [] and registry.names == []  # idempotent


def test_registry_cleans_up_at_interpreter_exit(prefix):
    code = (
        "import sys\n"
        "from tokenlake.dataplane.shm import BufferRegistry\n"
        "from tokenlake.dataplane.shm_files import BufferSpec\n"
        "r = BufferRegistry(sys.argv[1])\n"
        "r.create(BufferSpec(sys.argv[1] + 'a', (4,), 'float32'))\n"
        "print('created', flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, prefix], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "created"
    assert list_buffers(prefix) == []


def test_sweep_stale_removes_dead_creators_only(prefix):
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait(TIMEOUT_S)
    dead_prefix = cluster_prefix(f"{dead.pid}-{os.urandom(4).hex()}")
    live_prefix = prefix  # this process's pid
    opaque = "tokenlake-nopid-" + os.urandom(4).hex()
    names = [dead_prefix + "a", dead_prefix + "b", live_prefix + "a", opaque]
    for name in names:
        SharedTensor.create(BufferSpec(name, (2,), "uint8")).close()
    try:
        assert sweep_stale(dead_prefix) == [dead_prefix + "a", dead_prefix + "b"]
        assert sweep_stale(live_prefix) == []
        assert sweep_stale(opaque) == []
        assert list_buffers(dead_prefix) == []
        assert list_buffers(live_prefix) == [live_prefix + "a"]
        assert list_buffers(opaque) == [opaque]
    finally:
        for name in names:
            shm_files.unlink_buffer(name)


# --------------------------------------------------------------------------- CUDA


def test_cuda_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    with pytest.raises(SharedMemoryError, match="CUDA is unavailable"):
        SharedTensor.create(BufferSpec("tokenlake-1-ab-g", (4,), "float32", device="cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_roundtrip_across_processes():
    spec = BufferSpec(cluster_prefix(new_cluster_id()) + "g", (256, 4), "float32", "cuda:0")
    owner = SharedTensor.create(spec)
    assert owner.spec.ipc_handle is not None and owner.tensor.is_cuda
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_child_cuda, args=(owner.spec.to_dict(), child))
    proc.start()
    try:
        assert _recv(parent, "write") == "written"
        assert float(owner.tensor.sum()) == 3.0 * 1024
        owner.tensor.fill_(5)
        torch.cuda.synchronize()
        parent.send("your turn")
        assert _recv(parent, "read") == 5.0 * 1024
    finally:
        assert _join(proc) == 0
    owner.close()
    owner.unlink()
