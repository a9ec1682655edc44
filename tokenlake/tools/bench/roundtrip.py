"""``tokenlake bench roundtrip``: what one layer's pool query costs a compute engine on
one host beyond the attention itself.

A one-page prefix (16 tokens of SmolLM2-135M's shape, 30 layers) is stored in a local
pool of one instance; then 1 or 8 decode rows over it (8: eight requests sharing the
prefix) are registered once and, layer after layer, asked of the pool
(``InstanceClient.query``) and, alternately in the same loop, attended in this process by
the very call the query engine makes (``prepare_slabs_attention``, set up once for the
plan) on the same slab:

* ``roundtrip_us``: one layer's ``client.query`` (the compute engine's wait), by the path
  the pool uses on one host: the session's bell in shared memory (doorbell.py), right
  after the kernel call below, without a heads-up (the query engine has gone idle
  meanwhile and wakes on the post);
* ``heads_up_roundtrip_us``: the same as a decode step makes it: a heads-up
  (``client.expect_query()``) before a kernel call that stands in for computing q, so
  the engine's wake-up overlaps it (docs/data-plane.md "Doorbells");
* ``attention_us``: the engine's attention call alone on the same rows and slot;
* ``overhead_us``: their difference, what the hand-off costs;
* ``fifo_pingpong_us``: the floor of any wake-up on this machine, a byte to another
  process and back through FIFOs, both sides sleeping in ``poll`` or both spinning;
* ``socket_roundtrip_us``: one layer's query by the socket path (``QUERY``/``QUERY_DONE``
  messages, as towards a pool without bells); ``ping_us``: a bare ``PING`` to the query
  engine and back (the floor of any message, CURVE included).

Each is a dict keyed by rows (``"1"``, ``"8"``) of ``{"median", "min", "max", "p90"}`` in
microseconds over every layer of every repeat. The pool runs with its defaults (CURVE on,
co-located slabs, 2 query threads); ``isa`` is what the CPU offers the native kernels.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

ROWS = (1, 8)
PAGE = 16  # tokens: the prefix is one page, a whole segment of C = 16


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 1), "min": round(ordered[0], 1),
            "max": round(ordered[-1], 1), "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1)}


def _store(cluster, doc: list[int]) -> None:
    """The prefix, stored through the real put path (random K/V)."""
    from tokenlake.core.plans import Batch, BatchRequest

    cp = cluster.control
    plans = cp.gen_plans([Batch((BatchRequest("doc", tuple(doc)),))], [1])
    (tp,) = plans.transfer_plans
    client = cluster.client(tp.home)
    client.init_transfer(tp).normal_()
    client.put(0, cluster.model.num_layers).wait(timeout_s=60)
    cp.complete(plans)
    cp.finish_request("doc")


def _measure(cluster, doc: list[int], rows: int, repeats: int) -> dict[str, list[float]]:
    """Per-layer times (µs) of the pool query and of the kernel alone, alternating."""
    from tokenlake.core.plans import Batch, BatchRequest
    from tokenlake.dataplane.messages import Ping, Pong
    from tokenlake.kernels.slab import prepare_slabs_attention

    cp = cluster.control
    reqs = tuple(BatchRequest(f"r{i}", (5 + i,), tuple(doc)) for i in range(rows))
    plans = cp.gen_plans([Batch(reqs)], [1])
    (qp,) = plans.query_plans
    assert all(s.prefix_tokens == PAGE for s in qp.spans), "the prefix was not hit"
    client = cluster.client(qp.home)
    q = client.init_query(qp)
    q.normal_()
    slab = cluster.slab(qp.home)
    slot = cp.get_prefix_tree().replicas(cp.get_prefix_tree().match(doc).keys[0])[0].slot
    client.heads_up = True  # (the default, unless TOKENLAKE_BELL_HEADS_UP=0)
    client.query(0)
    out_path = "bell" if client._bell is not None else "socket"
    attend = _gpu_attention(slab, rows, slot) if slab.is_cuda else \
        prepare_slabs_attention(rows, q.shape[1], [slab], [0], [slot], [PAGE])
    out: dict = {"roundtrip": [], "heads_up": [], "socket": [], "attention": [], "ping": [], "path": out_path}
    try:
        for rep in range(repeats + 1):  # the first repeat warms up
            for layer in range(cluster.model.num_layers):
                t0 = time.perf_counter()
                attend(q[:rows], layer)  # the kernel alone, which also stands in for the layer's work
                t1 = time.perf_counter()
                client.query(layer)  # by the bell, as every query is by default
                t2 = time.perf_counter()
                client.fast = False
                try:
                    client.query(layer)
                finally:
                    client.fast = True
                t3 = time.perf_counter()
                cluster._request(("query", qp.home), Ping(), Pong)
                t4 = time.perf_counter()
                client.expect_query()  # as a decode step does: ...
                attend(q[:rows], layer)  # ... the engine wakes while q is computed
                t5 = time.perf_counter()
                client.query(layer)
                t6 = time.perf_counter()
                if rep:
                    out["attention"].append((t1 - t0) * 1e6)
                    out["roundtrip"].append((t2 - t1) * 1e6)
                    out["socket"].append((t3 - t2) * 1e6)
                    out["ping"].append((t4 - t3) * 1e6)
                    out["heads_up"].append((t6 - t5) * 1e6)
    finally:
        cp.abort(plans)  # the rows were admitted by this iteration: the abort undoes them
    return out


def _gpu_attention(slab, rows: int, slot: int) -> Callable:
    """A GPU query engine's call for these rows over the slot (every row in one entry,
    as a prefix that the rows share is), waited for: what the engine does per layer."""
    import torch

    from tokenlake.kernels.paged_torch import gpu_slab_attention

    def attend(q, layer: int) -> None:
        gpu_slab_attention(q, slab, layer, [(0, rows, [slot], [PAGE])])
        torch.cuda.current_stream(slab.device).synchronize()

    return attend


def _receive(fd: int, poll) -> bytes:
    """One byte from ``fd``: sleeping in ``poll`` (a poll object) or spinning (None)."""
    import os

    while True:
        if poll is not None:
            poll.poll(1000)
        try:
            return os.read(fd, 1)
        except BlockingIOError:
            continue


def fifo_pingpong(rounds: int = 1000) -> dict[str, float]:
    """The floor of any wake-up here: a byte through a FIFO to a child process and back,
    both sleeping in ``poll`` (``sleeping``), and both spinning on the FIFO instead
    (``spinning``); µs, medians. The child only reads and writes (it is forked)."""
    import os
    import select
    import tempfile

    out = {}
    for mode in ("sleeping", "spinning"):
        with tempfile.TemporaryDirectory() as tmp:
            paths = [os.path.join(tmp, "there"), os.path.join(tmp, "back")]
            for path in paths:
                os.mkfifo(path)
            fds = [os.open(path, os.O_RDWR | os.O_NONBLOCK) for path in paths]
            pid = os.fork()
            mine, theirs = (fds[1], fds[0]) if pid else (fds[0], fds[1])
            poll = None
            if mode == "sleeping":
                poll = select.poll()
                poll.register(mine, select.POLLIN)
            if not pid:  # the child: echo until told to stop
                while _receive(mine, poll) != b"q":
                    os.write(theirs, b"x")
                os._exit(0)
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                os.write(theirs, b"p")
                _receive(mine, poll)
                times.append((time.perf_counter() - t0) * 1e6)
                end = time.perf_counter() + 200e-6  # as between two layers: the other side idles
                while time.perf_counter() < end:
                    pass
            os.write(theirs, b"q")
            os.waitpid(pid, 0)
            for fd in fds:
                os.close(fd)
        out[mode] = round(statistics.median(times), 1)
    return out


def bench_roundtrip(repeats: int = 20, progress: Callable[[str], None] = lambda line: None,
                    device: str = "cpu") -> dict:
    """The figures of the module docstring, as JSON-ready data. ``device`` ``"cuda"``:
    the pool's buffers on the GPU, bfloat16 K/V, the attention alone being the GPU
    query engine's call (``gpu``, ``gpu_setup``: the GPU's name, MPS, the kernels)."""
    import torch

    from tokenlake.core.specs import load_model
    from tokenlake.deploy.gpu import gpu_setup
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.kernels import native

    model = load_model("smollm2-135m")
    torch.set_num_threads(2)  # as the query engine's (query_threads)
    kv_dtype = "float32" if device == "cpu" else "bfloat16"
    seg = model.num_layers * 2 * model.num_kv_heads * PAGE * model.head_dim * 4
    doc = list(range(3, 3 + PAGE))
    mod = native.load()
    where = {} if device == "cpu" else {"gpu": torch.cuda.get_device_name(device), "gpu_setup": gpu_setup()}
    result: dict = {"isa": mod.isa() if mod is not None else None, "device": device, "kv_dtype": kv_dtype,
                    **where, "model": model.name, "layers": model.num_layers,
                    "prefix_tokens": PAGE, "repeats": repeats,
                    **{k: {} for k in ("roundtrip_us", "attention_us", "overhead_us",
                                       "socket_roundtrip_us", "heads_up_roundtrip_us", "ping_us")}}
    progress("a FIFO ping-pong with another process ...")
    result["fifo_pingpong_us"] = fifo_pingpong()
    progress("starting a one-instance pool ...")
    with LocalCluster(1, model, 64 * seg, segment_tokens=PAGE, max_rows=64, page_tokens=PAGE,
                      kv_dtype=kv_dtype, device=device) as cluster:
        _store(cluster, doc)
        for rows in ROWS:
            progress(f"{rows} rows: {repeats} x {model.num_layers} layers ...")
            got = _measure(cluster, doc, rows, repeats)
            key = str(rows)
            result["roundtrip_us"][key] = _stats(got["roundtrip"])
            result["path"] = got["path"]
            result["socket_roundtrip_us"][key] = _stats(got["socket"])
            result["heads_up_roundtrip_us"][key] = _stats(got["heads_up"])
            result["attention_us"][key] = _stats(got["attention"])
            result["overhead_us"][key] = _stats([a - b for a, b in zip(got["roundtrip"], got["attention"])])
            result["ping_us"][key] = _stats(got["ping"])
    return result


def print_report(result: dict) -> None:
    print(f"per-layer pool query, {result['model']} ({result['layers']} layers), one-page prefix "
          f"({result['prefix_tokens']} tokens), isa {result['isa']}; µs, median (min-max)")
    names = ("roundtrip_us", "attention_us", "overhead_us", "heads_up_roundtrip_us", "socket_roundtrip_us",
             "ping_us")
    print("rows  " + "".join(n.removesuffix("_us").replace("_roundtrip", "").ljust(20) for n in names))
    for rows in result["roundtrip_us"]:
        print(f"{rows:>4}  " + "".join(f"{result[k][rows]['median']:>7.1f} ({result[k][rows]['min']:.0f}-"
                                       f"{result[k][rows]['max']:.0f})".ljust(20) for k in names))
    fifo = result.get("fifo_pingpong_us")
    if fifo:
        print(f"a FIFO ping-pong with another process: {fifo['sleeping']} µs both sleeping, "
              f"{fifo['spinning']} µs both spinning (the floor of a wake-up)")
