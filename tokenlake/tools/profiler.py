"""Measure this machine's roofline numbers as a :class:`~tokenlake.core.specs.HardwareProfile`.

Four measurements, best of a few repeats each, about 10-20 s in all at default sizes:

* memory read bandwidth: summing a large float32 array (numpy; torch too if importable,
  which sums with several threads), bytes/s;
* compute: an ``n x n`` float32 matmul (numpy BLAS; torch too if importable), FLOP/s;
* instance-to-instance transfer: a pyzmq PAIR socket over TCP loopback to a second
  process -- one-way latency (half the median round trip of 1-byte messages) and
  bandwidth of one large message. Without pyzmq: memcpy bandwidth and the documented
  estimate :data:`FALLBACK_LATENCY_S`;
* the disk tier's read bandwidth: segment-sized files written to a temporary directory
  as the tier writes them (:class:`~tokenlake.engines.tier_files.TierFiles`, flushed),
  dropped from the page cache (``posix_fadvise``), then read back with their digests
  checked, bytes/s (``TMPDIR`` names the disk).

Run ``tokenlake profile-cpu --out tokenlake/data/hardware.json --merge`` to
re-measure the shipped ``cpu`` profile. numpy, torch and zmq are imported by the measurement
that uses them: torch and zmq are optional here, and the command line imports this module
for its defaults without loading any of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from tokenlake.core.errors import ConfigError
from tokenlake.core.specs import HardwareProfile

FALLBACK_LATENCY_S = 30e-6  # typical one-way zmq TCP loopback latency; used without pyzmq
_MIB = 1 << 20
_ECHO_LIMIT = 64  # the echo peer returns messages up to this many bytes, else a 1-byte ack
_TIMEOUT_MS = 10_000  # every receive from the peer times out (docs/design.md §4, Failure)


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn`` after one warm-up call, seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _torch() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def measure_mem_bw(mib: int = 256, repeats: int = 5) -> tuple[float, str]:
    """Read bandwidth (bytes/s) summing a ``mib`` MiB float32 array; and which library won."""
    import numpy as np

    arr = np.ones(mib * _MIB // 4, dtype=np.float32)
    results = {"numpy": arr.nbytes / _best_time(arr.sum, repeats)}
    torch = _torch()
    if torch is not None:
        t = torch.from_numpy(arr)
        results["torch"] = arr.nbytes / _best_time(t.sum, repeats)
    best = max(results, key=results.__getitem__)
    return results[best], best


def measure_matmul_flops(n: int = 2048, repeats: int = 5) -> tuple[float, str]:
    """float32 FLOP/s of an ``n x n`` matmul (``2 n^3`` FLOPs); and which library won."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    flops = 2.0 * n**3
    results = {"numpy": flops / _best_time(lambda: a @ b, repeats)}
    torch = _torch()
    if torch is not None:
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        results["torch"] = flops / _best_time(lambda: ta @ tb, repeats)
    best = max(results, key=results.__getitem__)
    return results[best], best


def _echo_peer(port: int) -> None:
    """The second process: echo small messages, ack large ones, stop on an empty one."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, _TIMEOUT_MS)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        while True:
            msg = sock.recv(copy=False)
            if len(msg) == 0:
                break
            sock.send(msg if len(msg) <= _ECHO_LIMIT else b"k", copy=False)
    finally:
        sock.close()
        ctx.term()


def _zmq_transfer(mib: int, repeats: int, pings: int = 200) -> tuple[float, float]:
    """(bandwidth bytes/s, one-way latency s) over TCP loopback to a child process."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, _TIMEOUT_MS)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    code = f"from tokenlake.tools.profiler import _echo_peer; _echo_peer({port})"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        rtts = []
        for _ in range(pings):
            start = time.perf_counter()
            sock.send(b"p")
            sock.recv()
            rtts.append(time.perf_counter() - start)
        rtt = sorted(rtts)[len(rtts) // 2]
        payload = bytes(mib * _MIB)

        def one() -> None:
            sock.send(payload, copy=False)
            sock.recv()

        elapsed = _best_time(one, repeats)
        sock.send(b"")
        child.wait(timeout=_TIMEOUT_MS / 1000)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        sock.close()
        ctx.term()
    return len(payload) / max(elapsed - rtt, 1e-9), rtt / 2


def _memcpy_transfer(mib: int, repeats: int) -> tuple[float, float]:
    """(memcpy bandwidth bytes/s, :data:`FALLBACK_LATENCY_S`)."""
    import numpy as np

    src = np.ones(mib * _MIB, dtype=np.uint8)
    dst = np.empty_like(src)
    return src.nbytes / _best_time(lambda: np.copyto(dst, src), repeats), FALLBACK_LATENCY_S


def measure_transfer(mib: int = 64, repeats: int = 3, mode: str = "auto") -> tuple[float, float, str]:
    """(bandwidth bytes/s, one-way latency s, method) between two local processes.

    ``mode``: ``"zmq"``, ``"memcpy"``, or ``"auto"`` (zmq if importable).
    """
    if mode not in ("auto", "zmq", "memcpy"):
        raise ConfigError(f"mode must be one of auto, zmq, memcpy; got {mode!r}")
    if mode == "auto":
        try:
            import zmq  # noqa: F401
        except ImportError:
            mode = "memcpy"
        else:
            mode = "zmq"
    if mode == "zmq":
        bw, lat = _zmq_transfer(mib, repeats)
        return bw, lat, f"pyzmq PAIR over tcp 127.0.0.1, {mib} MiB message"
    bw, lat = _memcpy_transfer(mib, repeats)
    return bw, lat, f"numpy memcpy of {mib} MiB; latency is the fixed estimate {FALLBACK_LATENCY_S}"


def measure_tier_read(mib: int = 64, file_mib: int = 16, layers: int = 32, repeats: int = 3) -> float:
    """Bytes/s of reading ``mib`` MiB of tier files of ``file_mib`` MiB each from the disk
    (page cache dropped before each pass), digests checked (one per ``1 / layers`` of a
    file, as the engines write them: one per layer of a segment): best of ``repeats``."""
    import tempfile
    from pathlib import Path

    from tokenlake.engines.tier_files import SUFFIX, TierFiles

    data = os.urandom(file_mib * _MIB)
    n = max(1, mib // file_mib)
    with tempfile.TemporaryDirectory(prefix="tokenlake-tier-profile-") as tmp, \
            TierFiles(tmp, 2 * n * (file_mib * _MIB + 4096), {"profile": 1},
                      chunk_bytes=file_mib * _MIB // layers) as files:
        keys = [i.to_bytes(16, "big") for i in range(n)]
        for key in keys:
            files.put(key, data)
        slot = bytearray(len(data))

        def read_all() -> None:
            for path in Path(tmp).glob(f"*{SUFFIX}"):
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            for key in keys:  # as a promotion reads: straight into the slot
                files.get_into(key, slot)

        best = float("inf")
        for _ in range(repeats):  # the page cache dropped inside each timed pass
            start = time.perf_counter()
            read_all()
            best = min(best, time.perf_counter() - start)
    return n * len(data) / best


def measure_host_tier(mib: int = 256, slot_mib: int = 4, repeats: int = 3) -> float:
    """Bytes/s of copying ``mib`` MiB out of a host-memory tier's buffer into a slab's
    slots, ``slot_mib`` MiB at a time (what a promotion from it does on the CPU): best of
    ``repeats``."""
    import torch

    n = max(1, mib // slot_mib)
    tier = torch.randint(0, 255, (n, slot_mib * _MIB), dtype=torch.uint8)
    slab = torch.empty_like(tier)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for row in range(n):
            slab[n - 1 - row].copy_(tier[row])
        best = min(best, time.perf_counter() - start)
    return tier.numel() / best


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (measurements are not more precise)."""
    return float(f"{x:.{digits}g}")


def _physical_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def profile_cpu(mem_mib: int = 256, matmul_n: int = 2048, transfer_mib: int = 64,
                repeats: int = 8, transfer: str = "auto", name: str = "cpu") -> HardwareProfile:
    """Measure this machine; small arguments make a quick (less accurate) run for tests."""
    mem_bw, mem_lib = measure_mem_bw(mem_mib, repeats)
    flops, mm_lib = measure_matmul_flops(matmul_n, repeats)
    net_bw, latency, how = measure_transfer(transfer_mib, max(1, repeats // 2 + 1), transfer)
    tier_bw = measure_tier_read(max(8, transfer_mib), repeats=max(1, repeats // 3))
    host_bw = measure_host_tier(max(8, mem_mib), repeats=max(1, repeats // 3))
    notes = (
        f"Measured by tokenlake profile-cpu on {os.cpu_count()} logical CPUs on "
        f"{time.strftime('%Y-%m-%d')}: mem_bw = best sum over a {mem_mib} MiB float32 array "
        f"({mem_lib}); flops = best float32 {matmul_n}x{matmul_n} matmul ({mm_lib}); "
        f"net = {how}; tier_read_bw = tier files of 16 MiB (32 digests each) read back from the disk (page cache "
        f"dropped), digests checked; host_tier_bw = slots of 4 MiB copied from a host-memory "
        f"tier's buffer into a slab; mem_bytes = physical RAM. Regenerate with: "
        "tokenlake profile-cpu --out tokenlake/data/hardware.json --merge"
    )
    return HardwareProfile(name=name, flops=_sig(flops), mem_bw=_sig(mem_bw), net_bw=_sig(net_bw),
                           net_latency_s=_sig(latency), mem_bytes=_physical_memory_bytes(),
                           notes=notes, shared_host=True, tier_read_bw=_sig(tier_bw),
                           host_tier_bw=_sig(host_bw))


def write_profile(profile: HardwareProfile, path: str, merge: bool) -> None:
    """Write ``{name: fields}``; with ``merge`` update that entry of an existing table."""
    table: dict[str, Any] = {}
    if merge and os.path.exists(path):
        with open(path, encoding="utf-8") as fh:
            table = json.load(fh)
    entry = profile.to_dict()
    table[entry.pop("name")] = entry
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(table, fh, indent=2)
        fh.write("\n")
